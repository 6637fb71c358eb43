"""One subscription's side of a task's streams (gateway.live.chunks), played as plain calls: catch-up from
the store then live with nothing lost or repeated whatever the bus does, a retry's chunks replacing the
failed attempt's, slow subscribers' chunks merged and counted, and the end after every chunk."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.live.chunks import ChunksOut, EndOut, ReadStream, Run, StreamOut, Streams


def run(offset: int, *chunks: str, attempt: int = 1) -> Run:
    return Run.of(attempt, offset, list(chunks))


def frames(stream: StreamOut | Streams, max_bytes: int = 1 << 20) -> list[ChunksOut | EndOut]:
    out: list[ChunksOut | EndOut] = []
    while (frame := stream.take(max_bytes)) is not None:
        out.append(frame)
    return out


def chunks_of(out: Sequence[ChunksOut | EndOut]) -> list[tuple[int, int, list[str]]]:
    return [(f.attempt, f.offset, list(f.chunks)) for f in out if isinstance(f, ChunksOut)]


def caught_up(offset: int = 0, attempt: int = 1, *chunks: str, asked: int | None = None) -> StreamOut:
    """A stream asked from ``asked`` (``offset`` when not given) whose catch-up read answered ``chunks``
    from ``offset``, the stream's end."""
    asked = offset if asked is None else asked
    stream = StreamOut("output", asked)
    assert stream.read() == ReadStream("output", asked)
    stream.answered(attempt, offset, list(chunks), more=False)
    return stream


def test_a_subscription_starts_with_a_read_from_its_offset_made_once() -> None:
    stream = StreamOut("output", 7)
    assert stream.reading
    assert stream.read() == ReadStream("output", 7)
    assert stream.read() is None  # in flight
    assert stream.take() is None


def test_batches_committed_during_the_catch_up_follow_it_once_whatever_the_read_saw() -> None:
    stream = StreamOut("output", 0)
    stream.read()
    # The bus brings 1..2 (which the read also sees), 3..4 and 5 (after the read), out of order.
    for live in (run(3, "d", "e"), run(1, "b", "c"), run(5, "f")):
        stream.live(live)
    assert stream.take() is None  # nothing before the read's answer
    stream.answered(1, 0, ["a", "b", "c"], more=False)
    assert chunks_of(frames(stream)) == [(1, 0, ["a", "b", "c", "d", "e", "f"])]
    assert stream.next == 6 and not stream.reading


def test_a_batch_that_overlaps_what_the_client_holds_gives_only_its_new_chunks() -> None:
    stream = caught_up(0, 1, "a", "b")
    assert chunks_of(frames(stream)) == [(1, 0, ["a", "b"])]
    stream.live(run(1, "b", "c", "d"))
    assert chunks_of(frames(stream)) == [(1, 2, ["c", "d"])]


def test_a_batch_sent_already_is_not_sent_again() -> None:
    stream = caught_up(0, 1, "a", "b")
    frames(stream)
    stream.live(run(0, "a", "b"))
    assert stream.take() is None


def test_a_batch_past_the_next_offset_is_a_gap_read_from_the_store_and_the_bus_waits_behind_it() -> None:
    stream = caught_up(0, 1, "a")
    stream.live(run(2, "c"))  # 1 was lost on the bus
    assert stream.take() == ChunksOut("output", 1, 0, ["a"])
    assert stream.read() == ReadStream("output", 1)
    stream.live(run(3, "d"))
    stream.answered(1, 1, ["b", "c"], more=False)
    assert chunks_of(frames(stream)) == [(1, 1, ["b", "c", "d"])]


def test_a_gap_among_the_batches_held_during_a_read_is_read_too() -> None:
    stream = StreamOut("output", 0)
    stream.read()
    for live in (run(2, "c"), run(4, "e"), run(5, "f")):
        stream.live(live)
    stream.answered(1, 0, ["a", "b"], more=False)
    assert stream.read() == ReadStream("output", 3)  # 3 is missing between the held 2 and 4
    assert stream.backlog == 3  # c queued, e and f held
    stream.answered(1, 3, ["d", "e"], more=False)
    assert chunks_of(frames(stream)) == [(1, 0, ["a", "b", "c", "d", "e", "f"])]


def test_a_long_catch_up_is_read_a_page_at_a_time_as_the_client_takes_it() -> None:
    stream = StreamOut("output", 0, read_ahead=4)
    stream.read()
    stream.answered(1, 0, ["aa", "bb"], more=True)
    assert stream.reading and stream.read() is None  # 4 bytes queued: the next page waits
    assert stream.take() == ChunksOut("output", 1, 0, ["aa", "bb"])
    assert stream.read() == ReadStream("output", 2)
    stream.live(run(3, "d"))
    stream.answered(1, 2, ["c"], more=False)
    assert chunks_of(frames(stream)) == [(1, 2, ["c", "d"])]


def test_a_retrys_chunks_start_the_text_over_and_the_failed_attempts_unsent_ones_are_never_sent() -> None:
    stream = caught_up(0, 1, "a")
    stream.live(run(1, "b"))
    stream.live(run(2, "X", "Y", attempt=2))
    assert chunks_of(frames(stream)) == [(2, 2, ["X", "Y"])]
    assert stream.attempt == 2


def test_a_read_that_starts_at_the_attempts_first_chunk_starts_the_text_over() -> None:
    # The client asked an offset past the end (another history's): the page starts at the first chunk.
    stream = StreamOut("output", 500)
    stream.read()
    stream.answered(1, 0, ["a", "b"], more=False)
    assert chunks_of(frames(stream)) == [(1, 0, ["a", "b"])]
    stream.live(run(2, "c"))
    assert chunks_of(frames(stream)) == [(1, 2, ["c"])]


def test_an_empty_page_that_starts_elsewhere_moves_the_offset_so_that_the_first_batch_is_sent() -> None:
    stream = caught_up(0, 0, asked=50)  # asked 50 of a stream not made: it reads from 0, empty
    assert stream.next == 0
    stream.live(run(0, "a"))
    assert chunks_of(frames(stream)) == [(1, 0, ["a"])]


def test_a_slow_subscriber_gets_its_waiting_chunks_merged_in_frames_of_at_most_max_bytes() -> None:
    stream = caught_up(0, 1)
    for i in range(5):
        stream.live(run(i, "xx"))
    assert stream.backlog == 10
    assert chunks_of(frames(stream, max_bytes=4)) == [
        (1, 0, ["xx", "xx"]),
        (1, 2, ["xx", "xx"]),
        (1, 4, ["xx"]),
    ]
    assert stream.backlog == 0
    # A batch bigger than the frame's bytes still goes, whole.
    stream.live(run(5, "xxxxxx"))
    assert chunks_of(frames(stream, max_bytes=4)) == [(1, 5, ["xxxxxx"])]


def test_the_backlog_counts_live_chunks_only_never_the_catch_ups_pages() -> None:
    stream = StreamOut("output", 0)
    stream.read()
    stream.live(run(3, "ddd"))
    assert stream.backlog == 3  # held behind the read
    stream.answered(1, 0, ["aa", "b", "c"], more=False)
    assert (stream.backlog, stream.queued) == (3, 7)
    frames(stream)
    assert (stream.backlog, stream.queued) == (0, 0)


def test_the_end_comes_after_every_chunk_up_to_the_final_offset() -> None:
    stream = caught_up(0, 1, "a")
    stream.live(run(1, "b"))
    stream.end(2)
    assert frames(stream) == [ChunksOut("output", 1, 0, ["a", "b"]), EndOut("output", 2)]
    assert stream.ended
    assert stream.take() is None  # once


def test_an_end_before_the_bus_brought_the_last_chunks_reads_them_first() -> None:
    stream = caught_up(0, 1, "a")
    stream.end(3)
    assert stream.take() == ChunksOut("output", 1, 0, ["a"])
    assert stream.take() is None
    assert stream.read() == ReadStream("output", 1)
    stream.answered(1, 1, ["b", "c"], more=False)
    assert frames(stream) == [ChunksOut("output", 1, 1, ["b", "c"]), EndOut("output", 3)]


def test_an_end_during_the_catch_up_waits_for_it() -> None:
    stream = StreamOut("output", 0)
    stream.read()
    stream.end(2)
    assert stream.take() is None
    stream.answered(1, 0, ["a", "b"], more=False)
    assert frames(stream) == [ChunksOut("output", 1, 0, ["a", "b"]), EndOut("output", 2)]


def test_a_stream_the_task_never_made_ends_at_0() -> None:
    stream = caught_up(0, 0)
    stream.end(0)
    assert frames(stream) == [EndOut("output", 0)]


def test_a_run_from_an_offset_within_it() -> None:
    assert run(3, "a", "bé", "c").after(4) == Run(1, 4, ["bé", "c"], 4)


def test_a_subscriptions_streams_take_turns_and_sum_their_backlogs() -> None:
    streams = Streams({"output": 0, "log": 0})
    assert streams.reads() == [ReadStream("output", 0), ReadStream("log", 0)]
    assert streams.reads() == []
    for name in ("output", "log"):
        streams.by_name[name].answered(1, 0, [], more=False)
        streams.by_name[name].live(run(0, name[0] * 2))
        streams.by_name[name].live(run(1, name[0] * 2))
    assert streams.backlog == 8
    out = frames(streams, max_bytes=2)
    assert [(f.stream, f.offset) for f in out] == [("output", 0), ("log", 0), ("output", 1), ("log", 1)]
    assert not streams.ended
    streams.end({"output": 2, "log": 2})
    assert frames(streams) == [EndOut("output", 2), EndOut("log", 2)]
    assert streams.ended


def test_a_stream_asked_that_the_task_never_made_ends_at_0_with_the_others() -> None:
    streams = Streams({"output": 0, "steps": 0})
    for read in streams.reads():
        streams.by_name[read.stream].answered(0, 0, [], more=False)
    streams.end({})
    assert frames(streams) == [EndOut("output", 0), EndOut("steps", 0)]


def test_a_bare_wake_up_reads_what_the_client_lacks_and_one_during_a_read_reads_once_more() -> None:
    stream = caught_up(0, 1, "a")
    assert chunks_of(frames(stream)) == [(1, 0, ["a"])]
    stream.notice(1)  # nothing the client lacks
    assert not stream.has_work() and stream.read() is None
    stream.notice(3)  # a batch too large for a message, or one whose message was lost
    assert stream.has_work() and stream.read() == ReadStream("output", 1)
    stream.notice(4)  # committed while the read is in flight: the read may not see it
    stream.answered(1, 1, ["b", "c"], more=False)
    stream.notice(4)  # a read is due already: it will see it
    assert stream.read() == ReadStream("output", 3)
    stream.answered(1, 3, ["d"], more=False)
    assert chunks_of(frames(stream)) == [(1, 1, ["b", "c", "d"])]
    assert not stream.reading and stream.read() is None


def test_a_read_that_failed_is_due_again() -> None:
    stream = StreamOut("output", 4)
    read = stream.read()
    assert read is not None and stream.read() is None
    stream.failed(read)
    stream.failed(read)  # told twice: once is enough
    assert stream.read() == ReadStream("output", 4)


def test_once_the_task_ended_the_store_says_what_is_left_and_the_bus_is_not_heard() -> None:
    stream = caught_up(0, 1, "a")
    assert not stream.ending and not stream.drained
    stream.end(3)
    assert stream.ending and not stream.drained
    stream.live(run(1, "b", "c"))  # late: the read the end asked for brings it
    stream.notice(9)
    assert stream.take() == ChunksOut("output", 1, 0, ["a"])
    assert stream.read() == ReadStream("output", 1)
    stream.answered(1, 1, ["b", "c"], more=False)
    # Its chunks may go before something else (the terminal frame), and the end only after it.
    assert stream.has_work(end=False) and not stream.drained
    assert stream.take(end=False) == ChunksOut("output", 1, 1, ["b", "c"])
    assert stream.drained and not stream.has_work(end=False) and stream.take(end=False) is None
    assert stream.has_work() and stream.take() == EndOut("output", 3)
    assert stream.drained and stream.ended and not stream.has_work()


def test_a_subscriptions_streams_read_one_at_a_time_and_drain_together() -> None:
    streams = Streams({"output": 0, "log": 5})
    assert streams.has_work()
    first = streams.read()
    assert first == ReadStream("output", 0)
    streams.failed(first)
    assert streams.read() == ReadStream("output", 0)
    assert streams.read() == ReadStream("log", 5)
    assert streams.read() is None and not streams.has_work()
    streams.by_name["output"].answered(1, 0, ["a"], more=False)
    streams.by_name["log"].answered(0, 0, [], more=False)
    streams.end({"output": 1})
    assert not streams.drained
    assert streams.take(end=False) == ChunksOut("output", 1, 0, ["a"])
    assert streams.drained and not streams.has_work(end=False) and streams.take(end=False) is None
    assert {frame.stream for frame in frames(streams)} == {"output", "log"}
    assert streams.ended


def test_a_pages_size_the_read_knows_is_not_counted_again() -> None:
    stream = StreamOut("output", 0)
    stream.read()
    stream.answered(1, 0, ["ab", "é"], more=True, size=4)
    assert stream.queued == 4 and stream.read() == ReadStream("output", 2)
