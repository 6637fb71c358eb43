"""A task's streams as decisions (gateway.streams), played as plain calls: what an append is answered in
protocol.md's order (fencing, the sequence, room), where a read starts, and how a read is cut into pages."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from gateway.errors import Conflict, InvalidRequest, PayloadTooLarge
from gateway.machine import Fail, Start, Succeed, Task, apply_event, create_task
from gateway.streams import (
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    MAX_STREAMS,
    Append,
    Appended,
    Batch,
    Chunks,
    Head,
    Lookup,
    Page,
    Take,
    check_name,
    decide_append,
    duplicate,
    page_of,
    read_start,
    rows_to_read,
    text_of,
)

NOW = 1_000_000
LIMIT = 1_000


def running(attempts: int = 1) -> Task:
    task = create_task(id="t", now_ms=NOW, ttl_ms=600_000, max_attempts=3)
    for _ in range(attempts):
        task = apply_event(task, Start(NOW, "w")).task
        if task.attempts < attempts:
            task = apply_event(task, Fail(NOW, "boom", True)).task
    return task


def append(*chunks: str, seq: int = 0, attempt: int = 1, stream: str = "output") -> Append:
    return Append(stream, attempt, seq, Chunks.of(list(chunks)))


def taken(task: Task, head: Head | None, asked: Append, *, streams: int = 0, max_bytes: int = 100) -> Take:
    decided = decide_append(task, head, asked, streams=streams, max_bytes=max_bytes)
    assert isinstance(decided, Take)
    return decided


def refused(task: Task, head: Head | None, asked: Append, **kwargs: int) -> Conflict | PayloadTooLarge:
    with pytest.raises((Conflict, PayloadTooLarge)) as caught:
        decide_append(
            task, head, asked, streams=kwargs.get("streams", 0), max_bytes=kwargs.get("max_bytes", 100)
        )
    assert isinstance(caught.value, (Conflict, PayloadTooLarge))
    return caught.value


# --- names and chunks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["output", "log", "a", "x" * 32, "step_2-b"])
def test_a_stream_name_is_1_to_32_of_lowercase_letters_digits_underscore_and_dash(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "x" * 33, "Output", "a b", "a/b", "é", "a:b"])
def test_anything_else_is_not_a_stream_name_and_the_error_names_the_field(name: str) -> None:
    with pytest.raises(InvalidRequest, match=r"^streams\.x: a stream's name"):
        check_name(name, "streams.x")


def test_chunks_are_stored_as_the_json_array_with_their_count_and_size() -> None:
    chunks = Chunks.of(["héllo", " world\n", '"q"'])
    assert orjson.loads(chunks.encoded) == ["héllo", " world\n", '"q"']
    assert (chunks.count, chunks.size) == (3, len("héllo".encode()) + 7 + 3)


def test_the_same_chunks_are_encoded_the_same_whatever_the_escaping_of_the_body_that_carried_them() -> None:
    """The encoded array is what a retry is told by (:func:`duplicate`): one encoding for the same chunks,
    another for other chunks, and for the same text cut otherwise (another batch)."""
    sent = ["héllo", " world\n", '"q"\\', "\u2028\x00\U0001f642"]
    escaped = orjson.loads(rb'["h\u00e9llo"," world\u000a","\"q\"\\","\u2028\u0000\ud83d\ude42"]')
    assert escaped == sent
    assert Chunks.of(escaped).encoded == Chunks.of(sent).encoded
    assert (
        Chunks.of(["héllo", " world\n", '"Q"\\', "\u2028\x00\U0001f642"]).encoded != Chunks.of(sent).encoded
    )
    assert Chunks.of(["ab"]).encoded != Chunks.of(["a", "b"]).encoded


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([], "chunks: must be an array of 1 to 1000 strings"),
        (["x"] * (MAX_CHUNKS + 1), "chunks: must be an array"),
        ("abc", "chunks: must be an array"),
        (["a", 3], r"chunks\[1\]: must be a string"),
        (["a", ""], r"chunks\[1\]: must be 1 to 65536 bytes in UTF-8, got 0"),
        (["é" * (MAX_CHUNK_BYTES // 2 + 1)], r"chunks\[0\]: must be 1 to 65536 bytes in UTF-8, got 65538"),
    ],
)
def test_a_batch_holds_1_to_1000_chunks_each_of_1_byte_to_64_kib(chunks: object, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        Chunks.of(chunks)


def test_a_chunk_of_exactly_64_kib_and_a_batch_of_1000_chunks_are_taken() -> None:
    assert Chunks.of(["x" * MAX_CHUNK_BYTES]).size == MAX_CHUNK_BYTES
    assert Chunks.of(["x"] * MAX_CHUNKS).count == MAX_CHUNKS


# --- appends ----------------------------------------------------------------------------------------------


def test_a_streams_first_append_makes_it_at_offset_0() -> None:
    take = taken(running(), None, append("a", "bb"))
    assert take.answer == Appended("output", 1, 0, 2, False)
    assert take.head == Head("output", 1, 0, 2, 3, 1, 0)
    assert (take.batch.offset, take.batch.count, take.batch.attempt) == (0, 2, 1)
    assert (take.batch.size, take.batch.chunks, take.replaces) == (3, b'["a","bb"]', False)


def test_the_next_seq_appends_at_the_next_offset_and_the_totals_go_on() -> None:
    first = taken(running(), None, append("a", "bb"))
    second = taken(running(), first.head, append("ccc", seq=1))
    assert second.answer == Appended("output", 1, 2, 3, False)
    assert second.head == Head("output", 1, 0, 3, 6, 2, 2)


def test_a_retry_of_the_last_batch_needs_it_read_at_the_offset_the_head_keeps() -> None:
    first = taken(running(), None, append("a", "bb"))
    second = taken(running(), first.head, append("ccc", seq=1))
    again = append("ccc", seq=1)
    assert decide_append(running(), second.head, again, streams=1, max_bytes=100) == Lookup(1, 2)
    # With the same chunks, answered as the first time.
    assert duplicate(again, second.batch) == Appended("output", 1, 2, 3, True)


def test_a_retry_of_the_last_seq_with_other_chunks_is_seq_reused() -> None:
    first = taken(running(), None, append("a"))
    assert decide_append(running(), first.head, append("b"), streams=1, max_bytes=100) == Lookup(0, 0)
    with pytest.raises(Conflict) as caught:
        duplicate(append("b"), first.batch)
    assert (caught.value.status, caught.value.code) == (409, "seq-reused")
    assert "seq 0 of attempt 1 was appended with other chunks" in caught.value.message


def test_a_retry_of_an_earlier_batch_needs_it_read_by_its_seq_and_is_then_answered_or_refused() -> None:
    head = taken(running(), None, append("a")).head
    stored = taken(running(), head, append("b", "c", seq=1))
    head = taken(running(), stored.head, append("d", seq=2)).head
    asked = append("b", "c", seq=1)
    assert decide_append(running(), head, asked, streams=1, max_bytes=100) == Lookup(1, None)
    assert duplicate(asked, stored.batch) == Appended("output", 1, 1, 3, True)
    for other in (append("b", seq=1), append("bc", seq=1), append("b", "C", seq=1)):
        with pytest.raises(Conflict) as caught:
            duplicate(other, stored.batch)
        assert caught.value.code == "seq-reused"


def test_a_seq_past_the_next_is_a_gap_that_says_which_seq_is_expected() -> None:
    head = taken(running(), None, append("a")).head
    error = refused(running(), head, append("c", seq=2))
    assert (error.status, error.code) == (409, "seq-gap")
    assert error.to_json()["expectedSeq"] == 1
    # A stream not made yet, or an attempt that has not written to it, expects 0.
    assert refused(running(), None, append("a", seq=1)).to_json()["expectedSeq"] == 0
    assert refused(running(2), head, append("a", seq=1, attempt=2)).to_json()["expectedSeq"] == 0


def test_an_append_of_another_attempt_than_the_tasks_is_stale_before_anything_else() -> None:
    head = taken(running(), None, append("a")).head
    error = refused(running(2), head, append("a"))  # attempt 1's retry, once attempt 2 started
    assert (error.status, error.code) == (409, "stale-attempt")
    assert error.message == "attempt 1 is not the task's current attempt (2)"


@pytest.mark.parametrize("how", ["requeued", "succeeded"])
def test_an_append_to_a_task_that_is_not_running_is_not_running_with_the_task(how: str) -> None:
    task = running()
    ended = Fail(NOW, "boom", True) if how == "requeued" else Succeed(NOW, "s3://r", "h")
    task = apply_event(task, ended).task
    head = taken(running(), None, append("a")).head
    # Even the retry of a batch appended before: the attempt is over either way.
    error = refused(task, head, append("a"))
    assert (error.status, error.code) == (409, "not-running")
    assert isinstance(error, Conflict) and error.task is not None and error.task["state"] == task.state


def test_a_ninth_stream_is_refused_and_an_eighth_is_not() -> None:
    assert taken(running(), None, append("a", stream="s8"), streams=MAX_STREAMS - 1).head.name == "s8"
    error = refused(running(), None, append("a", stream="s9"), streams=MAX_STREAMS)
    assert (error.status, error.code) == (409, "too-many-streams")
    # A stream the task has goes on whatever the count.
    head = taken(running(), None, append("a")).head
    assert taken(running(), head, append("b", seq=1), streams=MAX_STREAMS).answer.offset == 1


def test_a_batch_that_would_take_the_text_past_the_limit_is_stream_full_and_nothing_is_taken() -> None:
    head = taken(running(), None, append("x" * 60), max_bytes=100).head
    assert taken(running(), head, append("x" * 40, seq=1), max_bytes=100).head.size == 100
    error = refused(running(), head, append("x" * 41, seq=1), max_bytes=100)
    assert (error.status, error.code) == (413, "stream-full")
    assert "holds 60 bytes: 41 more would take it past its limit of 100" in error.message


def test_a_retrys_first_append_starts_the_text_over_at_the_next_offset_and_replaces_the_earlier() -> None:
    head = taken(running(), None, append("x" * 60)).head
    head = taken(running(), head, append("y", seq=1)).head
    retry = taken(running(2), head, append("x" * 90, attempt=2))
    # Offsets go on; the text, its size and its seqs start over with the attempt.
    assert retry.answer == Appended("output", 2, 2, 3, False)
    assert retry.head == Head("output", 2, 2, 3, 90, 1, 2)
    assert retry.replaces
    follow = taken(running(2), retry.head, append("z", seq=1, attempt=2))
    assert (follow.head.first_offset, follow.head.size, follow.replaces) == (2, 91, False)


# --- reads ------------------------------------------------------------------------------------------------

HEAD = Head("output", 2, 10, 20, 50, 3, 17)


@pytest.mark.parametrize(
    ("offset", "same", "start"),
    [
        (10, True, 10),
        (15, True, 15),
        (20, True, 20),  # the end: nothing yet
        (3, True, 10),  # an earlier attempt's offset: its first chunk
        (21, True, 10),  # past the end: another history's, or made up
        (15, False, 10),  # another history of the id
    ],
)
def test_a_read_starts_where_asked_within_the_attempt_else_at_its_first_chunk(
    offset: int, same: bool, start: int
) -> None:
    assert read_start(HEAD, offset, same_history=same) == start


def test_a_stream_not_made_reads_from_0() -> None:
    assert read_start(None, 7) == 0


def test_batches_to_read_at_once_follow_the_streams_average_batch() -> None:
    assert rows_to_read(None, LIMIT) == 2
    assert rows_to_read(replace(HEAD, next_seq=0), LIMIT) == 2
    # 10 chunks of about 17 bytes in 3 batches: the chunk limit decides.
    assert rows_to_read(HEAD, 6) == 4
    # Big batches: the page's bytes decide.
    big = Head("output", 1, 0, 2, 2 * 600_000, 2, 1)
    assert rows_to_read(big, LIMIT) == 3
    # Batches larger than the page: the one it starts within and the next.
    assert rows_to_read(big, LIMIT, page_bytes=128 * 1024) == 2
    # Never fewer than two: the page's batch and one past it.
    assert rows_to_read(Head("output", 1, 0, 1000, 1000, 1, 0), 1) == 2


def batch(offset: int, *chunks: str, attempt: int = 1) -> Batch:
    made = Chunks.of(list(chunks))
    return Batch(offset, made.count, attempt, made.size, made.encoded)


def page(attempt: int, offset: int, chunks: list[str], more: bool) -> Page:
    """A page of these chunks, as ``page_of`` answers it."""
    size = sum(len(chunk.encode()) for chunk in chunks)
    return Page(attempt, offset, orjson.dumps(chunks), len(chunks), size, more)


def test_a_page_runs_from_the_start_through_its_batches_to_the_streams_end() -> None:
    batches = [batch(0, "a", "b"), batch(2, "c"), batch(3, "d", "e")]
    assert page_of(1, batches, attempt=1, limit=LIMIT, complete=True) == page(
        1, 1, ["b", "c", "d", "e"], False
    )
    assert page_of(1, batches, attempt=1, limit=LIMIT, complete=True).next_offset == 5  # type: ignore[union-attr]


def test_a_page_is_cut_at_its_limit_and_says_more_follow() -> None:
    batches = [batch(0, "a", "b"), batch(2, "c")]
    assert page_of(0, batches, attempt=1, limit=2, complete=True) == page(1, 0, ["a", "b"], True)


def test_a_page_is_cut_at_its_bytes_but_holds_one_chunk_at_least() -> None:
    batches = [batch(0, "aaaa", "bbbb"), batch(2, "cc")]
    assert page_of(0, batches, attempt=1, limit=LIMIT, complete=True, page_bytes=6) == page(
        1, 0, ["aaaa"], True
    )
    assert page_of(0, batches, attempt=1, limit=LIMIT, complete=True, page_bytes=2) == page(
        1, 0, ["aaaa"], True
    )


def test_a_page_not_full_before_the_streams_end_needs_more_batches() -> None:
    batches = [batch(0, "a", "b")]
    assert page_of(0, batches, attempt=1, limit=2, complete=False) is None
    assert page_of(0, batches, attempt=1, limit=3, complete=False) is None


def test_a_page_at_the_end_is_empty_and_of_the_streams_attempt() -> None:
    assert page_of(5, [batch(3, "d", "e", attempt=2)], attempt=2, limit=LIMIT, complete=True) == page(
        2, 5, [], False
    )
    assert page_of(0, [], attempt=0, limit=LIMIT, complete=True) == page(0, 0, [], False)


def test_a_page_holds_one_attempt_and_one_that_started_meanwhile_ends_it() -> None:
    # Read in two statements, a retry's first append between them: its batches follow, the page stops.
    batches = [batch(0, "a"), batch(1, "b"), batch(2, "z", attempt=2)]
    assert page_of(0, batches, attempt=1, limit=LIMIT, complete=True) == page(1, 0, ["a", "b"], True)


def test_a_page_whose_first_batch_is_past_the_start_starts_there() -> None:
    # The batches that held the start were dropped by a retry's first append since the head was read.
    assert page_of(1, [batch(4, "z", attempt=2)], attempt=1, limit=LIMIT, complete=True) == page(
        2, 4, ["z"], False
    )
    # A batch that ends at the start gives nothing, the next one the page.
    assert page_of(2, [batch(0, "a", "b"), batch(2, "c")], attempt=1, limit=LIMIT, complete=True) == page(
        1, 2, ["c"], False
    )


def test_a_streams_text_is_its_batches_chunks_joined() -> None:
    assert text_of([batch(0, "hé", "llo"), batch(2, " wor", "ld\n")]) == "héllo world\n"
    assert text_of([]) == ""


def test_a_page_splices_whole_batches_as_stored_and_decodes_only_the_ones_it_cuts() -> None:
    batches = [batch(0, 'q"uo', "té"), batch(2, "\\n", "x"), batch(4, "y", "z")]
    # Started within the first, cut within the last: the JSON array is the chunks' as the wire has them.
    found = page_of(1, batches, attempt=1, limit=4, complete=True)
    assert found == page(1, 1, ["té", "\\n", "x", "y"], True)
    assert found is not None and found.chunks == ["té", "\\n", "x", "y"] and found.size == 7
    # Whole batches only: their stored arrays joined.
    whole = page_of(0, batches[:2], attempt=1, limit=LIMIT, complete=True)
    assert whole is not None and whole.encoded == b'["q\\"uo","t\xc3\xa9","\\\\n","x"]'


def test_a_batch_of_one_chunk_past_the_pages_bytes_is_a_page_of_its_own() -> None:
    batches = [batch(0, "aaaaaa"), batch(1, "b")]
    assert page_of(0, batches, attempt=1, limit=LIMIT, complete=True, page_bytes=4) == page(
        1, 0, ["aaaaaa"], True
    )
