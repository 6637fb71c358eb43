"""One subscription's side of a task's streams (protocol.md, Live: chunks and end), decided without I/O.

For each stream a subscription asked for, :class:`StreamOut` decides which chunks its client gets, in which
frames, and when the store must be read, as ``gateway.live.peer`` does for entries: values in (live batches
as the bus brings them, store pages as reads answer them, the stream's final offset once the task ended),
values out (``chunks`` and ``end`` frames to write, :class:`ReadStream` requests). The asyncio driver makes
the reads and the writes.

The rules, all by offset (an offset names one chunk for the task's whole life: attempts never reuse one):

- **Catch-up, then live** (subscribe, buffer, read, merge): the subscription starts with a read from the
  offset asked; batches the bus brings meanwhile are held, and once the reads have reached the stream's end
  those the reads did not cover are handed out, so that a chunk committed while the subscription started is
  sent once. The next page is read only once the client has taken most of the last (``read_ahead``), so a
  long stream costs one page of memory however far behind the client starts.
- **No gap, no repeat**: a batch ending at or before the offset the client will hold is dropped (sent
  already, or read); one that starts past it means the bus lost or reordered one: the store is read from
  that offset, and the live batches wait behind the read.
- **Attempts**: a read answers from the offset asked, or from the first chunk of the stream's attempt
  (protocol.md, Streams): a page that starts elsewhere than asked, or a batch of a later attempt, starts the
  client's text over, so the chunks queued before it are never sent (the client would drop them).
- **Slow subscribers**: queued chunks of one attempt go out merged, a frame of up to ``PAGE_BYTES`` at a
  time; none is dropped. ``backlog`` counts the live chunks waiting (the reads' pages do not count): past
  the socket's limit the driver closes it (``4008``) and the client resumes from its offsets.
- **The end**: once the task ended, ``end`` is written after every chunk up to the stream's final offset,
  read from the store if the bus has not brought it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from gateway.streams import PAGE_BYTES

# A store page is read once the chunks queued for the client are below this.
READ_AHEAD: Final = PAGE_BYTES


@dataclass(frozen=True, slots=True)
class Run:
    """Chunks of one attempt at consecutive offsets from ``offset``: an appended batch the bus brought
    (``live``), or a page a read answered."""

    attempt: int
    offset: int
    chunks: Sequence[str]
    size: int
    live: bool = True

    @classmethod
    def of(cls, attempt: int, offset: int, chunks: Sequence[str]) -> Run:
        """A batch the bus brought."""
        return cls(attempt, offset, chunks, sum(len(chunk.encode()) for chunk in chunks))

    @property
    def end(self) -> int:
        return self.offset + len(self.chunks)

    def after(self, offset: int) -> Run:
        """The part of this run from ``offset`` on (an offset within it)."""
        tail = self.chunks[offset - self.offset :]
        return Run(self.attempt, offset, tail, sum(len(c.encode()) for c in tail), self.live)


@dataclass(frozen=True, slots=True)
class ReadStream:
    """Read a page of ``stream`` from ``offset`` (protocol.md, Read: it may start at the attempt's first
    chunk instead), and answer it with :meth:`StreamOut.answered`."""

    stream: str
    offset: int


@dataclass(frozen=True, slots=True)
class ChunksOut:
    """A ``chunks`` frame to write."""

    stream: str
    attempt: int
    offset: int
    chunks: Sequence[str]


@dataclass(frozen=True, slots=True)
class EndOut:
    """An ``end`` frame to write: the stream's final ``nextOffset``."""

    stream: str
    offset: int


class StreamOut:
    """One stream of one subscription, from the offset asked (protocol.md, Live: chunks and end)."""

    __slots__ = (
        "_again",
        "_ended",
        "_final",
        "_held",
        "_in_flight",
        "_queue",
        "_sizes",
        "_want",
        "attempt",
        "name",
        "next",
        "read_ahead",
    )

    def __init__(self, name: str, offset: int, *, read_ahead: int = READ_AHEAD) -> None:
        self.name = name
        # What the client will hold once the queue is written: the offset after its last chunk, and the
        # attempt of its text (0: none yet).
        self.next = offset
        self.attempt = 0
        self.read_ahead = read_ahead
        # The chunks to write, of one attempt at consecutive offsets (a later attempt clears it).
        self._queue: deque[Run] = deque()
        # Live batches that wait for a read (in flight, or to make) to be merged after it.
        self._held: list[Run] = []
        # Bytes queued, of them live, and held.
        self._sizes = [0, 0, 0]
        self._want: int | None = offset  # a read to make, from this offset
        self._in_flight = False
        self._final: int | None = None
        self._ended = False
        # The bus said chunks were committed while a read was in flight: read once more after it.
        self._again = False

    @property
    def reading(self) -> bool:
        return self._want is not None or self._in_flight

    @property
    def ended(self) -> bool:
        """Its ``end`` frame was handed out: nothing more comes of this stream."""
        return self._ended

    @property
    def ending(self) -> bool:
        """The task ended: the stream's final offset is known."""
        return self._final is not None

    @property
    def drained(self) -> bool:
        """The task ended and every chunk up to its final offset was handed out: only the ``end`` is left
        (or it was handed out too)."""
        return self._final is not None and not self._queue and not self.reading and self.next >= self._final

    def has_work(self, *, end: bool = True) -> bool:
        """Whether :meth:`read` or :meth:`take` (``take(end=end)``) hands something out now."""
        if self._queue or (self._want is not None and not self._in_flight):
            return True
        return end and self.drained and not self._ended

    @property
    def backlog(self) -> int:
        """Bytes of live chunks waiting for the client: queued, or held behind a read."""
        return self._sizes[1] + self._sizes[2]

    @property
    def queued(self) -> int:
        """Bytes of chunks queued for the client (pages included)."""
        return self._sizes[0]

    def read(self) -> ReadStream | None:
        """The store read to make now, if one is due (each once): not while one is in flight, nor while
        the client has ``read_ahead`` bytes queued still."""
        if self._want is None or self._in_flight or self.queued >= self.read_ahead:
            return None
        asked, self._want, self._in_flight = self._want, None, True
        return ReadStream(self.name, asked)

    def answered(
        self, attempt: int, offset: int, chunks: Sequence[str], *, more: bool, size: int | None = None
    ) -> None:
        """A read's page: ``chunks`` of ``attempt`` from ``offset`` (the offset asked, or the first chunk of
        the stream's attempt); ``more`` when chunks follow it; ``size``: their bytes in UTF-8, if known."""
        self._in_flight = False
        if offset != self.next or attempt != self.attempt:
            self._start_over(attempt, offset)
        if chunks:
            if size is None:
                size = sum(len(c.encode()) for c in chunks)
            self._put(Run(attempt, offset, chunks, size, live=False))
        if more or self._again:
            self._again = False
            self._want = self.next
            return
        held, self._held = sorted(self._held, key=lambda run: run.offset), []
        self._sizes[2] = 0
        for i, run in enumerate(held):
            self._accept(run)
            if self.reading:  # a gap behind it: the rest waits for that read too
                self._hold(*held[i + 1 :])
                return
        self._check_end()

    def only(self, run: Run) -> bool:
        """Whether ``run`` (as :meth:`live` took it) is all there is to hand out, with no read to make: a
        driver may write its frame straight away (then :meth:`take` it)."""
        queue = self._queue
        return len(queue) == 1 and queue[0] is run and self._want is None and not self._in_flight

    def failed(self, read: ReadStream) -> None:
        """The read was not made: it is due again."""
        if self._in_flight:
            self._in_flight = False
            self._want = read.offset

    def live(self, run: Run) -> None:
        """A batch the bus brought (committed), in whatever order and however often it comes. Once the task
        ended, the store is the truth: the final offset says what is left to read."""
        if self._final is not None:
            return
        if self.reading:
            self._hold(run)
            return
        self._accept(run)

    def notice(self, next_offset: int) -> None:
        """The bus or a check of the store says the stream reaches ``next_offset`` (a batch too large for a
        message, or one whose message was lost): the store is read from the client's offset if it lacks
        some. A read in flight may have begun before that commit: one more read follows it."""
        if self._final is not None or next_offset <= self.next:
            return
        if self._in_flight:
            self._again = True
        elif self._want is None:
            self._want = self.next

    def end(self, final: int) -> None:
        """The task ended: ``final`` is the stream's last ``nextOffset`` (0 for a stream not made)."""
        self._final = final
        if not self.reading:
            self._check_end()

    def take(self, max_bytes: int = PAGE_BYTES, *, end: bool = True) -> ChunksOut | EndOut | None:
        """The next frame to write: the queued chunks of one attempt, merged up to ``max_bytes`` (one run at
        least), or, once every chunk up to the final offset was handed out (and ``end`` allows it), the
        ``end``."""
        if self._queue:
            first = self._unqueue()
            chunks, size = list(first.chunks), first.size
            while self._queue and size + self._queue[0].size <= max_bytes:
                run = self._unqueue()
                chunks.extend(run.chunks)
                size += run.size
            return ChunksOut(self.name, first.attempt, first.offset, chunks)
        if end and self.drained and not self._ended:
            assert self._final is not None
            self._ended = True
            return EndOut(self.name, self._final)
        return None

    def _accept(self, run: Run) -> None:
        if run.end <= self.next:
            return  # sent already, or read
        if run.offset > self.next:  # one before it is missing (lost, or still on its way): read it
            self._hold(run)
            self._want = self.next
            return
        self._put(run if run.offset == self.next else run.after(self.next))

    def _put(self, run: Run) -> None:
        if run.attempt != self.attempt:  # a later attempt: the client's text starts over with it
            self._start_over(run.attempt, run.offset)
        self._queue.append(run)
        self._sizes[0] += run.size
        self._sizes[1] += run.size if run.live else 0
        self.next = run.end

    def _unqueue(self) -> Run:
        run = self._queue.popleft()
        self._sizes[0] -= run.size
        self._sizes[1] -= run.size if run.live else 0
        return run

    def _hold(self, *runs: Run) -> None:
        self._held.extend(runs)
        self._sizes[2] += sum(run.size for run in runs)

    def _start_over(self, attempt: int, offset: int) -> None:
        """The client's text starts over at ``offset`` (of ``attempt``): what is queued is never sent."""
        self._queue.clear()
        self._sizes[0] = self._sizes[1] = 0
        self.attempt, self.next = attempt, offset

    def _check_end(self) -> None:
        if self._final is not None and self.next < self._final:
            self._want = self.next  # the bus has not brought them all: read the rest


class Streams:
    """The streams one subscription asked for, by name: their frames taken in turn, their backlog summed."""

    __slots__ = ("_turn", "by_name")

    def __init__(self, offsets: Mapping[str, int], *, read_ahead: int = READ_AHEAD) -> None:
        self.by_name = {
            name: StreamOut(name, offset, read_ahead=read_ahead) for name, offset in offsets.items()
        }
        self._turn = 0

    @property
    def backlog(self) -> int:
        return sum(stream.backlog for stream in self.by_name.values())

    @property
    def ended(self) -> bool:
        return all(stream.ended for stream in self.by_name.values())

    @property
    def drained(self) -> bool:
        """Every stream's chunks up to its final offset were handed out: only the ``end`` frames are left."""
        return all(stream.drained for stream in self.by_name.values())

    def has_work(self, *, end: bool = True) -> bool:
        return any(stream.has_work(end=end) for stream in self.by_name.values())

    def read(self) -> ReadStream | None:
        """The first store read due now, if any (one at a time, for a driver that makes one at a time)."""
        for stream in self.by_name.values():
            read = stream.read()
            if read is not None:
                return read
        return None

    def failed(self, read: ReadStream) -> None:
        self.by_name[read.stream].failed(read)

    def only(self, stream: str, run: Run) -> bool:
        """Whether ``run`` of ``stream`` is all these streams have to hand out (:meth:`StreamOut.only`)."""
        return all(
            out.only(run) if name == stream else not out.has_work(end=False)
            for name, out in self.by_name.items()
        )

    def reads(self) -> list[ReadStream]:
        """The store reads due now, at most one per stream."""
        return [read for stream in self.by_name.values() if (read := stream.read()) is not None]

    def end(self, finals: Mapping[str, int]) -> None:
        """The task ended, with each stream's final offset (a stream not in ``finals`` was never made)."""
        for name, stream in self.by_name.items():
            stream.end(finals.get(name, 0))

    def take(self, max_bytes: int = PAGE_BYTES, *, end: bool = True) -> ChunksOut | EndOut | None:
        """The next frame of any stream, the streams taking turns (one that falls behind holds up none)."""
        streams = list(self.by_name.values())
        for i in range(len(streams)):
            stream = streams[(self._turn + i) % len(streams)]
            frame = stream.take(max_bytes, end=end)
            if frame is not None:
                self._turn = (self._turn + i + 1) % len(streams)
                return frame
        return None
