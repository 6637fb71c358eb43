"""On PostgreSQL the sweeper runs on a thread of its own, with its own event loop and its own connections.

Why: under load the gateway's event loop is the bottleneck, not the database. With 20 busy workers and the
machine's cores busy, each statement sent from the event loop waited there 100-300 ms (one turn of a loop
that is fanning out callbacks per await), and an expiry pass makes about eight (begin, claim, three writes,
notify, commit, the next deadline): passes took 0.5-1.5 s and tasks expired more than 1 s late. The same
statement from a thread with a loop of its own answered in 1-5 ms. So the passes run there, on connections
reserved for them (they never wait behind the pool either); what a pass committed is handed to the event
loop to publish (this process's subscribers, the webhook relay's wake-up), and a task created on the event
loop hands its deadline to the thread.

SQLite keeps the sweeper on the event loop: its writes take turns on the in-process lock, where expiry
goes first (gateway.store.priority_lock), and it keeps its bound under the same load.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import anyio

from gateway.book.book import Book, Listeners
from gateway.bus.base import Bus, News, OnNews, OnResync
from gateway.jobs.sweeper import MAX_PASSES, Sweeper
from gateway.metrics import Metrics
from gateway.store.base import WriteTx
from gateway.store.database import Database
from gateway.store.sql import SqlStore


class _Forward:
    """The bus as the thread's book sees it: ``NOTIFY`` in the thread's transaction, and this process's
    listeners told on the event loop once it has committed."""

    def __init__(self, bus: Bus, loop: asyncio.AbstractEventLoop) -> None:
        self._bus = bus
        self._loop = loop
        self.shared = bus.shared
        self.connected = bus.connected
        self.reconnects = bus.reconnects

    def join(self, deployment_id: str) -> None:
        raise NotImplementedError("the event loop's bus has joined its deployment")

    async def run(self, on_news: OnNews, on_resync: OnResync, *, task_status: Any) -> None:
        raise NotImplementedError("the event loop's bus listens")

    async def announce(self, tx: WriteTx, news: Sequence[News]) -> None:
        await self._bus.announce(tx, news)

    def publish(self, news: News) -> None:
        self._loop.call_soon_threadsafe(self._bus.publish, news)


class SweeperThread:
    """The sweeper of ``book`` (the event loop's), on a thread, over a database engine of its own."""

    def __init__(self, book: Book, url: str, interval_s: float, metrics: Metrics | None) -> None:
        self.book = book
        self.url = url
        self.interval_s = interval_s
        self.metrics = metrics
        self._main: asyncio.AbstractEventLoop | None = None  # the event loop ``run`` is called on
        self._ended: asyncio.Future[None] | None = None
        self._lock = threading.Lock()  # guards the four below, shared by both threads
        self._loop: asyncio.AbstractEventLoop | None = None
        self._scope: anyio.CancelScope | None = None
        self._sweeper: Sweeper | None = None
        self._stopping = False

    async def run(self) -> None:
        """Until cancelled; then stop the thread and wait for it (its pass under way commits first)."""
        self._main = asyncio.get_running_loop()
        self._ended = self._main.create_future()
        threading.Thread(target=self._thread, name="gateway-sweeper", daemon=True).start()
        try:
            await asyncio.shield(self._ended)
        finally:
            with self._lock:
                self._stopping = True
                if self._loop is not None and self._scope is not None:
                    self._loop.call_soon_threadsafe(self._scope.cancel)
            with anyio.CancelScope(shield=True):
                await asyncio.wait([self._ended])

    def deadline(self, expires_at_ms: int) -> None:
        """A listener of the event loop's book: a new task's deadline, handed to the thread."""
        with self._lock:
            if self._loop is not None and self._sweeper is not None:
                self._loop.call_soon_threadsafe(self._sweeper.deadline, expires_at_ms)

    def _thread(self) -> None:
        assert self._main is not None and self._ended is not None
        try:
            anyio.run(self._sweep, backend="asyncio")
        except BaseException as exc:  # told to the event loop, whose task fails with it
            self._main.call_soon_threadsafe(_settle, self._ended, exc)
        else:
            self._main.call_soon_threadsafe(_settle, self._ended, None)

    async def _sweep(self) -> None:
        # Each overlapping pass (and its read of the next deadline) has a connection ready for it.
        db = Database(self.url, pool_size=MAX_PASSES, max_overflow=0, reads_at_once=MAX_PASSES)
        bus = self.book.bus
        assert self._main is not None
        # The thread's own book: its expiries' lateness goes to the metrics, its notifications wake the
        # event loop's book's listeners (the relay), on the event loop.
        listeners = Listeners(notifications=[self._notified])
        book = Book(
            SqlStore(db),
            self.book.clock,
            bus=None if bus is None else _Forward(bus, self._main),
            listeners=listeners,
            deadline_s=self.book.deadline_s,
        )
        sweeper = Sweeper(book, self.interval_s, self.metrics)
        listeners.expired.append(sweeper.expired)
        listeners.leases_ended.append(sweeper.leases_ended)
        try:
            with anyio.CancelScope() as scope:
                with self._lock:
                    self._loop, self._scope, self._sweeper = asyncio.get_running_loop(), scope, sweeper
                    if self._stopping:
                        scope.cancel()
                await sweeper.run()
        finally:
            with self._lock:
                self._loop = self._scope = self._sweeper = None
            with anyio.CancelScope(shield=True):
                await db.close()

    def _notified(self) -> None:
        """The thread's book wrote notifications: the event loop's book's listeners hear of it there."""
        assert self._main is not None
        self._main.call_soon_threadsafe(self.book.listeners.notified)


def _settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
