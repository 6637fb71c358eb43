"""One connection's side of fan-out: its subscriptions (of tasks, and of tags: :class:`TagSub`), the order
their frames go out in, and the store reads that fill them; pure, like ``gateway.live.fanout``, which hands
it entries (and ``gateway.live.tagging``, which decides what a tag subscription streams).

A subscription collects live entries from the moment it exists, before its resume state is read
(centrifuge's subscribe, buffer, read, merge); once the state is known, everything at or below it is
dropped, and a gap is filled from the store and replayed on the last state sent (:func:`replay`), so that
each ``event`` frame still carries the task after its entry. A backlog past its bound becomes one
``conflated`` snapshot of the newest state: a slow client costs a bounded backlog, and its cursor stays
valid. A connection whose writer is stuck in one send past its deadline is closed with ``4008``.

What the connection's writer does next is a value (:meth:`Peer.next`): a frame to send, a read to make
and answer, or nothing; so a test plays any interleaving of writes, reads and commits as plain calls.

A connection may be held to having a subscription (``Holding``). A subscription's ``metadata`` and
``children`` frames, merged, go on its turn too (``gateway.live.beside``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Generic, TypeAlias, TypeVar

from gateway.errors import CLOSE_SLOW_CONSUMER, InvalidRequest
from gateway.frames import Frame, snapshot_frame
from gateway.live.beside import BesideOut
from gateway.live.chunks import Run
from gateway.live.holding import Holding
from gateway.live.published import (
    STREAM_BACKLOG_BYTES,
    Entries,
    Live,
    NeedEntries,
    NeedFinals,
    NeedStream,
    NeedTask,
    PeerRead,
    Published,
    SubStreams,
    replay,
)
from gateway.machine import RECREATED, Task

H = TypeVar("H")  # what the driver keeps with a connection (its socket, its writer): never looked at here


class Subscription(Generic[H]):
    """One task on one connection: the last state sent and what is still to send."""

    __slots__ = (
        "active",
        "backlog",
        "beside",
        "conflated",
        "head",
        "last",
        "owner",
        "peer",
        "pending",
        "queued",
        "streams",
        "task_id",
    )

    def __init__(self, task_id: str, peer: Peer[H], owner: TagSub[H] | None = None) -> None:
        self.task_id = task_id
        self.peer = peer
        self.owner = owner  # the tag subscription that streams this task; None for a task's own
        self.backlog = peer.backlog
        self.last: Task | None = None  # None while the resume state is being read
        # Made when first needed and dropped when emptied: an idle socket holds no deque (624 bytes each).
        self.pending: deque[Published] | None = None  # live entries not sent yet
        self.head: deque[Frame] | None = None  # frames that go before ``pending``: resume, gap fill, snapshot
        self.conflated = False  # its backlog was dropped: a snapshot is due
        self.queued = False  # in its connection's turn order
        self.active = True
        self.streams: SubStreams | None = None  # the streams it asked for, if any
        self.beside: BesideOut | None = None  # its metadata and children frames, once it has heard of one

    def put_head(self, frames: Sequence[Frame]) -> None:
        """Frames to send before the pending entries. The head is always empty then: the resume frame comes
        first, and a read's answer only comes when its turn found nothing else to send."""
        assert self.head is None
        self.head = deque(frames) if frames else None

    def pop_head(self) -> Frame:
        assert self.head
        frame = self.head.popleft()
        if not self.head:
            self.head = None
        return frame

    def drop_pending_through(self, version: int) -> None:
        """Drop the pending entries at or below ``version`` (a resume frame or a snapshot covered them)."""
        pending = self.pending
        while pending and pending[0].task.version <= version:
            pending.popleft()
        if not pending:
            self.pending = None

    @property
    def version(self) -> int:
        """The version of the last state sent (-1 before the resume state is known)."""
        return -1 if self.last is None else self.last.version

    def has_work(self) -> bool:
        if self.head or self.pending or self.conflated or (self.beside and self.beside.pending):
            return True
        # Its streams' steps, once the resume frame is out (then the state sent is known).
        return self.streams is not None and self.streams.has_work(
            self.last is not None and self.last.terminal
        )

    @property
    def finished(self) -> bool:
        """Its terminal state has been handed out, and its streams' ``end`` frames: a terminal task gets no
        further entry, so anything still in ``pending`` is a stale copy of what was already sent."""
        return (
            self.last is not None
            and self.last.terminal
            and not self.head
            and (self.streams is None or self.streams.outs.ended)
        )


class TagSub(Generic[H]):
    """One tag on one connection: the tasks it has listed or announced (each announced at most once), the
    subscriptions of the ones it streams, and while its listing is read, the tasks created meanwhile.
    What it does is ``gateway.live.tagging``'s."""

    __slots__ = (
        "active",
        "buffered",
        "cap",
        "floor",
        "known",
        "listing",
        "peer",
        "since_ms",
        "streams",
        "tag",
    )

    def __init__(self, tag: str, peer: Peer[H], since_ms: int) -> None:
        self.tag = tag
        self.peer = peer
        # Tasks created before this (the gateway's clock, less a margin) were there when it listed the tag.
        self.since_ms = since_ms
        # Listed or announced: task id -> (createdAtMs, epoch) of the task as it was known ((0, "") until
        # read); a task made again under the id (another epoch) is not known.
        self.known: dict[str, tuple[int, str]] = {}
        self.cap = 0  # how many ``known`` may hold before the ones past the reconcile's horizon go
        self.streams: dict[str, Subscription[H]] = {}  # the subscriptions it owns, by task
        self.listing = True  # its listing and resume reads are under way: news of creations waits
        self.buffered: dict[str, Task] = {}  # created while it listed, as created, in arrival order
        # With more tasks than it listed: the oldest listed, (createdAtMs, id); older ones were left out.
        self.floor: tuple[int, str] | None = None
        self.active = True


Step: TypeAlias = "tuple[Subscription[H] | None, Frame] | PeerRead | None"


class Peer(Holding, Generic[H]):
    """One connection: its subscriptions taking turns, its control frames, and whether a frame may be written
    to its socket directly now (nothing of it queued, being prepared or being sent)."""

    __slots__ = (
        "_ready",
        "backlog",
        "close_code",
        "closing",
        "conflations",
        "control",
        "direct",
        "handle",
        "max_control",
        "max_stream_backlog",
        "max_subscriptions",
        "owned",
        "preparing",
        "reading",
        "stream_backlog",
        "subscriptions",
        "tags",
        "writing_since",
    )

    def __init__(
        self,
        handle: H,
        *,
        backlog: int = 256,
        max_subscriptions: int = 1000,
        max_control: int = 256,
        max_stream_backlog: int = STREAM_BACKLOG_BYTES,
    ) -> None:
        super().__init__()
        self.handle = handle
        self.backlog = backlog
        # Bytes of live chunks waiting for this connection, of every stream of every subscription, at most.
        self.max_stream_backlog = max_stream_backlog
        self.stream_backlog = 0
        self.max_subscriptions = max_subscriptions
        self.max_control = max_control
        self.subscriptions: dict[str, Subscription[H]] = {}
        self.owned = 0  # those of ``subscriptions`` a tag subscription streams: they count as their tag
        self.tags: dict[str, TagSub[H]] = {}
        self.control: deque[Frame] | None = None  # pongs and errors; made when needed, dropped when emptied
        # Whose turn it is, in order: a subscription with work, or None for the next control frame. A pong or
        # an error answers a message, so it goes after what earlier messages queued (the resume frame of a
        # subscribe sent before a ping), never ahead of it.
        self._ready: deque[Subscription[H] | None] | None = None
        self.close_code: int | None = None
        self.direct = False  # its socket takes direct writes (a WebSocket of gateway.server)
        self.writing_since: float | None = None  # when the send under way began (the driver's clock)
        self.reading: PeerRead | None = None  # the store read its writer makes for ``preparing``
        self.preparing: Subscription[H] | None = None
        self.conflations = 0  # backlogs it dropped for a gap too long to fill
        self.closing: int | None = None  # the close code once the frames queued before it are sent

    def make_room(self, replaced: int) -> None:
        """Raise ``InvalidRequest`` when it holds ``max_subscriptions`` already, less the ``replaced`` one (if
        any) that the new one is to replace: tasks subscribed to, and tags (each one, whatever it streams)."""
        if len(self.subscriptions) - self.owned + len(self.tags) - replaced >= self.max_subscriptions:
            raise InvalidRequest(f"at most {self.max_subscriptions} subscriptions per connection")

    def quiet(self) -> bool:
        """Nothing of this connection is queued, being prepared or being sent: a frame written now directly
        cannot overtake another."""
        return (
            not self._ready
            and self.writing_since is None
            and self.preparing is None
            and self.close_code is None
            and self.closing is None
            and not self.control
        )

    def wake(self, sub: Subscription[H]) -> bool:
        """Give ``sub`` a turn; ``True`` when the connection had nothing to do (its writer may be idle)."""
        if sub.queued:
            return False
        sub.queued = True
        if self._ready is None:
            self._ready = deque((sub,))
            return True
        self._ready.append(sub)
        return False

    def send_control(self, frame: Frame) -> bool:
        """Queue a pong or an error frame after what is queued; ``False`` when ``max_control`` are queued
        already (the reader waits: a client that sends faster than it reads its answers is read slower)."""
        if self.control is None:
            self.control = deque()
        elif len(self.control) >= self.max_control:
            return False
        self.control.append(frame)
        if self._ready is None:
            self._ready = deque()
        self._ready.append(None)
        return True

    def control_full(self) -> bool:
        return self.control is not None and len(self.control) >= self.max_control

    def close(self, code: int) -> None:
        """End the connection with ``code``; the first code given stays."""
        if self.close_code is None:
            self.close_code = code

    def close_after(self, frame: Frame, code: int) -> None:
        """End the connection with ``code`` once ``frame`` (an error saying why) and everything queued
        before it are sent."""
        if self.close_code is not None or self.closing is not None:
            return
        self.closing = code
        if self.control is None:
            self.control = deque()
        self.control.append(frame)  # past max_control if need be: it is the last
        if self._ready is None:
            self._ready = deque()
        self._ready.append(None)

    def has_work(self) -> bool:
        """Whether :meth:`next` has something at once (a frame to send, or the end)."""
        return (
            self.close_code is not None or self.closing is not None or bool(self.control) or bool(self._ready)
        )

    def stalled(self, now: float, timeout_s: float) -> bool:
        """Whether the send under way has made no progress for ``timeout_s``: then the connection closes with
        ``4008``. The frame that send took will never be written, so nothing may be written directly either
        (the peer would see a gap before its close)."""
        if self.writing_since is None or now - self.writing_since <= timeout_s:
            return False
        self.writing_since = None
        self.direct = False
        self.close(CLOSE_SLOW_CONSUMER)
        return True

    def next(self) -> Step[H]:
        """What the writer does next: send a frame (of a subscription, or a control frame for ``None``),
        make a read and answer it (then ask again), or nothing: wait for work, or stop once ``close_code``
        is set."""
        while self.close_code is None:
            sub = self.preparing
            if sub is not None:  # its read was answered
                if self.reading is not None:
                    return None
                self.preparing = None
                # With streams, its next turn takes the head: their chunks may have to go before it.
                frame = sub.pop_head() if sub.head and sub.streams is None else None
            else:
                ready = self._ready
                if not ready:
                    if self.closing is not None:  # what went before its last frame is sent: the end
                        self.close_code = self.closing
                        continue
                    return None
                turn = ready.popleft()
                if not ready:
                    self._ready = None
                if turn is None:
                    assert self.control
                    answer = self.control.popleft()
                    if not self.control:
                        self.control = None
                    return None, answer
                sub = turn
                sub.queued = False
                if not sub.active:
                    continue
                step = self._step(sub)
                if step is not None and not isinstance(step, Frame):
                    self.reading, self.preparing = step, sub
                    return step
                frame = step
            if not sub.active:
                continue  # unsubscribed or replaced while its read ran: its frame is not sent
            if sub.has_work():
                self.wake(sub)
            if frame is not None:
                return sub, frame
        return None

    def _step(self, sub: Subscription[H]) -> Frame | PeerRead | None:
        streams = sub.streams
        if sub.head:
            if streams is not None and streams.streaming and len(sub.head) == 1:
                assert sub.last is not None
                if sub.last.terminal:  # the terminal entry, a gap's last: its streams' chunks go first
                    before, grown = streams.step(sub.task_id, ended=True, end=False)
                    self.stream_backlog += grown
                    if before is not None:
                        return before
            frame = sub.pop_head()
            if streams is not None and not sub.head:
                streams.streaming = True  # the resume frame is out
            return frame
        last = sub.last
        assert last is not None  # a subscription takes turns once its resume state is known
        if sub.beside is not None and (frames := sub.beside.take(last)):  # metadata, children: merged
            sub.put_head(frames[1:])
            return frames[0]
        if streams is not None:
            step, grown = streams.step(sub.task_id, ended=last.terminal, end=last.terminal)
            self.stream_backlog += grown
            if step is not None:
                return step
        if sub.conflated:  # the newest state instead of the backlog it dropped
            sub.conflated = False  # entries committed from here on collect again
            return NeedTask(sub.task_id)
        sub.drop_pending_through(last.version)
        pending = sub.pending
        if not pending:
            return None
        item = pending[0]
        if item.task.version == last.version + 1:
            if streams is not None and item.task.terminal:  # its streams' chunks go first
                before, grown = streams.step(sub.task_id, ended=True, end=False)
                self.stream_backlog += grown
                if before is not None:
                    return before
            pending.popleft()
            if not pending:
                sub.pending = None
            sub.last = item.task
            return item.frame
        # A gap (the channel handed out only the newest entry, or its first one, before this subscription's
        # state was known): fill it from the store, or past the backlog's bound send the state instead,
        # so that a gap never costs more memory than a backlog.
        if item.task.version - 1 - last.version > sub.backlog:
            sub.conflated = True
            self.conflations += 1
            return None
        return NeedEntries(sub.task_id, last.version, item.task.version - 1)

    # --- streams (gateway.live.published.SubStreams) ----------------------------------------------------

    def stream_live(self, sub: Subscription[H], stream: str, run: Run | None, next_offset: int) -> Live:
        """An append to ``stream`` of ``sub``'s task committed (``SubStreams.live``): what the driver does."""
        streams = sub.streams
        if streams is None or not sub.active or self.close_code is not None:
            return Live.NOTHING
        self.stream_backlog += streams.live(stream, run, next_offset)
        if self.stream_backlog > self.max_stream_backlog:
            self.close(CLOSE_SLOW_CONSUMER)
            return Live.SLOW
        if sub.last is None or not sub.has_work():
            return Live.NOTHING
        quiet = self.direct and self.quiet() and not (sub.head or sub.pending or sub.conflated)
        if quiet and not sub.last.terminal and streams.only(stream, run):
            return Live.DIRECT
        return Live.WAKE if self.wake(sub) else Live.NOTHING

    def stream_written(self, sub: Subscription[H], written: bool) -> Live:
        """After :attr:`Live.DIRECT`: the run's frame was written straight to the socket, or (``written``
        false) it had no room, and the writer sends it."""
        assert sub.streams is not None
        if written:
            self.stream_backlog += sub.streams.taken()
            return Live.NOTHING
        return Live.WAKE if self.wake(sub) else Live.NOTHING

    def stream_read(
        self,
        read: NeedStream,
        attempt: int,
        offset: int,
        chunks: Sequence[str],
        more: bool,
        size: int | None = None,
    ) -> None:
        """The answer to a :class:`NeedStream`: a page of the stream (``size``: its bytes, if known)."""
        sub = self._answered(read)
        if sub is not None:
            assert sub.streams is not None
            self.stream_backlog += sub.streams.answered(read, attempt, offset, chunks, more, size)
            self.preparing = None  # its next turn (a terminal entry in its head waits for it)
            self.wake(sub)

    def finals_read(self, read: NeedFinals, offsets: Mapping[str, int]) -> None:
        """The answer to a :class:`NeedFinals`: the next offset of each stream the task made."""
        sub = self._answered(read)
        if sub is not None:
            assert sub.streams is not None
            sub.streams.finals(offsets)
            self.preparing = None
            self.wake(sub)

    def task_read(self, read: NeedTask, task: Task) -> None:
        """The answer to a :class:`NeedTask` of :meth:`next`: a conflated snapshot, unless the state sent
        is already as new; a ``recreated`` one whatever its version if the task is of another history than
        the state sent (the task of that one ended and was deleted, and its id made again: what was queued
        of either history goes, and a gap after the snapshot is filled from the store)."""
        sub = self._answered(read)
        if sub is None:
            return
        assert sub.last is not None
        if task.epoch != sub.last.epoch:
            sub.last = task
            sub.pending = None
            sub.put_head((snapshot_frame(task, RECREATED),))
        elif task.version > sub.version:
            sub.last = task
            sub.put_head((snapshot_frame(task, "conflated"),))

    def entries_read(self, read: NeedEntries, entries: Entries) -> None:
        """The answer to a :class:`NeedEntries` of :meth:`next`: the gap's entries, replayed."""
        sub = self._answered(read)
        if sub is None:
            return
        assert sub.last is not None
        filled = replay(sub.last, entries)
        if filled:
            sub.put_head([frame for _, frame in filled])
            sub.last = filled[-1][0]
        if sub.version < read.upto:
            sub.conflated = True  # history is whole, so this cannot happen; stay exact regardless

    def read_failed(self, read: PeerRead) -> None:
        """The read was not made: the subscription tries again on its next turn."""
        sub = self._answered(read)
        if sub is not None:
            self.preparing = None
            if isinstance(read, NeedTask):
                sub.conflated = True
            elif isinstance(read, NeedStream):
                assert sub.streams is not None
                sub.streams.outs.failed(read.read)
            self.wake(sub)

    def _answered(self, read: PeerRead) -> Subscription[H] | None:
        if read is not self.reading:
            return None
        self.reading = None
        sub = self.preparing
        return sub if sub is not None and sub.active else None
