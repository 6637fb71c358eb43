"""A task subscription's streams beside its entries (``gateway.live.peer`` over
``gateway.live.published.SubStreams``), in plain calls: the chunks after the resume frame, the terminal
``event`` frame after every chunk committed before it (the final offsets read first), the ``end`` frames
after it, live chunks, bare wake-ups, a connection's backlog of live chunks past its bound closed ``4008``,
a recreated task's streams from their first chunks, and reads answered late or not made."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.errors import CLOSE_SLOW_CONSUMER
from gateway.live.chunks import Run
from gateway.live.fanout import Peer, Subscription
from gateway.live.published import Live, NeedFinals, NeedStream, SubStreams
from gateway.machine import Start, Succeed
from tests.support.stream_text import StreamText
from tests.unit.fanout_play import Play


class Store:
    """The store's side of one task's streams: each stream's attempt, its first offset and its chunks."""

    def __init__(self, page: int = 2) -> None:
        self.streams: dict[str, tuple[int, int, list[str]]] = {}
        self.page_chunks = page

    def append(self, name: str, *chunks: str, attempt: int = 1) -> Run:
        held_attempt, first, held = self.streams.get(name, (attempt, 0, []))
        if held_attempt != attempt:  # a retry's first append: the text starts over at the next offset
            first, held = first + len(held), []
        offset = first + len(held)
        self.streams[name] = (attempt, first, [*held, *chunks])
        return Run.of(attempt, offset, list(chunks))

    def page(self, name: str, offset: int) -> tuple[int, int, list[str], bool]:
        if name not in self.streams:
            return 0, 0, [], False
        attempt, first, held = self.streams[name]
        if not first <= offset <= first + len(held):
            offset = first
        chunks = held[offset - first : offset - first + self.page_chunks]
        return attempt, offset, chunks, offset + len(chunks) < first + len(held)

    def finals(self) -> dict[str, int]:
        return {name: first + len(held) for name, (_, first, held) in self.streams.items()}


def sent(play: Play, peer: Peer[str], store: Store) -> list[dict[str, Any]]:
    """What the connection's writer sends until it has nothing more, every read answered at once."""
    out: list[dict[str, Any]] = []
    while (step := peer.next()) is not None:
        if isinstance(step, tuple):
            out.append(orjson.loads(step[1].text))
        elif isinstance(step, NeedStream):
            attempt, offset, chunks, more = store.page(step.read.stream, step.read.offset)
            peer.stream_read(step, attempt, offset, chunks, more)
        elif isinstance(step, NeedFinals):
            peer.finals_read(step, store.finals())
        else:
            play.answer(peer, step)
    return out


def subscribe(play: Play, peer: Peer[str], offsets: dict[str, int], cursor: int = 0) -> Subscription[str]:
    sub = play.fan.subscribe(peer, "t")
    sub.streams = SubStreams(offsets)
    play.resumed(sub, cursor)
    return sub


def live(peer: Peer[str], sub: Subscription[str], name: str, run: Run | None, upto: int = 0) -> Live:
    return peer.stream_live(sub, name, run, upto)


def kinds(frames: list[dict[str, Any]]) -> list[str]:
    return [f["type"] for f in frames]


@pytest.fixture
def play() -> Play:
    play = Play()
    play.book.create("t", epoch="first")
    play.commit("t", Start(1_000, "w1"))
    return play


def test_chunks_follow_the_resume_frame_then_live_and_every_one_goes_before_the_terminal_frame(
    play: Play,
) -> None:
    store = Store()
    store.append("output", "a", "b", "c")
    peer = play.connect()
    sub = subscribe(play, peer, {"output": 1, "log": 0})
    holder = StreamText("t", {"output": 1, "log": 0})
    frames = sent(play, peer, store)
    assert kinds(frames) == ["delta", "chunks"]
    for frame in frames:
        holder.feed(frame)
    assert holder.texts == {"output": "bc", "log": ""}
    assert sub.streams is not None and sub.streams.offsets() == "output:3,log:0"
    # Live: the writer is woken when it had nothing to do.
    assert live(peer, sub, "output", store.append("output", "d")) is Live.WAKE
    assert live(peer, sub, "output", store.append("output", "e")) is Live.NOTHING  # woken already
    assert live(peer, sub, "steps", store.append("steps", "x")) is Live.NOTHING  # not asked for
    # Appended before the end, whose news the bus has not brought: read before the terminal frame.
    store.append("log", "l1")
    store.append("output", "f", "g", "h")
    play.commit("t", Succeed(2_000, "s3://r", "sha256:1"))
    assert not sub.finished
    frames = sent(play, peer, store)
    for frame in frames:
        holder.feed(frame)
    assert kinds(frames)[-3:] == ["event", "end", "end"], kinds(frames)
    assert holder.ended and holder.texts == {"output": "bcdefgh", "log": "l1"}
    assert sub.finished and peer.stream_backlog == 0
    assert (
        live(peer, sub, "output", store.append("output", "late")) is Live.NOTHING
    )  # ended: the store said so


def test_a_conflated_snapshot_of_the_ended_task_waits_for_the_chunks_too(play: Play) -> None:
    store = Store()
    peer = play.connect(backlog=1)
    sub = subscribe(play, peer, {"output": 0}, cursor=1)
    assert kinds(sent(play, peer, store)) == ["caught-up"]
    play.commit_many("t", 2)  # past its backlog: the newest state instead
    assert kinds(sent(play, peer, store)) == ["snapshot"]
    store.append("output", "a")
    play.commit("t")
    play.commit("t", Succeed(2_000, "s3://r", "sha256:1"))
    frames = sent(play, peer, store)
    assert kinds(frames) == ["chunks", "snapshot", "end"], frames
    assert frames[1]["reason"] == "conflated" and sub.finished


def test_a_task_ended_before_the_subscription_gets_its_chunks_then_the_ends(play: Play) -> None:
    store = Store()
    store.append("output", "a", "b", "c")
    play.commit("t", Succeed(2_000, "s3://r", "sha256:1"))
    peer = play.connect()
    sub = subscribe(play, peer, {"output": 0, "log": 4}, cursor=2)
    frames = sent(play, peer, store)
    assert kinds(frames) == ["caught-up", "chunks", "end", "end"], frames
    holder = StreamText("t", {"output": 0, "log": 4})
    for frame in frames:
        holder.feed(frame)
    assert holder.texts == {"output": "abc", "log": ""} and holder.offsets == {"output": 3, "log": 0}
    assert sub.finished


def test_chunks_heard_before_the_resume_state_wait_for_it_and_a_bare_wake_up_reads_the_store(
    play: Play,
) -> None:
    store = Store(page=10)
    peer = play.connect()
    sub = play.fan.subscribe(peer, "t")
    sub.streams = SubStreams({"output": 0})
    assert live(peer, sub, "output", store.append("output", "a")) is Live.NOTHING  # no state yet: no turn
    play.resumed(sub, 0)
    assert kinds(sent(play, peer, store)) == ["delta", "chunks"]
    store.append("output", "b", "c")  # too large for a message: a bare wake-up
    assert live(peer, sub, "output", None, 3) is Live.WAKE
    assert [f["chunks"] for f in sent(play, peer, store)] == [["b", "c"]]
    assert live(peer, sub, "output", None, 3) is Live.NOTHING  # nothing it lacks


def test_live_chunks_past_the_connections_backlog_close_it_4008(play: Play) -> None:
    store = Store()
    peer = play.connect(max_stream_backlog=5)
    sub = subscribe(play, peer, {"output": 0})
    sent(play, peer, store)
    assert live(peer, sub, "output", store.append("output", "12345")) is Live.WAKE
    assert peer.stream_backlog == 5 and peer.close_code is None
    assert live(peer, sub, "output", store.append("output", "6")) is Live.SLOW
    assert peer.close_code == CLOSE_SLOW_CONSUMER
    assert live(peer, sub, "output", store.append("output", "7")) is Live.NOTHING  # closed: no more
    play.fan.remove(sub)
    assert peer.stream_backlog == 0
    play.fan.remove(sub)  # twice: counted once
    assert peer.stream_backlog == 0
    assert live(peer, sub, "output", store.append("output", "8")) is Live.NOTHING
    other = play.fan.subscribe(peer, "t")
    assert live(peer, other, "output", store.append("output", "9")) is Live.NOTHING  # asked for no stream


def test_a_recreated_task_sends_its_streams_from_their_first_chunks(play: Play) -> None:
    store = Store()
    store.append("output", "a", "b")
    peer = play.connect()
    sub = play.fan.subscribe(peer, "t")
    sub.streams = SubStreams({"output": 7})
    assert live(peer, sub, "output", Run.of(1, 7, ["old"])) is Live.NOTHING  # of the history the client held
    assert peer.stream_backlog == 3
    # A cursor of another history of the id: the task was recreated since.
    play.flush(play.fan.resumed(sub, play.book.resume_now("t", 3, epoch="another")))
    frames = sent(play, peer, store)
    assert kinds(frames)[0] == "snapshot"
    assert [(f["offset"], f["chunks"]) for f in frames[1:]] == [(0, ["a", "b"])]


def test_a_read_not_made_is_made_again_and_an_answer_no_longer_awaited_changes_nothing(play: Play) -> None:
    store = Store()
    store.append("output", "a")
    peer = play.connect()
    sub = subscribe(play, peer, {"output": 0})
    assert peer.next() is not None  # the resume frame
    read = peer.next()
    assert isinstance(read, NeedStream)
    peer.read_failed(read)
    again = peer.next()
    assert isinstance(again, NeedStream) and again.read == read.read
    play.fan.remove(sub)
    peer.stream_read(again, *store.page("output", 0))
    assert peer.next() is None
    sub = subscribe(play, peer, {"output": 0})
    play.commit("t", Succeed(2_000, "s3://r", "sha256:1"))
    steps = []
    while not isinstance(step := peer.next(), NeedFinals):
        assert step is not None
        steps.append(step)
        if isinstance(step, NeedStream):
            peer.stream_read(step, *store.page("output", 0))
    play.fan.remove(sub)
    peer.finals_read(step, store.finals())
    assert peer.next() is None


def test_a_batch_that_is_all_a_quiet_socket_has_to_send_goes_straight_to_it(play: Play) -> None:
    store = Store()
    peer = play.connect(direct=True)
    sub = subscribe(play, peer, {"output": 0, "log": 0})
    assert kinds(sent(play, peer, store)) == ["delta"]
    run = store.append("output", "a", "b")
    assert live(peer, sub, "output", run) is Live.DIRECT
    assert SubStreams.wire("t", "output", run).endswith(b'"offset":0,"chunks":["a","b"]}')
    assert peer.stream_written(sub, True) is Live.NOTHING
    assert sub.streams is not None and sub.streams.offsets() == "output:2,log:0"
    assert peer.next() is None and peer.stream_backlog == 0
    # No room on the socket: its writer sends it.
    assert live(peer, sub, "output", store.append("output", "c")) is Live.DIRECT
    assert peer.stream_written(sub, False) is Live.WAKE
    # Something else to send first: its writer sends it, merged with what waits.
    assert live(peer, sub, "log", store.append("log", "l")) is Live.NOTHING
    frames = sent(play, peer, store)  # the streams take turns: no order between them
    assert sorted((f["stream"], f["chunks"]) for f in frames) == [("log", ["l"]), ("output", ["c"])]
    # A bare wake-up reads the store: the writer's.
    store.append("output", "d")
    assert live(peer, sub, "output", None, 4) is Live.WAKE
    assert [f["chunks"] for f in sent(play, peer, store)] == [["d"]]
    # An entry queued for its writer (no room for it): a batch goes with it, by the writer (woken already).
    play.room[peer] = False
    play.commit("t")
    assert live(peer, sub, "output", store.append("output", "e")) is Live.NOTHING
    assert sorted(kinds(sent(play, peer, store))) == ["chunks", "event"]
    # The task ended: the chunks go before its terminal frame, by the writer.
    play.commit("t", Succeed(2_000, "s3://r", "sha256:1"))
    assert live(peer, sub, "output", store.append("output", "f")) is Live.NOTHING
    assert kinds(sent(play, peer, store)) == ["chunks", "event", "end", "end"]
