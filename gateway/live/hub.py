"""The hub: carries committed history entries to live subscribers, in order, with no gap.

Every committed entry reaches :meth:`Hub.receive` through the bus (``gateway.bus``): at once from this
process's own commits, later from other processes'. The entry's ``event`` frame was encoded once, by the
process that committed it; the hub offers that same text to every subscription of the task and never
awaits, so a callback is answered as soon as it is committed, whatever its subscribers do.

Per task, a :class:`Channel` hands entries to its subscriptions strictly in version order. A message
ahead of a missing version (reordered, or one lost by the bus) waits there while :meth:`Hub.run` reads
the missing entries from the store, once for the task however many subscribers it has; after the bus
reconnects, and now and then on a shared bus, the hub compares every channel with the store in one query
per thousand tasks (:meth:`Hub.reconcile`).

Each connection owns a :class:`Feed`: its subscriptions, each with a bounded backlog, and the merge that
gives the ordering guarantee of protocol.md:

1. subscribe first: from then on, live entries collect in the subscription's backlog;
2. read the resume state from the store and queue the resume frame at version V;
3. drop every live entry at or below the version already sent; fill any gap from the store, replaying the
   missing entries on the last state sent with the pure machine, so each ``event`` frame still carries
   the task after its entry.

A subscription whose backlog passes its bound drops it and sends one ``snapshot`` (``reason: conflated``)
read from the store: the client keeps an exact state and a valid cursor, and memory stays bounded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import anyio
import orjson

from gateway.book import Book
from gateway.bus.base import News
from gateway.errors import CLOSE_INTERNAL_ERROR, GatewayError, InvalidRequest
from gateway.frames import PONG, Frame, error_frame, event_frame, resume_frame, snapshot_frame, text_frame
from gateway.machine import Entry, Task, apply_event, event_from_json


class DirectWriter(Protocol):
    """A socket that can take already-framed bytes now (``gateway.server.ws_protocol``)."""

    def can_write(self, size: int) -> bool: ...

    def write(self, data: bytes) -> None: ...


__all__ = ["PONG", "Feed", "Frame", "Hub", "Subscription", "error_frame", "event_frame"]

log = logging.getLogger("gateway.hub")

# Messages one channel keeps that arrived ahead of a missing version, while the store is read.
MAX_AHEAD = 64
# The task ids of one reconcile query.
RECONCILE_CHUNK = 1000
# Fan-out holds the event loop for at most this long at a time (then callbacks and the rest run: a callback
# read or committed meanwhile waits at most this long for its turn; 1 ms costs one more turn of the loop
# per 100 sockets or so), checking
# the clock every so many subscriptions.
FLUSH_SLICE_S = 0.001
FLUSH_CHECK_EVERY = 32
# While callbacks are being answered, fan-out looks again this often, and takes a slice at least this
# often whatever the callbacks (so that it always progresses, at a tenth of the loop at the least).
FLUSH_YIELD_S = 0.005
FLUSH_MAX_PAUSE_S = 0.05


class Published:
    """A committed entry as every subscription of its task gets it: the task after it, its frame, and
    that frame as WebSocket bytes (framed once, on first use, for every socket written to directly)."""

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


class Subscription:
    """One task on one connection: the last state sent and the live entries not yet sent."""

    __slots__ = ("active", "backlog", "conflated", "feed", "head", "last", "pending", "queued", "task_id")

    def __init__(self, task_id: str, feed: Feed, backlog: int) -> None:
        self.task_id = task_id
        self.feed = feed
        self.backlog = backlog
        self.last: Task | None = None  # None while the resume state is being read
        # Made when first needed and dropped when emptied: an idle socket holds no deque (624 bytes each).
        self.pending: deque[Published] | None = None
        self.head: deque[Frame] | None = None  # frames that go before ``pending``: resume, gap fill
        self.conflated = False
        self.queued = False
        self.active = True

    def offer(self, items: Sequence[Published], joined: dict[int, bytes] | None = None) -> None:
        """The entries of one fan-out round, consecutive versions in order; ``joined`` keeps the round's
        bytes from each starting entry, so that sockets at the same point share one join."""
        if self.conflated:
            return
        feed = self.feed
        last = self.last
        if feed.direct is not None and last is not None and not self.pending and not self.head:
            start = last.version + 1 - items[0].task.version
            count = len(items) - start
            if 0 <= start < len(items) and not items[-1].task.terminal and feed.quiet():
                # The fast path: nothing of this connection is queued or in flight, and its transport
                # has room: the entries' bytes go out now, in one write, with no wake-up of its writer.
                # (A terminal entry takes the writer's way: it closes or unsubscribes after it.)
                data: bytes | None = None
                if count > self.backlog:
                    # Fan-out fell this far behind: the latest state instead (one snapshot, framed once
                    # for the whole round), as a backlog past its bound would get; no store read.
                    data = items[-1].conflated_wire
                elif count == 1:
                    data = items[start].wire
                else:
                    data = joined.get(start) if joined is not None else None
                    if data is None:
                        data = b"".join(i.wire for i in items[start:])
                        if joined is not None:
                            joined[start] = data
                if feed.direct.can_write(len(data)):
                    feed.direct.write(data)
                    self.last = items[-1].task
                    if count > self.backlog:
                        feed.hub.conflations += 1
                        feed.hub.direct_writes += 1
                    else:
                        feed.hub.direct_writes += count
                    return
        for item in items:
            self._queue(item)
            if self.conflated:
                return

    def _queue(self, item: Published) -> None:
        if self.pending is None:
            self.pending = deque()
        if len(self.pending) >= self.backlog:
            self.pending = None
            self.conflated = True
            self.feed.hub.conflations += 1
        else:
            self.pending.append(item)
        if self.last is not None:
            self.feed.wake(self)

    def push_head(self, frames: Iterable[Frame]) -> None:
        if self.head is None:
            self.head = deque()
        self.head.extend(frames)

    def pop_head(self) -> Frame:
        assert self.head
        frame = self.head.popleft()
        if not self.head:
            self.head = None
        return frame

    def pop_pending(self) -> Published:
        assert self.pending
        item = self.pending.popleft()
        if not self.pending:
            self.pending = None
        return item

    def unpop_pending(self, item: Published) -> None:
        if self.pending is None:
            self.pending = deque()
        self.pending.appendleft(item)

    def drop_pending_through(self, version: int) -> None:
        """Drop the pending entries at or below ``version`` (a resume frame or a snapshot covered them)."""
        while self.pending and self.pending[0].task.version <= version:
            self.pop_pending()

    def has_work(self) -> bool:
        return bool(self.head or self.pending or self.conflated)

    @property
    def finished(self) -> bool:
        """Its terminal state has been handed out: a terminal task gets no further entry, so anything
        still in ``pending`` is a stale copy of what was already sent."""
        return self.last is not None and self.last.terminal and not self.head


class Channel:
    """One task's live stream in this process: its subscriptions and the last state handed to them.

    Entries reach the subscriptions in version order with no gap, whatever order the bus delivers them in:
    a message ahead of a missing version waits here while the hub reads the missing entries from the store,
    once for the task, however many subscribers it has."""

    __slots__ = (
        "ahead",
        "flushing",
        "hub",
        "last",
        "outbox",
        "round",
        "sliced_at",
        "subscriptions",
        "task_id",
    )

    def __init__(self, task_id: str, hub: Hub) -> None:
        self.task_id = task_id
        self.hub = hub
        self.subscriptions: set[Subscription] = set()
        # The last state handed to the subscriptions; None until a message or a resume read tells.
        self.last: Task | None = None
        self.ahead: dict[int, News] = {}
        # Entries handed out, not yet offered to the subscriptions (the next fan-out round).
        self.outbox: list[Published] = []
        # The round being offered: its subscriptions, its entries and how far it has gone.
        # The round being handed out: its subscriptions, its entries, how many were offered so far, and
        # the round's bytes from each starting entry, joined once for every socket that takes them.
        self.round: tuple[tuple[Subscription, ...], list[Published], int, dict[int, bytes]] | None = None
        self.flushing = False
        self.sliced_at = 0.0  # when its fan-out last took a slice of the loop

    @property
    def version(self) -> int:
        return -1 if self.last is None else self.last.version

    def hand_out(self, task: Task, frame: Frame) -> None:
        """The next entry of the task: offered to every subscription in the next fan-out round."""
        self.last = task
        self.outbox.append(Published(task, frame))
        if not self.flushing:
            self.flushing = True
            asyncio.get_running_loop().call_soon(self.hub.flush, self)

    def drain_ahead(self) -> None:
        while self.ahead:
            news = self.ahead.pop(self.version + 1, None)
            if news is None:
                break
            assert news.task is not None and news.frame is not None
            self.hand_out(news.task, news.frame)
        for version in [v for v in self.ahead if v <= self.version]:
            del self.ahead[version]


class Hub:
    """Subscriptions by task, fed by the bus; reads the store once per task to fill what the bus missed.

    ``run`` (owned by the app's lifespan) is the one task that does those reads: after a version jump,
    after the bus reconnects, and every ``reconcile_s`` on a bus shared with other processes."""

    def __init__(self, book: Book | None = None) -> None:
        self.book = book
        self._channels: dict[str, Channel] = {}
        self.feeds: set[Feed] = set()
        self.conflations = 0
        self.catch_ups = 0
        self.direct_writes = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._due: deque[str] = deque()
        self._due_set: set[str] = set()
        self._resync = False
        self._wakeup = asyncio.Event()
        # Whether callbacks are being answered now (the app counts them); fan-out yields to them.
        self.callbacks_waiting: Callable[[], bool] = lambda: False

    # --- news from the bus ------------------------------------------------------------------------------

    def receive(self, news: News) -> None:
        """A committed entry heard on the bus (this process's or another's). Never waits."""
        channel = self._channels.get(news.task_id)
        if channel is None or news.version <= channel.version:
            return  # no subscriber here, or already handed out (the echo of this process's own publish)
        if news.task is not None and news.frame is not None:
            if channel.last is None or news.version == channel.version + 1:
                channel.hand_out(news.task, news.frame)
                channel.drain_ahead()
                return
            if len(channel.ahead) < MAX_AHEAD:
                channel.ahead[news.version] = news
        self._schedule(channel.task_id)

    def publish(self, task: Task, entry: Entry, encoded_event: bytes) -> None:
        """Offer a committed entry of this process to the task's subscribers (its frame encoded once)."""
        self.receive(News.of(task, event_frame(task, encoded_event)))

    def resync(self) -> None:
        """Messages may have been missed (the bus reconnected): check every task against the store."""
        self._resync = True
        self._wakeup.set()

    def seed(self, task_id: str) -> None:
        """A subscription of the task has its resume state: once every subscription of a channel that has
        heard nothing yet has one, the oldest of them is where the channel stands (each subscription drops
        what it already has). Never newer: a subscription whose read was older would miss the entries in
        between, since the channel hands out only what follows its state."""
        channel = self._channels.get(task_id)
        if channel is None or channel.last is not None:
            return
        states = [s.last for s in channel.subscriptions]
        if states and all(state is not None for state in states):
            channel.last = min(states, key=lambda state: state.version)  # type: ignore[union-attr]
            channel.drain_ahead()

    def _schedule(self, task_id: str) -> None:
        if task_id not in self._due_set:
            self._due_set.add(task_id)
            self._due.append(task_id)
            self._wakeup.set()

    async def run(self, reconcile_s: float | None = None) -> None:
        """Fill from the store what the bus did not bring; ``reconcile_s``: also check every task that
        often (a shared bus can lose a message; a lost one is then late by at most this)."""
        next_check = None if reconcile_s is None else time.monotonic() + reconcile_s
        while True:
            timeout = None if next_check is None else max(0.0, next_check - time.monotonic())
            with anyio.move_on_after(timeout):
                await self._wakeup.wait()
            self._wakeup.clear()
            try:
                if next_check is not None and time.monotonic() >= next_check:
                    self._resync = True
                    assert reconcile_s is not None
                    next_check = time.monotonic() + reconcile_s
                if self._resync:
                    self._resync = False
                    await self.reconcile()
                while self._due:
                    task_id = self._due.popleft()
                    self._due_set.discard(task_id)
                    await self.catch_up(task_id)
            except Exception as exc:  # a database outage: the next wake-up or check tries again
                log.warning("hub: cannot read the store to catch up (%s)", exc)
                self._resync = True
                await anyio.sleep(0.5)
                self._wakeup.set()

    async def reconcile(self) -> None:
        """Compare every channel's version with the store's, in one query per chunk; catch up those behind."""
        assert self.book is not None
        ids = list(self._channels)
        for start in range(0, len(ids), RECONCILE_CHUNK):
            chunk = ids[start : start + RECONCILE_CHUNK]
            stored = await self.book.versions(chunk)
            for task_id in chunk:
                channel = self._channels.get(task_id)
                version = stored.get(task_id)
                if channel is not None and version is not None and version > channel.version:
                    self._schedule(task_id)

    async def catch_up(self, task_id: str) -> None:
        """Hand the channel every entry it missed, read from the store (one read for all its subscribers)."""
        assert self.book is not None
        channel = self._channels.get(task_id)
        if channel is None:
            return
        self.catch_ups += 1
        if channel.last is None:
            # Nothing handed out yet: the subscriptions' resume reads cover the past; hand out the newest
            # entry, so that one whose read came before it still gets it (it fills any gap itself).
            try:
                task = await self.book.get(task_id)
            except GatewayError:
                return
            found = await self.book.entries_between(task_id, task.version - 1, task.version)
            if channel.last is None:
                if found:
                    channel.hand_out(task, event_frame(task, found[-1][1]))
                channel.drain_ahead()
                return
            # A state was handed out or seeded during the reads: go on from it.
        base = channel.last
        assert base is not None
        found = await self.book.entries_between(task_id, base.version, 2**62)
        task = base
        for version, raw in found:
            task = apply_event(task, event_from_json(orjson.loads(raw))).task
            if task.version != version:  # history is whole, so this cannot happen; stay exact regardless
                log.error("hub: history of %s does not replay at version %d", task_id, version)
                break
            if version == channel.version + 1:
                channel.hand_out(task, event_frame(task, raw))
        channel.drain_ahead()

    def flush(self, channel: Channel) -> None:
        """Offer a channel's entries to its subscriptions, a slice of at most ``FLUSH_SLICE_S`` at a time.

        Between slices the event loop runs everything else, callbacks first among it: fan-out never holds
        the loop for long, however many subscribers a task has. Entries that arrive during a round form the
        next one, so when fan-out falls behind, each subscriber gets several entries in one write (or, past
        its backlog, one conflated snapshot): the work per entry shrinks as the load grows."""
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        if self.callbacks_waiting() and now - channel.sliced_at < FLUSH_MAX_PAUSE_S:
            # Callbacks first: while one is being answered fan-out waits (a slice at least every
            # FLUSH_MAX_PAUSE_S, so that it always progresses). The entries that pile up meanwhile go out
            # together in the next round, or as one conflated snapshot: fan-out is shed, never callbacks.
            loop.call_later(FLUSH_YIELD_S, self.flush, channel)
            return
        channel.sliced_at = now
        if channel.round is None:
            items, channel.outbox = channel.outbox, []
            if not items:
                channel.flushing = False
                return
            channel.round = (tuple(channel.subscriptions), items, 0, {})
        subscriptions, items, done, joined = channel.round
        deadline = now + FLUSH_SLICE_S
        count = len(subscriptions)
        while done < count:
            subscription = subscriptions[done]
            done += 1
            if subscription.active:
                try:
                    subscription.offer(items, joined)
                except Exception:  # never leave the task's fan-out stuck: this connection starts over
                    log.exception(
                        "hub: offering %s to a subscription failed; closing its connection", items[0].task.id
                    )
                    subscription.feed.close(CLOSE_INTERNAL_ERROR)
            if done % FLUSH_CHECK_EVERY == 0 and time.perf_counter() >= deadline:
                break
        channel.round = (subscriptions, items, done, joined) if done < count else None
        loop.call_soon(self.flush, channel)

    # --- subscriptions ----------------------------------------------------------------------------------

    def add(self, subscription: Subscription) -> None:
        channel = self._channels.get(subscription.task_id)
        if channel is None:
            channel = self._channels[subscription.task_id] = Channel(subscription.task_id, self)
        channel.subscriptions.add(subscription)

    def remove(self, subscription: Subscription) -> None:
        subscription.active = False
        channel = self._channels.get(subscription.task_id)
        if channel is not None:
            channel.subscriptions.discard(subscription)
            if not channel.subscriptions:
                del self._channels[subscription.task_id]

    def stats(self) -> dict[str, int]:
        """Queue sizes, so that tests and metrics can see that memory stays bounded."""
        subscriptions = [s for c in self._channels.values() for s in c.subscriptions]
        return {
            "connections": len(self.feeds),
            "subscriptions": len(subscriptions),
            "pending_total": sum(len(s.pending or ()) for s in subscriptions),
            "pending_max": max((len(s.pending or ()) for s in subscriptions), default=0),
            "control_max": max((len(f.control or ()) for f in self.feeds), default=0),
            "conflations": self.conflations,
            "catch_ups": self.catch_ups,
            "direct_writes": self.direct_writes,
            "outbox_max": max((len(c.outbox) for c in self._channels.values()), default=0),
        }

    def attach(self, feed: Feed) -> None:
        self.feeds.add(feed)
        self._idle.clear()

    def detach(self, feed: Feed) -> None:
        self.feeds.discard(feed)
        if not self.feeds:
            self._idle.set()

    async def idle(self) -> None:
        """Wait until no connection is left."""
        await self._idle.wait()

    async def watch_writes(self, timeout_s: float) -> None:
        """Cancel the send of every connection whose write has made no progress for ``timeout_s``."""
        while True:
            await asyncio.sleep(min(1.0, timeout_s / 4))
            now = time.monotonic()
            for feed in tuple(self.feeds):
                if feed.writing_since is not None and now - feed.writing_since > timeout_s:
                    feed.stall()

    def shutdown(self, code: int) -> None:
        for feed in tuple(self.feeds):
            feed.close(code)


class Feed:
    """The frames one connection is to send, across its subscriptions, in a fair order."""

    def __init__(
        self,
        hub: Hub,
        book: Book,
        *,
        backlog: int = 256,
        max_subscriptions: int = 1000,
        max_control: int = 256,
    ) -> None:
        self.hub = hub
        self.book = book
        self.backlog = backlog
        self.max_subscriptions = max_subscriptions
        self.max_control = max_control
        self.subscriptions: dict[str, Subscription] = {}
        self.control: deque[Frame] | None = None  # made when needed, dropped when emptied
        self.close_code: int | None = None
        # Where the socket can be written to directly (gateway.server.ws_protocol); None for SSE and in tests.
        self.direct: DirectWriter | None = None
        self._in_next = False  # a frame is being prepared (it may read the store): nothing may overtake it
        # Set by the writer around each send; the hub's watchdog stalls a feed stuck in one send.
        self.writing_since: float | None = None
        self.on_stall: Callable[[], object] | None = None
        # What is to be sent, in order: a subscription with work, or None for the next control frame. A
        # pong or an error answers a message, so it goes after what earlier messages queued (the resume
        # frame of a subscribe sent before a ping), never ahead of it. Made when needed, dropped when emptied.
        self._ready: deque[Subscription | None] | None = None
        self._waiter: asyncio.Future[None] | None = None  # next() waiting for work
        self._room: asyncio.Event | None = None  # a reader waiting for room in ``control`` (rare)
        # Called whenever there is work for the writer (the WebSocket endpoint starts one then).
        self.on_work: Callable[[], object] | None = None
        hub.attach(self)

    async def subscribe(self, task_id: str, cursor: int) -> Subscription:
        """Subscribe (replacing an earlier subscription to the same task) and queue the resume frame.

        Raises ``UnknownTask`` or ``InvalidRequest`` (a bad cursor) with nothing left subscribed.
        """
        self.unsubscribe(task_id)
        if len(self.subscriptions) >= self.max_subscriptions:
            raise InvalidRequest(f"at most {self.max_subscriptions} subscriptions per connection")
        subscription = Subscription(task_id, self, self.backlog)
        # Registered at once, so that an unsubscribe or a release while the state is read finds it.
        self.subscriptions[task_id] = subscription
        self.hub.add(subscription)  # live entries collect from here on, before the state is read
        try:
            resume = await self.book.resume(task_id, cursor)
        except BaseException:
            if self.subscriptions.get(task_id) is subscription:
                del self.subscriptions[task_id]
            self.hub.remove(subscription)
            raise
        if not subscription.active:  # unsubscribed or released while the state was being read
            return subscription
        subscription.last = resume.task
        self.hub.seed(task_id)
        subscription.push_head((resume_frame(resume),))
        # Entries committed while the state was read are already in the resume frame.
        subscription.drop_pending_through(resume.task.version)
        self.wake(subscription)
        return subscription

    def unsubscribe(self, task_id: str) -> None:
        subscription = self.subscriptions.pop(task_id, None)
        if subscription is not None:
            self.hub.remove(subscription)

    def quiet(self) -> bool:
        """Nothing of this connection is queued, being prepared or being sent: a frame written now directly
        cannot overtake another."""
        return (
            not self.control
            and not self._ready
            and self.writing_since is None
            and not self._in_next
            and self.close_code is None
        )

    def send_control(self, frame: Frame) -> bool:
        """Queue a pong or an error frame after what is queued; ``False`` when ``max_control`` are queued
        already (then wait for :meth:`control_room`)."""
        if self.control is None:
            self.control = deque()
        elif len(self.control) >= self.max_control:
            return False
        self.control.append(frame)
        if self._ready is None:
            self._ready = deque()
        self._ready.append(None)
        self._signal()
        return True

    async def control_room(self) -> None:
        """Wait until a control frame can be queued (or the feed is closed). A client that sends faster
        than it reads its answers is read more slowly; one that stops reading is cut by the watchdog."""
        while self.control is not None and len(self.control) >= self.max_control and self.close_code is None:
            if self._room is None:
                self._room = asyncio.Event()
            self._room.clear()
            await self._room.wait()

    def wake(self, subscription: Subscription) -> None:
        if not subscription.queued:
            subscription.queued = True
            if self._ready is None:
                self._ready = deque()
            self._ready.append(subscription)
        self._signal()

    def close(self, code: int) -> None:
        if self.close_code is None:
            self.close_code = code
        self._signal()
        if self._room is not None:
            self._room.set()

    def _signal(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.on_work is not None:
            self.on_work()

    def has_work(self) -> bool:
        """Whether :meth:`next` would return at once (a frame to send, or the end)."""
        return self.close_code is not None or bool(self.control) or bool(self._ready)

    def stall(self) -> None:
        # The send it cancels took a frame out of the queue that will never be written: from now on
        # nothing may be written directly either (it would follow a gap); the connection closes with 4008.
        self.direct = None
        self.writing_since = None
        if self.on_stall is not None:
            self.on_stall()

    def release(self) -> None:
        for task_id in tuple(self.subscriptions):
            self.unsubscribe(task_id)
        self.hub.detach(self)

    async def next(self) -> tuple[Subscription | None, Frame] | None:
        """The next frame to send (with its subscription), or ``None`` once the feed is closed."""
        while True:
            if self.close_code is not None:
                return None
            if not self._ready:
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
                continue
            subscription = self._ready.popleft()
            if not self._ready:
                self._ready = None
            if subscription is None:  # the next control frame
                assert self.control
                answer = self.control.popleft()
                if not self.control:
                    self.control = None
                if self._room is not None:
                    self._room.set()
                return None, answer
            subscription.queued = False
            if not subscription.active:
                continue
            self._in_next = True
            try:
                frame = await self._next_frame(subscription)
            finally:
                self._in_next = False
            if not subscription.active:
                continue  # unsubscribed or replaced while its store read ran: its frame is not sent
            if subscription.has_work():
                self.wake(subscription)
            if frame is not None:
                return subscription, frame

    async def _next_frame(self, sub: Subscription) -> Frame | None:
        if sub.head:
            return sub.pop_head()
        assert sub.last is not None
        if sub.conflated:
            sub.conflated = False
            task = await self.book.get(sub.task_id)
            if task.version <= sub.last.version:
                return None
            sub.last = task
            return snapshot_frame(task, "conflated")
        last = sub.last.version
        sub.drop_pending_through(last)  # the resume frame, a snapshot or a gap fill already covered it
        if not sub.pending:
            return None
        item = sub.pop_pending()
        if item.task.version == last + 1:
            sub.last = item.task
            return item.frame
        # A gap (entries committed concurrently can be published out of order): fill it from the store,
        # or, past the backlog's bound, send the state instead, so that a gap never costs more memory.
        sub.unpop_pending(item)
        if item.task.version - 1 - last > sub.backlog:
            sub.conflated = True
            self.hub.conflations += 1
            return None
        self._fill(sub, await self.book.entries_between(sub.task_id, last, item.task.version - 1))
        return sub.pop_head() if sub.head else None

    @staticmethod
    def _fill(sub: Subscription, entries: Sequence[tuple[int, bytes]]) -> None:
        assert sub.last is not None
        task = sub.last
        frames = []
        for version, raw in entries:
            task = apply_event(task, event_from_json(orjson.loads(raw))).task
            if task.version != version:  # history is whole, so this cannot happen; stay exact regardless
                sub.conflated = True
                return
            frames.append(event_frame(task, raw))
        if not frames:
            sub.conflated = True
            return
        sub.push_head(frames)
        sub.last = task
