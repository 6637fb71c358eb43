"""One connection's side of the hub (``gateway.live.hub``): the frames it is to send, and the waiting.

A :class:`Feed` drives one :class:`~gateway.live.peer.Peer`: its writer sleeps until there is work, makes
the store reads its next frame needs, and a reader that sends faster than it reads its answers waits for
room. The WebSocket and SSE endpoints (``gateway.web.sockets``, ``gateway.web.sse``) give each connection
one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from gateway.errors import CLOSE_NO_SUBSCRIPTION, CLOSE_SLOW_CONSUMER
from gateway.frames import Frame, error_frame
from gateway.live.fanout import NeedTask, Peer, Subscription, TagSub
from gateway.live.hub import BookReads, Connection, DirectWriter, Hub
from gateway.live.published import (
    CATCH_UP_BYTES,
    STREAM_BACKLOG_BYTES,
    NeedEntries,
    NeedStream,
    PeerRead,
    SubStreams,
)
from gateway.live.tagging import NEW
from gateway.streams import MAX_PAGE_CHUNKS

__all__ = ["Feed"]


class Feed:
    """The frames one connection is to send (its :class:`~gateway.live.peer.Peer`), with the waiting: its
    writer sleeps until there is work, makes the reads the next frame needs, and a reader that sends faster
    than it reads its answers waits for room."""

    def __init__(
        self,
        hub: Hub,
        book: BookReads,
        *,
        backlog: int = 256,
        max_subscriptions: int = 1000,
        max_control: int = 256,
        stream_backlog: int = STREAM_BACKLOG_BYTES,
    ) -> None:
        self.hub = hub
        self.book = book
        self.peer: Peer[Connection] = Peer(
            self,
            backlog=backlog,
            max_subscriptions=max_subscriptions,
            max_control=max_control,
            max_stream_backlog=stream_backlog,
        )
        # Where the socket can be written to directly (gateway.server.ws_protocol); None for SSE and in tests.
        self.writer: DirectWriter | None = None
        # Called when the watchdog cuts the connection: cancels its stuck send (or aborts an SSE stream).
        self.on_stall: Callable[[], object] | None = None
        # Called whenever there is work for the writer (the WebSocket endpoint starts one then).
        self.on_work: Callable[[], object] | None = None
        # Called when a subscription's terminal entry was written directly (:meth:`finished`); by default
        # it is unsubscribed.
        self.on_finished: Callable[[], object] | None = None
        self._waiter: asyncio.Future[None] | None = None  # next() waiting for work
        self._room: asyncio.Event | None = None  # a reader waiting for room for a control frame (rare)
        hub.attach(self)

    @property
    def direct(self) -> DirectWriter | None:
        return self.writer

    @direct.setter
    def direct(self, writer: DirectWriter | None) -> None:
        self.writer = writer
        self.peer.direct = writer is not None

    @property
    def subscriptions(self) -> dict[str, Subscription[Connection]]:
        return self.peer.subscriptions

    @property
    def close_code(self) -> int | None:
        return self.peer.close_code

    @property
    def writing_since(self) -> float | None:
        """When the send under way began (the hub's ``monotonic``), set by the writer around each send."""
        return self.peer.writing_since

    @writing_since.setter
    def writing_since(self, value: float | None) -> None:
        self.peer.writing_since = value
        if value is not None:
            self.hub.watch(self)  # the watchdog times this send

    def hold_to(self, deadline_s: float, max_refusals: int) -> None:
        """From now on (the hub's clock) the connection is closed when it holds no subscription for
        ``deadline_s``, or at its ``max_refusals``-th refused message while it holds none
        (``Peer.hold_to``); the hub's watchdog looks at it."""
        self.peer.hold_to(self.hub.monotonic(), deadline_s, max_refusals)
        self.hub.watch(self)

    async def subscribe(
        self,
        task_id: str,
        cursor: int,
        epoch: str | None = None,
        streams: Mapping[str, int] | None = None,
    ) -> Subscription[Connection]:
        """Subscribe (replacing an earlier subscription to the same task) and queue the resume frame, from
        ``cursor`` of the history ``epoch`` (``None``: a bare version), then the chunks of ``streams`` from
        the offsets given.

        Raises ``UnknownTask`` or ``InvalidRequest`` (a bad cursor, too many subscriptions) with nothing
        left subscribed.
        """
        sub = self.hub.fanout.subscribe(self.peer, task_id)  # live entries collect from here on
        if streams:
            sub.streams = SubStreams(streams)  # and live chunks
        try:
            resume = await self.book.resume(task_id, cursor, epoch)
        except BaseException:
            self.hub.remove(sub)
            raise
        self.hub.resumed(sub, resume)
        self.signal()
        return sub

    async def subscribe_tag(
        self, tag: str, cursors: Mapping[str, int], limit: int, epochs: Mapping[str, str] | None = None
    ) -> TagSub[Connection]:
        """Subscribe to a tag (replacing an earlier subscription to it): list its tasks (at most ``limit``,
        newest first), read their resume states from ``cursors`` (of the histories in ``epochs``, where they
        name one) in one read, then queue the ``tag`` frame,
        their resume frames and the announcements of the tasks created meanwhile (``gateway.live.tagging``):
        two store reads, however many tasks.

        Raises ``InvalidRequest`` (too many subscriptions) or the store's error with nothing left of it."""
        hub = self.hub
        store = hub.tags
        assert store is not None, "the hub reads no tags"
        tag_sub = hub.subscribe_tag(self.peer, tag)  # news of creations with the tag is buffered from here on
        try:
            task_ids, more = await store.list(tag, limit)
            hub.tagging.listed(tag_sub, task_ids)  # their live entries collect from here on
            wanted = {task_id: cursors.get(task_id, NEW) for task_id in task_ids}
            resumes = await store.resume_many(wanted, epochs) if wanted and tag_sub.active else {}
            await self.control_room()  # the tag frame answers the message: it waits for room as any answer
        except BaseException:
            hub.drop_tag(tag_sub)
            raise
        if self.peer.control_full():  # closed while it waited
            hub.drop_tag(tag_sub)
        else:
            hub.tag_resumed(tag_sub, task_ids, more, resumes, cursors)
            self.signal()
        return tag_sub

    def unsubscribe(self, task_id: str) -> None:
        sub = self.peer.subscriptions.get(task_id)
        if sub is not None:
            self.hub.remove(sub)

    def unsubscribe_task(self, task_id: str) -> None:
        """The client's ``unsubscribe`` of a task: its own subscription ends, but a task one of its tags
        lists or announced goes on streaming there (:meth:`unsubscribe` ends whatever streams the task)."""
        self.hub.unsubscribe_task(self.peer, task_id)

    def unsubscribe_tag(self, tag: str) -> None:
        """End the subscription to ``tag`` and the streams it owns, if there is one."""
        tag_sub = self.peer.tags.get(tag)
        if tag_sub is not None:
            self.hub.drop_tag(tag_sub)

    def release(self) -> None:
        for tag_sub in tuple(self.peer.tags.values()):
            self.hub.drop_tag(tag_sub)
        for sub in tuple(self.peer.subscriptions.values()):
            self.hub.remove(sub)
        self.hub.detach(self)

    def send_control(self, frame: Frame) -> bool:
        """Queue a pong or an error frame after what is queued; ``False`` when ``max_control`` are queued
        already (then wait for :meth:`control_room`)."""
        if not self.peer.send_control(frame):
            return False
        self.signal()
        return True

    async def control_room(self) -> None:
        """Wait until a control frame can be queued (or the feed is closed). A client that sends faster
        than it reads its answers is read more slowly; one that stops reading is cut by the watchdog."""
        while self.peer.control_full() and self.peer.close_code is None and self.peer.closing is None:
            if self._room is None:
                self._room = asyncio.Event()
            self._room.clear()
            await self._room.wait()

    def close(self, code: int) -> None:
        self.peer.close(code)
        self.signal()
        if self._room is not None:
            self._room.set()

    def close_after(self, frame: Frame, code: int) -> None:
        """Close with ``code`` once ``frame`` and what is queued before it are sent."""
        self.peer.close_after(frame, code)
        self.signal()
        if self._room is not None:
            self._room.set()

    def close_idle(self) -> None:
        """It held no subscription for its deadline: say so, and close (``4408``)."""
        deadline = self.peer.deadline_s
        message = (
            f"this socket held no subscription for {deadline:g} s (GATEWAY_WS_AUTH_DEADLINE_S); "
            "subscribe with a task's subscribe token on a new socket"
        )
        self.close_after(error_frame("request-timeout", message), CLOSE_NO_SUBSCRIPTION)

    def finished(self, sub: Subscription[Connection]) -> None:
        """``sub``'s terminal entry was written to the socket directly (the hub's fast path): the endpoint's
        ``on_finished`` ends the connection (the single-task socket closes), or else the subscription ends,
        as after a terminal frame its writer sent."""
        if self.on_finished is not None:
            self.on_finished()
        elif self.peer.subscriptions.get(sub.task_id) is sub:
            self.unsubscribe(sub.task_id)

    def stall(self) -> None:
        """The watchdog closed the connection (``4008``): cancel its stuck send."""
        self.writer = None
        self.close(CLOSE_SLOW_CONSUMER)  # the peer's decision already; the first code stays
        if self.on_stall is not None:
            self.on_stall()

    def signal(self) -> None:
        """There is work for the writer."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.on_work is not None:
            self.on_work()

    def has_work(self) -> bool:
        """Whether :meth:`next` would return at once (a frame to send, or the end)."""
        return self.peer.has_work()

    async def next(self) -> tuple[Subscription[Connection] | None, Frame] | None:
        """The next frame to send (with its subscription), or ``None`` once the feed is closed."""
        peer = self.peer
        while True:
            step = peer.next()
            if step is None:
                if peer.close_code is not None:
                    return None
                self._waiter = asyncio.get_running_loop().create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            elif isinstance(step, tuple):
                if step[0] is None and self._room is not None:
                    self._room.set()  # a control frame left: room for the reader's next answer
                return step
            else:
                await self._read(step)

    async def _read(self, read: PeerRead) -> None:
        try:
            if isinstance(read, NeedTask):
                self.peer.task_read(read, await self.book.get(read.task_id))
            elif isinstance(read, NeedEntries):
                entries = await self.book.entries_between(read.task_id, read.after, read.upto)
                self.peer.entries_read(read, entries)
            else:
                store = self.hub.streams
                assert store is not None, "the hub reads no streams"
                if isinstance(read, NeedStream):
                    asked = read.read
                    task_id, name, offset = read.task_id, asked.stream, asked.offset
                    _, page = await store.page(task_id, name, offset, None, MAX_PAGE_CHUNKS, CATCH_UP_BYTES)
                    chunks = page.chunks  # decoded once, in one call; its size known from the batches
                    self.peer.stream_read(read, page.attempt, page.offset, chunks, page.more, page.size)
                else:
                    offsets = await store.next_offsets([read.task_id])
                    self.peer.finals_read(read, offsets.get(read.task_id, {}))
        except BaseException:
            self.peer.read_failed(read)
            raise
