"""The LISTEN/NOTIFY bus: PostgreSQL itself carries news of commits between gateway processes.

``announce`` runs ``pg_notify`` inside the committing transaction, so a message is sent if and only if its
entry commits, in commit order. Each process keeps one listening connection (asyncpg, outside the pool),
checks it every ``keepalive_s`` and reconnects with backoff when it fails; after each (re)connect the hub
resyncs from the store, which covers whatever was committed while nobody listened.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Sequence

import anyio
import asyncpg  # type: ignore[import-untyped]
from anyio.abc import TaskStatus

from gateway.bus.base import DEFAULT_CHANNEL, News, OnNews, OnResync
from gateway.errors import one_line
from gateway.store.base import WriteTx

log = logging.getLogger("gateway.bus")

# How the listening connection shows in pg_stat_activity.
APPLICATION_NAME = "task-gateway-bus"
# A listening connection that lasted this long was healthy: the next reconnect starts from a short pause.
STABLE_S = 10.0


class PostgresBus:
    shared = True

    def __init__(
        self,
        dsn: str,
        channel: str | None = None,
        *,
        keepalive_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        backoff_max_s: float = 5.0,
    ) -> None:
        self.dsn = dsn
        self.channel = channel or DEFAULT_CHANNEL
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self.backoff_max_s = backoff_max_s
        self._on_news: OnNews | None = None
        self.connected = False
        self.reconnects = 0
        self.heard = 0  # messages the listener heard (for metrics)

    def join(self, deployment_id: str) -> None:
        pass  # LISTEN/NOTIFY is per database: the channel is the deployment's already

    async def run(self, on_news: OnNews, on_resync: OnResync, *, task_status: TaskStatus[None]) -> None:
        self._on_news = on_news
        started = False
        delay = 0.1

        def listening() -> None:
            nonlocal started
            if not started:
                started = True
                task_status.started()

        try:
            while True:
                listened_since = None
                try:
                    conn = await asyncpg.connect(
                        self.dsn,
                        timeout=self.connect_timeout_s,
                        server_settings={"application_name": APPLICATION_NAME},
                    )
                    try:
                        listened_since = anyio.current_time()
                        await self._listen(conn, on_resync, listening)
                    finally:
                        self.connected = False
                        conn.terminate()
                except Exception as exc:  # any failure of the connection: listen again, after a pause
                    log.warning(
                        "bus: cannot listen on PostgreSQL (%s); retrying in %.1fs", one_line(exc), delay
                    )
                listening()  # the gateway starts anyway: the store answers 503 until it is back
                # A connection that stayed up a while resets the backoff; one that keeps failing at once
                # (accepted, then dropped) backs off like one that cannot connect.
                if listened_since is not None and anyio.current_time() - listened_since >= STABLE_S:
                    delay = 0.1
                await anyio.sleep(delay * random.uniform(0.5, 1.0))
                delay = min(delay * 2, self.backoff_max_s)
        finally:
            self._on_news = None

    async def _listen(
        self, conn: asyncpg.Connection, on_resync: OnResync, listening: Callable[[], None]
    ) -> None:
        lost = anyio.Event()
        conn.add_termination_listener(lambda _conn: lost.set())
        await conn.add_listener(self.channel, self._heard)
        self.connected = True
        if self.reconnects:
            log.info("bus: listening on PostgreSQL again; catching up from the store")
        self.reconnects += 1
        on_resync()  # whatever was committed before LISTEN took effect is read from the store
        listening()
        while not lost.is_set():
            with anyio.move_on_after(self.keepalive_s):
                await lost.wait()
            if lost.is_set():
                break
            with anyio.fail_after(self.keepalive_s):
                await conn.execute("SELECT 1")
        raise ConnectionError("the listening connection was closed")

    def _heard(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        self.heard += 1
        if self._on_news is None:
            return
        try:
            news = News.decode(payload)
        except ValueError:
            log.warning("bus: ignored a message that is not the gateway's on channel %s", self.channel)
            return
        self._on_news(news)

    async def announce(self, tx: WriteTx, news: Sequence[News]) -> None:
        await tx.notify(self.channel, [n.encode() for n in news])

    def publish(self, news: News) -> None:
        if self._on_news is not None:
            self._on_news(news)
