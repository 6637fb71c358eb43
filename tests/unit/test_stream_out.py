"""A worker's output to a stream, pure (``gateway.client.stream_out``): how a write's text is cut into
chunks, when a buffer is sent and as which batch, that a batch whose answer was lost goes again with the
same ``seq``, and what each answer of the gateway means."""

from __future__ import annotations

import json

import pytest

from gateway.client.stream_out import (
    FLUSH_BYTES,
    FLUSH_S,
    MAX_BODY_BYTES,
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    Again,
    Batch,
    Over,
    Refused,
    StreamOut,
    Taken,
    check_name,
    chunks_of,
)


def test_a_name_is_one_the_gateway_takes() -> None:
    assert check_name("output") == "output" and check_name("log_2-x") == "log_2-x"
    for bad in ("", "Output", "a" * 33, "lines/1", 7):
        with pytest.raises(ValueError, match="stream's name"):
            check_name(bad)  # type: ignore[arg-type]


def test_text_is_cut_into_chunks_of_64_kib_between_characters() -> None:
    assert chunks_of("") == []
    assert chunks_of("héllo") == [("héllo", 6)]
    # 3-byte characters: 64 KiB is not a multiple of 3, so each cut backs off to a character's start.
    text = "€" * 50_000
    cut = chunks_of(text)
    assert "".join(chunk for chunk, _ in cut) == text
    assert all(size <= MAX_CHUNK_BYTES and size == len(chunk.encode()) for chunk, size in cut)
    assert [size for _, size in cut] == [65_535, 65_535, 18_930]
    assert chunks_of("a" * MAX_CHUNK_BYTES) == [("a" * MAX_CHUNK_BYTES, MAX_CHUNK_BYTES)]
    with pytest.raises(UnicodeEncodeError):
        chunks_of("\ud800")


def test_a_buffer_goes_50_ms_after_its_oldest_write_or_at_once_at_64_kib() -> None:
    out = StreamOut("output")
    assert out.empty() and out.take(1, 0.0) is None and out.due(0.0) is None
    assert out.write("", 0.0) and out.empty()  # nothing to send
    out.write("Hello", 10.0)
    out.write(", world", 10.03)
    assert out.take(1, 10.04) == pytest.approx(10.0 + FLUSH_S)  # not due yet: when it will be
    batch = out.take(1, 10.05)
    assert batch == Batch("output", 1, 0, ("Hello", ", world"))
    assert batch.body() == {"attempt": 1, "seq": 0, "chunks": ["Hello", ", world"]}
    assert out.unsent_chunks() == 2 and not out.empty()
    # Flushed (before the outcome): at once, whenever the oldest write was.
    out2 = StreamOut("log")
    out2.write("line\n", 5.0)
    assert out2.take(1, 5.0) == 5.0 + FLUSH_S
    assert isinstance(out2.take(1, 5.0, flush=True), Batch)
    # 64 KiB kept: due at once (a Worker's write waits for it to go: full()).
    out3 = StreamOut("big")
    out3.write("x" * (FLUSH_BYTES - 1), 1.0)
    assert not out3.full() and out3.due(1.0) == 1.0 + FLUSH_S
    out3.write("y", 1.0)
    assert out3.full() and out3.due(1.0) == 1.0


def test_a_batch_whose_answer_was_lost_goes_again_as_it_was_and_the_next_follows_its_answer() -> None:
    out = StreamOut("output")
    out.write("a", 0.0)
    first = out.take(1, 1.0)
    assert isinstance(first, Batch)
    out.write("b", 1.0)  # written while the first is on its way: waits for its answer
    assert out.due(1.0) == 1.0 and out.take(1, 5.0) is first  # no answer came: the same seq, same chunks
    assert out.answered(first, 200, {"duplicate": True}) == Taken(duplicate=True)  # the retry's answer
    second = out.take(1, 5.0)
    assert second == Batch("output", 1, 1, ("b",))
    assert out.answered(second, 200, {"duplicate": False}) == Taken(duplicate=False)
    assert out.empty() and out.seq == 2


def test_a_batch_holds_at_most_1000_chunks_and_1_mib_of_body() -> None:
    out = StreamOut("tokens")
    for n in range(MAX_CHUNKS + 5):
        out.write(f"t{n} ", 0.0)
    batch = out.take(1, 1.0)
    assert isinstance(batch, Batch) and len(batch.chunks) == MAX_CHUNKS
    out.answered(batch, 200, {})
    rest = out.take(1, 1.0)  # what was left is due at once (it was written 1 s ago)
    assert isinstance(rest, Batch) and rest.chunks == tuple(f"t{n} " for n in range(1000, 1005))

    # Control characters take 6 bytes each as JSON: 20 chunks of 64 KiB of them are far over 1 MiB.
    out = StreamOut("raw")
    out.write("\x01" * (MAX_CHUNK_BYTES * 20), 0.0)
    sent = 0
    while not out.empty():
        batch = out.take(1, 1.0)
        assert isinstance(batch, Batch)
        assert len(json.dumps(batch.body(), ensure_ascii=False, separators=(",", ":")).encode()) <= (
            MAX_BODY_BYTES
        )
        sent += sum(len(chunk) for chunk in batch.chunks)
        out.answered(batch, 200, {})
    assert sent == MAX_CHUNK_BYTES * 20


def test_a_new_attempt_numbers_its_batches_from_0_the_one_on_its_way_too() -> None:
    out = StreamOut("output")
    out.write("a", 0.0)
    old = out.take(1, 1.0)
    assert isinstance(old, Batch)
    answer = {"error": {"code": "not-running", "message": "requeued"}, "task": {"state": "queued"}}
    over = out.answered(old, 409, answer)
    assert over == Over("not-running", "requeued", {"state": "queued"})
    # The worker took its task back as attempt 2: the batch goes again, as that attempt's first.
    again = out.take(2, 1.0)
    assert again == Batch("output", 2, 0, ("a",))
    # An answer to the old batch that arrives late changes nothing: the renumbered one is sent.
    assert out.answered(old, 200, {}) == Again(0)
    assert out.answered(again, 200, {}) == Taken(duplicate=False) and out.seq == 1
    stale = {"error": {"code": "stale-attempt", "message": "attempt 3 runs"}}
    out.write("b", 1.0)
    batch = out.take(2, 2.0)
    assert isinstance(batch, Batch)
    assert out.answered(batch, 409, stale) == Over("stale-attempt", "attempt 3 runs", None)


def test_a_gap_takes_the_number_the_gateway_expects_and_a_refusal_drops_the_batch() -> None:
    out = StreamOut("output")
    out.seq = 3  # as if batches 0-2 were counted, but 2 is not there (another writer counted otherwise)
    out.write("a", 0.0)
    batch = out.take(1, 1.0)
    assert isinstance(batch, Batch) and batch.seq == 0  # the first take of attempt 1 counts from 0
    out.seq = 3
    batch = out.take(1, 1.0)
    assert isinstance(batch, Batch)
    out.inflight = batch = Batch("output", 1, 3, ("a",))
    gap = {"error": {"code": "seq-gap", "message": "expected 2"}, "expectedSeq": 2}
    assert out.answered(batch, 409, gap) == Again(2)
    resent = out.take(1, 1.0)
    assert resent == Batch("output", 1, 2, ("a",))
    # A gap that does not say an earlier number is a refusal, as is any other 4xx.
    assert out.answered(resent, 409, {"error": {"code": "seq-gap"}, "expectedSeq": 9}) == Refused(
        409, "seq-gap", ""
    )
    assert out.empty() and out.seq == 2
    out.write("b", 1.0)
    full = out.take(1, 2.0)
    assert isinstance(full, Batch)
    said = {"error": {"code": "stream-full", "message": "past 16 MiB"}}
    assert out.answered(full, 413, said) == Refused(413, "stream-full", "past 16 MiB")
    out.write("c", 2.0)
    proxy = out.take(1, 3.0)
    assert isinstance(proxy, Batch)
    assert out.answered(proxy, 404, {"error": "not json of the gateway's"}) == Refused(404, "http-404", "")


def test_a_bounded_buffer_drops_a_write_past_its_bound_whole() -> None:
    out = StreamOut("output", limit_bytes=10)
    assert out.write("0123456789", 0.0)
    assert not out.write("!", 0.0) and out.buffered_bytes == 10
    batch = out.take(1, 1.0)
    assert isinstance(batch, Batch)
    out.answered(batch, 200, {})
    assert out.write("!", 1.0)


def test_what_is_unsent_goes_to_another_process_and_on_from_there() -> None:
    out = StreamOut("output")
    out.write("a", 0.0)
    batch = out.take(4, 1.0)
    assert isinstance(batch, Batch)
    out.write("b", 1.0)
    out.write("c", 1.0)
    pending = json.loads(json.dumps(out.pending()))
    there = StreamOut.resume(pending)
    assert repr(there) == "<StreamOut output attempt 4 seq 0>"
    assert there.take(4, 100.0) == Batch("output", 4, 0, ("a",))  # the one on its way, again
    assert there.answered(there.inflight, 200, {}) == Taken(duplicate=False)  # type: ignore[arg-type]
    assert there.take(4, 100.0) == Batch("output", 4, 1, ("b", "c"))  # the rest, due at once
    idle = StreamOut.resume(StreamOut("log").pending())
    assert idle.empty() and idle.attempt is None and idle.due(100.0) is None
