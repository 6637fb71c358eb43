"""The hub: carries committed history entries to live subscribers, in order, with no gap.

``Book`` hands each committed entry to :meth:`Hub.publish` (after the commit, never before). The hub
encodes the ``event`` frame once and offers the same string to every subscription of that task; it never
awaits, so a callback is answered as soon as it is committed, whatever its subscribers do.

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
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.book import Book, Resume
from gateway.errors import InvalidRequest
from gateway.machine import Entry, Task, apply_event, event_from_json, task_to_json


@dataclass(frozen=True, slots=True)
class Frame:
    """One server frame: its ``type``, the cursor it leaves the client at, and its JSON text."""

    type: str
    version: int
    text: str


@dataclass(frozen=True, slots=True)
class Published:
    task: Task
    frame: Frame


def event_frame(task: Task, encoded_event: bytes) -> Frame:
    text = b'{"type":"event","taskId":%b,"version":%d,"event":%b,"task":%b}' % (
        orjson.dumps(task.id),
        task.version,
        encoded_event,
        orjson.dumps(task_to_json(task)),
    )
    return Frame("event", task.version, text.decode())


def resume_frame(resume: Resume) -> Frame:
    task = resume.task
    head: dict[str, Any] = {"type": resume.mode, "taskId": task.id, "version": task.version}
    if resume.reason is not None:
        head["reason"] = resume.reason
    head["task"] = task_to_json(task)
    text = orjson.dumps(head)
    if resume.mode == "delta":
        text = text[:-1] + b',"events":' + resume.entries_json() + b"}"
    return Frame(resume.mode, task.version, text.decode())


def snapshot_frame(task: Task, reason: str) -> Frame:
    body = {"type": "snapshot", "taskId": task.id, "version": task.version, "reason": reason}
    body["task"] = task_to_json(task)
    return Frame("snapshot", task.version, orjson.dumps(body).decode())


def error_frame(code: str, message: str, task_id: str | None = None) -> Frame:
    body: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if task_id is not None:
        body["taskId"] = task_id
    return Frame("error", -1, orjson.dumps(body).decode())


PONG = Frame("pong", -1, '{"type":"pong"}')


class Subscription:
    """One task on one connection: the last state sent and the live entries not yet sent."""

    __slots__ = ("active", "backlog", "conflated", "feed", "head", "last", "pending", "queued", "task_id")

    def __init__(self, task_id: str, feed: Feed, backlog: int) -> None:
        self.task_id = task_id
        self.feed = feed
        self.backlog = backlog
        self.last: Task | None = None  # None while the resume state is being read
        self.pending: deque[Published] = deque()
        self.head: deque[Frame] = deque()  # frames that go before ``pending``: resume, gap fill
        self.conflated = False
        self.queued = False
        self.active = True

    def offer(self, item: Published) -> None:
        if self.conflated:
            return
        if len(self.pending) >= self.backlog:
            self.pending.clear()
            self.conflated = True
            self.feed.hub.conflations += 1
        else:
            self.pending.append(item)
        if self.last is not None:
            self.feed.wake(self)

    def has_work(self) -> bool:
        return bool(self.head or self.pending or self.conflated)

    @property
    def finished(self) -> bool:
        """Its terminal state has been handed out: a terminal task gets no further entry, so anything
        still in ``pending`` is a stale copy of what was already sent."""
        return self.last is not None and self.last.terminal and not self.head


class Hub:
    def __init__(self) -> None:
        self._subscribers: dict[str, set[Subscription]] = {}
        self.feeds: set[Feed] = set()
        self.conflations = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def publish(self, task: Task, entry: Entry, encoded_event: bytes) -> None:
        """Offer a committed entry to the task's subscribers; encodes its frame once, never waits."""
        subscribers = self._subscribers.get(task.id)
        if not subscribers:
            return
        item = Published(task, event_frame(task, encoded_event))
        for subscription in tuple(subscribers):
            subscription.offer(item)

    def add(self, subscription: Subscription) -> None:
        self._subscribers.setdefault(subscription.task_id, set()).add(subscription)

    def remove(self, subscription: Subscription) -> None:
        subscription.active = False
        subscribers = self._subscribers.get(subscription.task_id)
        if subscribers is not None:
            subscribers.discard(subscription)
            if not subscribers:
                del self._subscribers[subscription.task_id]

    def stats(self) -> dict[str, int]:
        """Queue sizes, so that tests and metrics can see that memory stays bounded."""
        subscriptions = [s for subs in self._subscribers.values() for s in subs]
        return {
            "connections": len(self.feeds),
            "subscriptions": len(subscriptions),
            "pending_total": sum(len(s.pending) for s in subscriptions),
            "pending_max": max((len(s.pending) for s in subscriptions), default=0),
            "control_max": max((len(f.control) for f in self.feeds), default=0),
            "conflations": self.conflations,
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
        self.control: deque[Frame] = deque()
        self.close_code: int | None = None
        # Set by the writer around each send; the hub's watchdog stalls a feed stuck in one send.
        self.writing_since: float | None = None
        self.on_stall: Callable[[], object] | None = None
        self._ready: deque[Subscription] = deque()
        self._wakeup = asyncio.Event()
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
        subscription.head.append(resume_frame(resume))
        # Entries committed while the state was read are already in the resume frame.
        while subscription.pending and subscription.pending[0].task.version <= resume.task.version:
            subscription.pending.popleft()
        self.wake(subscription)
        return subscription

    def unsubscribe(self, task_id: str) -> None:
        subscription = self.subscriptions.pop(task_id, None)
        if subscription is not None:
            self.hub.remove(subscription)

    def send_control(self, frame: Frame) -> bool:
        """Queue a pong or an error frame; ``False`` when the peer is not reading its answers."""
        if len(self.control) >= self.max_control:
            return False
        self.control.append(frame)
        self._wakeup.set()
        return True

    def wake(self, subscription: Subscription) -> None:
        if not subscription.queued:
            subscription.queued = True
            self._ready.append(subscription)
        self._wakeup.set()

    def close(self, code: int) -> None:
        if self.close_code is None:
            self.close_code = code
        self._wakeup.set()

    def stall(self) -> None:
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
            if self.control:
                return None, self.control.popleft()
            if not self._ready:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            subscription = self._ready.popleft()
            subscription.queued = False
            if not subscription.active:
                continue
            frame = await self._next_frame(subscription)
            if not subscription.active:
                continue  # unsubscribed or replaced while its store read ran: its frame is not sent
            if subscription.has_work():
                self.wake(subscription)
            if frame is not None:
                return subscription, frame

    async def _next_frame(self, sub: Subscription) -> Frame | None:
        if sub.head:
            return sub.head.popleft()
        assert sub.last is not None
        if sub.conflated:
            sub.conflated = False
            task = await self.book.get(sub.task_id)
            if task.version <= sub.last.version:
                return None
            sub.last = task
            return snapshot_frame(task, "conflated")
        last = sub.last.version
        while sub.pending and sub.pending[0].task.version <= last:
            sub.pending.popleft()  # the resume frame, a snapshot or a gap fill already covered it
        if not sub.pending:
            return None
        item = sub.pending.popleft()
        if item.task.version == last + 1:
            sub.last = item.task
            return item.frame
        # A gap (entries committed concurrently can be published out of order): fill it from the store,
        # or, past the backlog's bound, send the state instead, so that a gap never costs more memory.
        sub.pending.appendleft(item)
        if item.task.version - 1 - last > sub.backlog:
            sub.conflated = True
            self.hub.conflations += 1
            return None
        self._fill(sub, await self.book.entries_between(sub.task_id, last, item.task.version - 1))
        return sub.head.popleft() if sub.head else None

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
        sub.head.extend(frames)
        sub.last = task
