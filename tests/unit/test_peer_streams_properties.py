"""Random interleavings of a task's streams on one subscription (``gateway.live.peer`` over
``gateway.live.chunks``), as Hypothesis draws them: appends (some of a retried attempt), their bus messages
delivered late, out of order, twice, as bare wake-ups or never, the periodic check of the offsets, a socket
with room or none, the writer taking a few steps at a time, the client dropping and resuming from the offsets
it holds, then the task's end. Every frame the client gets is checked as it comes (no gap, no repeat, no
earlier attempt's chunk after a later one's, every chunk before the terminal frame, the ends after it:
``tests/support/stream_text.py``), and the client ends holding each stream's text."""

from __future__ import annotations

from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.live.chunks import Run
from gateway.live.fanout import Peer, Subscription
from gateway.live.published import Live, NeedFinals, NeedStream, SubStreams
from gateway.machine import Start, Succeed
from tests.support.stream_text import StreamText
from tests.unit.fanout_play import Play, unframe_all
from tests.unit.test_peer_streams import Store

NAMES = ("output", "log")

Action = tuple[str, int, int]
actions = st.lists(
    st.tuples(
        st.sampled_from(
            ["append", "append", "deliver", "deliver", "bare", "twice", "lose", "retry", "write"]
        ),
        st.integers(0, 7),
        st.integers(1, 4),
    )
    | st.tuples(st.sampled_from(["check", "drop", "room", "full", "slow", "answer"]), st.just(0), st.just(0)),
    max_size=60,
)


class Client:
    """One client of the task's streams, over connections that drop, and the bus between it and the store."""

    def __init__(self, play: Play, store: Store) -> None:
        self.play, self.store = play, store
        self.holder = StreamText("t", dict.fromkeys(NAMES, 0))
        self.bus: list[tuple[str, Run]] = []
        self.room = True
        self.appends = 0
        # A read made (the store as it was then) whose answer comes later: the bus brings news meanwhile.
        self.slow_reads = False
        self.read: tuple[NeedStream, tuple[int, int, list[str], bool]] | None = None
        self.peer, self.sub = self.connect()

    def connect(self) -> tuple[Peer[str], Subscription[str]]:
        self.read = None
        peer = self.play.connect(direct=True)
        self.play.room[peer] = self.room
        sub = self.play.fan.subscribe(peer, "t")
        sub.streams = SubStreams(self.holder.offsets)
        self.holder.resubscribed()
        self.play.resumed(sub, 0)
        return peer, sub

    def feed(self, text: str) -> None:
        frame: dict[str, Any] = orjson.loads(text)
        self.holder.feed(frame)

    def heard(self, name: str, run: Run | None, next_offset: int) -> None:
        peer, sub = self.peer, self.sub
        live = peer.stream_live(sub, name, run, next_offset)
        if live is Live.DIRECT:
            assert run is not None
            written = self.room
            if written:
                for frame in unframe_all(SubStreams.wire("t", name, run)):
                    self.feed(frame.text)
            peer.stream_written(sub, written)

    def write(self, steps: int | None) -> None:
        """The connection's writer: up to ``steps`` frames (all of them: ``None``), its reads answered."""
        peer, store = self.peer, self.store
        done = 0
        while (steps is None or done < steps) and self.read is None:
            step = peer.next()
            if step is None:
                return
            if isinstance(step, tuple):
                self.feed(step[1].text)
                done += 1
            elif isinstance(step, NeedStream):
                self.read = step, store.page(step.read.stream, step.read.offset)
                if not self.slow_reads or steps is None:
                    self.answer()
            elif isinstance(step, NeedFinals):
                peer.finals_read(step, store.finals())
            else:
                self.play.answer(peer, step)

    def answer(self) -> None:
        if self.read is not None:
            read, (attempt, offset, chunks, more) = self.read
            self.read = None
            self.peer.stream_read(read, attempt, offset, chunks, more)

    def act(self, kind: str, at: int, size: int, attempt: int) -> int:
        store, bus = self.store, self.bus
        if kind == "append":
            name = NAMES[at % len(NAMES)]
            self.appends += 1  # every chunk's text its own: a chunk sent at another's offset shows
            run = store.append(
                name, *(f"{attempt}.{self.appends}.{i} " for i in range(size)), attempt=attempt
            )
            bus.append((name, run))
        elif kind == "retry":
            return attempt + 1
        elif kind in ("deliver", "bare", "twice", "lose") and bus:
            name, run = bus[at % len(bus)] if kind == "twice" else bus.pop(at % len(bus))
            if kind != "lose":
                self.heard(name, None if kind == "bare" else run, run.end)
        elif kind == "check":
            for name, next_offset in store.finals().items():
                self.heard(name, None, next_offset)
        elif kind == "write":
            self.write(size)
        elif kind == "drop":
            self.play.fan.remove(self.sub)
            self.peer, self.sub = self.connect()
        elif kind == "slow":
            self.slow_reads = not self.slow_reads
        elif kind == "answer":
            self.answer()
        elif kind in ("room", "full"):
            self.room = self.play.room[self.peer] = kind == "room"
        return attempt


@settings(max_examples=1000, deadline=None)
@given(actions)
def test_every_interleaving_ends_with_each_streams_text_and_no_gap_repeat_or_earlier_attempt(
    steps: list[Action],
) -> None:
    play = Play()
    play.book.create("t", epoch="e")
    play.commit("t", Start(1_000, "w1"))
    store = Store(page=3)
    client = Client(play, store)
    client.write(None)  # caught up: the bus's news is taken as it comes, not held behind the first read
    attempt = 1
    for kind, at, size in steps:
        attempt = client.act(kind, at, size, attempt)
    play.room[client.peer] = True
    play.commit("t", Succeed(2_000, "s3://r", "sha256:1"))
    client.answer()
    client.write(None)
    held = client.holder
    assert held.ended, held.offsets
    texts = {name: "".join(chunks) for name, (_, _, chunks) in store.streams.items()}
    assert held.texts == {name: texts.get(name, "") for name in NAMES}
    assert client.peer.stream_backlog == 0
