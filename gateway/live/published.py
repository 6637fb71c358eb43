"""What a task subscription is handed (``gateway.live.peer`` decides in which order it goes out): committed
entries (:class:`Published`), the store reads that fill a gap (:func:`replay`), and the streams it asked for
(:class:`SubStreams`, over ``gateway.live.chunks``) with the reads that fill them. Pure, as the rest of the
fan-out core.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Final, TypeAlias

import orjson

from gateway.frames import Frame, chunks_frame, end_frame, event_frame, snapshot_frame, text_frame
from gateway.live.chunks import ChunksOut, ReadStream, Run, Streams
from gateway.machine import Task, apply_event, event_from_json
from gateway.task_times import stamped

# Live chunks waiting for one connection at most (GATEWAY_STREAM_BACKLOG_BYTES): past it, 4008.
STREAM_BACKLOG_BYTES: Final = 4 * 1024 * 1024
# A subscription's catch-up reads pages of this many bytes of chunks at most, the next once the client has
# taken all but less than one: what a catch-up holds is bounded by twice this, however long the stream.
CATCH_UP_BYTES: Final = 128 * 1024


@dataclass(frozen=True, slots=True, eq=False)
class NeedTask:
    """Read the task as stored now, and answer with ``task_read(this, task)``."""

    task_id: str


@dataclass(frozen=True, slots=True, eq=False)
class NeedEntries:
    """Read the history entries ``after < version <= upto`` in order, and answer with
    ``entries_read(this, entries)``."""

    task_id: str
    after: int
    upto: int


@dataclass(frozen=True, slots=True, eq=False)
class NeedStream:
    """Read a page of one of the task's streams (``read``: its name and the offset to read from), and
    answer with ``stream_read(this, attempt, offset, chunks, more)``."""

    task_id: str
    read: ReadStream


@dataclass(frozen=True, slots=True, eq=False)
class NeedFinals:
    """The task ended: read its streams' next offsets (their final ones now), and answer with
    ``finals_read(this, offsets)``."""

    task_id: str


# A read is answered by identity: an answer to a read that is no longer awaited (its subscription went,
# or a newer read took its place) changes nothing, so reads may be answered late and in any order.
Read: TypeAlias = NeedTask | NeedEntries
# What a connection's writer reads: a channel's reads, and a subscription's streams'.
PeerRead: TypeAlias = NeedTask | NeedEntries | NeedStream | NeedFinals
Entries: TypeAlias = Sequence[tuple[int, bytes]]


def replay(base: Task, entries: Entries) -> list[tuple[Task, Frame]]:
    """The ``event`` frames of stored entries, each with the task after it, replayed from ``base`` with the
    pure machine: as many as follow on from ``base`` (history is whole, so all of them; a short answer
    stays exact all the same)."""
    out: list[tuple[Task, Frame]] = []
    task = base
    for version, raw in entries:
        event = event_from_json(orjson.loads(raw))
        # What the gateway records of the runs too, as the book did (the end at the entry's time: the
        # notification's, but for a callback past the deadline, which the store's task shows).
        task = stamped(apply_event(task, event), event.at_ms).task
        if task.version != version:
            break
        out.append((task, event_frame(task, raw)))
    return out


class Published:
    """A committed entry as every subscription of its task gets it: the task after it, its frame, and
    that frame as WebSocket bytes, framed once for every socket written to directly."""

    __slots__ = ("_conflated", "_wire", "frame", "task")

    def __init__(self, task: Task, frame: Frame) -> None:
        self.task = task
        self.frame = frame
        self._wire: bytes | None = None
        self._conflated: bytes | None = None

    @property
    def conflated_wire(self) -> bytes:
        """A ``snapshot`` (``reason: conflated``) of the task after this entry, as WebSocket bytes."""
        if self._conflated is None:
            self._conflated = text_frame(snapshot_frame(self.task, "conflated").text.encode())
        return self._conflated

    @property
    def wire(self) -> bytes:
        if self._wire is None:
            self._wire = text_frame(self.frame.text.encode())
        return self._wire


class Live(Enum):
    """What the driver does with an append a subscription took (:meth:`Peer.stream_live`)."""

    NOTHING = 0
    WAKE = 1  # wake the connection's writer: it has work
    DIRECT = 2  # the run is all there is: write its frame to the socket now, then say ``stream_written``
    SLOW = 3  # the connection is closed (4008): its live chunks passed its bound; cut its send


class SubStreams:
    """The streams one task subscription asked for (protocol.md, Live: chunks and end): their frames
    (``gateway.live.chunks``), the offsets the client holds (an SSE event's id carries them), and where
    they stand beside the task's own frames: they start once the resume frame is out, and once the task
    ended its chunks all go before its terminal ``event`` frame, and the ``end`` frames after it. Each
    change returns how many bytes it added to the live chunks waiting (the connection sums them)."""

    __slots__ = ("ending", "outs", "sent", "streaming")

    def __init__(self, offsets: Mapping[str, int]) -> None:
        self.outs = Streams(offsets, read_ahead=CATCH_UP_BYTES)
        # The next offset the client holds of each stream, once the frames handed out are sent.
        self.sent = dict(offsets)
        self.streaming = False  # the resume frame is out: stream frames may go
        self.ending = False  # the final offsets were read (the task ended)

    def restart(self) -> int:
        """Every stream from its attempt's first chunk: the task is another than the client's (recreated).
        Before any read of them, so that what the bus brought meanwhile is in the reads."""
        dropped = self.outs.backlog
        self.outs = Streams(dict.fromkeys(self.outs.by_name, 0), read_ahead=CATCH_UP_BYTES)
        self.sent = dict.fromkeys(self.sent, 0)
        return -dropped

    def offsets(self) -> str:
        """The client's offsets, as an SSE event's id carries them after the cursor: ``output:42,log:130``."""
        return ",".join(f"{name}:{offset}" for name, offset in self.sent.items())

    def has_work(self, ended: bool) -> bool:
        """Whether :meth:`step` hands something out now (``ended``: the task's terminal frame is out)."""
        return self.streaming and ((ended and not self.ending) or self.outs.has_work(end=ended))

    def step(
        self, task_id: str, *, ended: bool, end: bool
    ) -> tuple[Frame | NeedStream | NeedFinals | None, int]:
        """The next step: the final offsets to read once the task ``ended``, a page to read, a ``chunks``
        frame, or (``end``: the terminal frame is out) an ``end`` frame; ``None`` when there is none."""
        if ended and not self.ending:
            return NeedFinals(task_id), 0
        outs = self.outs
        read = outs.read()
        if read is not None:
            return NeedStream(task_id, read), 0
        before = outs.backlog
        out = outs.take(end=end)
        grown = outs.backlog - before
        if out is None:
            return None, grown
        if isinstance(out, ChunksOut):
            self.sent[out.stream] = out.offset + len(out.chunks)
            return chunks_frame(task_id, out.stream, out.attempt, out.offset, out.chunks), grown
        self.sent[out.stream] = out.offset
        return end_frame(task_id, out.stream, out.offset), grown

    def live(self, stream: str, run: Run | None, next_offset: int) -> int:
        """An append to ``stream`` committed: its chunks (``run``), or only that the stream reaches
        ``next_offset`` (a bare wake-up: the store is read). A stream not asked for is no news."""
        out = self.outs.by_name.get(stream)
        if out is None:
            return 0
        before = out.backlog
        if run is None:
            out.notice(next_offset)
        else:
            out.live(run)
        return out.backlog - before

    def only(self, stream: str, run: Run | None) -> bool:
        """Whether ``run`` of ``stream``, just taken, is all there is to send (then it may be written straight
        to the socket, framed by :meth:`wire`)."""
        return run is not None and self.streaming and self.outs.only(stream, run)

    @staticmethod
    def wire(task_id: str, stream: str, run: Run) -> bytes:
        """``run``'s ``chunks`` frame as WebSocket bytes, framed once for every socket in step with it."""
        return text_frame(chunks_frame(task_id, stream, run.attempt, run.offset, run.chunks).text.encode())

    def taken(self) -> int:
        """The frame of the run :meth:`Streams.only` named was written straight to the socket: it is out."""
        before = self.outs.backlog
        out = self.outs.take(end=False)
        assert isinstance(out, ChunksOut)
        self.sent[out.stream] = out.offset + len(out.chunks)
        return self.outs.backlog - before

    def answered(
        self,
        read: NeedStream,
        attempt: int,
        offset: int,
        chunks: Sequence[str],
        more: bool,
        size: int | None = None,
    ) -> int:
        """A page of the stream ``read`` asked for (protocol.md, Read); ``size``: its chunks' bytes, if
        known."""
        before = self.outs.backlog
        self.outs.by_name[read.read.stream].answered(attempt, offset, chunks, more=more, size=size)
        return self.outs.backlog - before

    def finals(self, offsets: Mapping[str, int]) -> None:
        """The next offset of each stream the task made, final now that it ended."""
        self.ending = True
        self.outs.end(offsets)
