"""The composition root: :class:`Gateway` builds the store, bus, book, hub, committer and background jobs
from the settings, and :meth:`Gateway.running` (entered by the app's lifespan) opens and closes them all.

It knows nothing of HTTP: ``gateway.web.app`` puts the routes on top of it.
"""

from __future__ import annotations

import inspect
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
from anyio.abc import TaskGroup, TaskStatus

from gateway.book.book import Book, Listeners
from gateway.book.committer import Committer
from gateway.book.metadata import MetadataBook
from gateway.book.stream_reads import StreamReads
from gateway.book.tag_reads import TagReads
from gateway.bus import Bus, bus_for
from gateway.jobs.demo import run_demo_worker
from gateway.jobs.relay import Relay
from gateway.jobs.retention import Retention
from gateway.jobs.sweeper import Sweeper
from gateway.jobs.sweeper_thread import SweeperThread
from gateway.live.hub import Hub
from gateway.metrics import Metrics
from gateway.secret_file import with_secret
from gateway.settings import Settings
from gateway.store import Database
from gateway.store.database import COMMITS_IN_FLIGHT as COMMITS_IN_FLIGHT
from gateway.store.deployment import deployment_id
from gateway.store.sql import SqlStore
from gateway.tokens import Tokens

log = logging.getLogger("gateway")

Clock = Callable[[], int]
MAX_DEMO_WORKERS = 50


def commits_in_flight(workers: int) -> int:
    """Batches one of ``workers`` processes commits at once on PostgreSQL."""
    return max(1, COMMITS_IN_FLIGHT // workers)


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class Gateway:
    """Everything a running gateway holds; built by ``create_app``, opened and closed by its lifespan."""

    def __init__(self, settings: Settings, clock: Clock) -> None:
        self.settings = settings
        self.clock = clock
        self.metrics = Metrics()
        self.db = Database(settings.database_url)
        self.store = SqlStore(self.db)
        self.bus: Bus = bus_for(settings.bus_url, settings.database_url, settings.bus_channel)
        # Who hears of the book's commits: filled below, once, by what this gateway runs.
        listeners = Listeners()
        self.book = Book(
            self.store,
            clock,
            bus=self.bus,
            retention_versions=settings.retention_versions,
            max_history_versions=settings.max_history_versions,
            listeners=listeners,
            deadline_s=settings.db_deadline_ms / 1000,
            stream_max_bytes=settings.stream_max_bytes,
        )
        # Streams' reads (their totals, a page, a text), beside the book.
        self.stream_reads = StreamReads(self.store, deadline_s=settings.db_deadline_ms / 1000)
        # Tags' reads (a tag's tasks, many resumes in one query), beside the book.
        self.tag_reads = TagReads(
            self.store, settings.retention_versions, deadline_s=settings.db_deadline_ms / 1000
        )
        # Tag subscriptions compare creation times, stamped by the book's clock, with their own.
        # Metadata patches, and the reads of the state beside the history the hub makes good from.
        self.metadata = MetadataBook(self.book)
        self.hub = Hub(
            self.book, tags=self.tag_reads, wall=clock, streams=self.stream_reads, besides=self.metadata
        )
        # On PostgreSQL several batches commit at once, each on a connection of the pool.
        self.committer = Committer(
            self.book, concurrency=1 if self.db.is_sqlite else commits_in_flight(settings.workers)
        )
        self.hub.callbacks_waiting = self.committer.busy
        self.metrics.watch_committer(self.committer)
        self.relay = Relay.from_settings(self.store, settings, self.metrics)
        if self.relay is not None:
            listeners.notifications.append(self.relay.wake)
        self.sweeper: Sweeper | SweeperThread | None = None
        if settings.sweep_interval_ms > 0:
            interval_s = settings.sweep_interval_ms / 1000
            if self.db.is_sqlite:  # a file only this process writes: it makes every deadline
                self.sweeper = Sweeper(self.book, interval_s, self.metrics, solo=True)
                listeners.expired.append(self.sweeper.expired)
                listeners.leases_ended.append(self.sweeper.leases_ended)
            else:  # off the event loop (gateway.jobs.sweeper_thread), its expiries told there
                self.sweeper = SweeperThread(self.book, settings.database_url, interval_s, self.metrics)
            listeners.deadline.append(self.sweeper.deadline)
        # Finished tasks deleted once their time is up and their notification was taken (a relayed one
        # counts where a relay sends them).
        self.retention: Retention | None = None
        if settings.retain_finished_s > 0:
            relay = self.relay is not None
            self.retention = Retention(
                self.store,
                clock,
                settings.retain_finished_s,
                relay=relay,
                metrics=self.metrics,
                db_deadline_s=self.book.deadline_s,
            )
        self.metrics.watch_hub(self.hub.stats)
        self.metrics.watch_bus(self.bus)
        settings = self.settings = with_secret(settings)
        if settings.secret is not None:
            secret = settings.secret.get_secret_value()
        else:
            secret = secrets.token_urlsafe(32)
            log.warning(
                "GATEWAY_SECRET is not set: tokens are signed with a random secret made at start; they "
                "stop working when this process restarts and no other process accepts them (a SQLite "
                "gateway keeps its secret beside the file; on PostgreSQL set GATEWAY_SECRET)"
            )
        self.tokens = Tokens(secret, grace_s=settings.token_grace_s)
        self.demo_workers = 0
        # Set when a background part failed for good (see _essential); on_fatal asks the server to stop.
        self.fatal: BaseException | None = None
        # Why this process could not start, in one line, when it said so itself (the database unreachable,
        # a setting): the server then logs no traceback of its own (gateway.server.serve).
        self.startup_failure: str | None = None
        self.on_fatal: Callable[[], None] | None = None
        # The ASGI app built on top (``gateway.web.app``): demo workers post to it in process.
        self.app: Any = None
        self._background: TaskGroup | None = None

    def can_spawn_demo(self) -> bool:
        return self._background is not None and self.demo_workers < MAX_DEMO_WORKERS

    def spawn_demo(self, task_id: str, callback_token: str) -> None:
        """Start a simulated worker for a demo task. It posts to this app's public callback route in
        process (an ASGI transport): the same route, auth and checks as any worker, and no address that a
        request's Host header could point elsewhere."""
        assert self._background is not None and self.app is not None
        self.demo_workers += 1
        transport = httpx.ASGITransport(app=self.app)

        async def run() -> None:
            try:
                async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
                    await run_demo_worker(client, task_id, callback_token)
            except Exception:  # a demo must never take the sweeper and the watchdog down with it
                log.exception("demo worker for %s failed", task_id)
            finally:
                self.demo_workers -= 1

        self._background.start_soon(run)

    async def _essential(
        self,
        name: str,
        work: Callable[..., Awaitable[None]],
        *args: Any,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run a background part the gateway cannot serve without. Each handles the failures it expects
        (a database or bus outage) itself; one that still ends with an exception leaves a process that
        would answer but no longer push or expire, so the process stops instead (``fatal``, readiness
        fails, the server exits with an error) and its supervisor starts a whole one."""
        try:
            if "task_status" in inspect.signature(work).parameters:
                await work(*args, task_status=task_status)
            else:
                task_status.started()
                await work(*args)
        except Exception as exc:
            log.critical("%s failed; stopping this process so that it is restarted whole", name, exc_info=exc)
            self.fatal = exc
            if self.on_fatal is not None:
                self.on_fatal()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        self.settings.check_bind()
        await self.store.open()
        try:
            # The deployment's id, kept in its database: on Redis, its channel (unless one is configured).
            self.bus.join(await deployment_id(self.db.engine))
            # Every garbage collection of this process, while it serves, in gateway_gc_pause_seconds.
            with self.metrics.watching_gc():
                async with anyio.create_task_group() as tg:
                    self._background = tg
                    await tg.start(
                        self._essential, "the bus listener", self.bus.run, self.hub.receive, self.hub.resync
                    )
                    # On a bus shared with other processes a message can be lost: check the store now and
                    # then.
                    reconcile_s = self.settings.reconcile_interval_ms / 1000 if self.bus.shared else None
                    tg.start_soon(self._essential, "the hub's catch-up", self.hub.run, reconcile_s)
                    tg.start_soon(self._essential, "the group committer", self.committer.run)
                    tg.start_soon(
                        self._essential,
                        "the write watchdog",
                        self.hub.watch_writes,
                        self.settings.write_timeout_ms / 1000,
                    )
                    if self.sweeper is not None:
                        tg.start_soon(self._essential, "the sweeper", self.sweeper.run)
                    if self.relay is not None:
                        tg.start_soon(self._essential, "the webhook relay", self.relay.run)
                    if self.retention is not None:
                        tg.start_soon(self._essential, "retention", self.retention.run)
                    yield
                    self._background = None
                    tg.cancel_scope.cancel()
        finally:
            await self.store.close()
