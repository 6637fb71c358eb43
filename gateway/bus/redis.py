"""The Redis bus: pub/sub carries news of commits between gateway processes, the store fills what it drops.

Redis pub/sub is fire-and-forget: a message published while a listener is reconnecting, or not published
at all because Redis was down when the entry committed, is gone. That is allowed here because a message is
only a wake-up: the hub resyncs from the store after every (re)subscribe and checks the store now and then
(``Hub.reconcile``), so a lost message delays an entry by at most that period. Publishing happens after
the commit, from a bounded queue drained by one task (a pipeline per batch), so a callback never waits for
Redis and a Redis outage costs a bounded amount of memory.

Pub/sub channels span a whole Redis server (the database number of the URL does not separate them), so each
deployment publishes on a channel of its own, named for the id its database keeps
(``deployment_channel``): another deployment on the same Redis never hears its entries, nor it theirs.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from collections.abc import Sequence

import anyio
from anyio.abc import TaskStatus
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.bus.base import News, OnNews, OnResync, deployment_channel
from gateway.errors import one_line
from gateway.store.base import WriteTx

log = logging.getLogger("gateway.bus")

# How the bus's connections show in Redis' CLIENT LIST: this, then ":" and the channel (each deployment's
# connections apart from the others').
CLIENT_NAME = "task-gateway-bus"
# Messages waiting to be published; past this the oldest are dropped (the store covers them).
MAX_OUTGOING = 10_000
# A subscription that lasted this long was healthy: the next reconnect starts from a short pause.
STABLE_S = 10.0


def client_name(channel: str) -> str:
    """The name of the bus's connections on ``channel`` (Redis' ``CLIENT SETNAME``)."""
    return f"{CLIENT_NAME}:{channel}"


class RedisBus:
    shared = True

    def __init__(
        self,
        url: str,
        channel: str | None = None,
        *,
        keepalive_s: float = 5.0,
        backoff_max_s: float = 5.0,
    ) -> None:
        self.url = url
        # GATEWAY_BUS_CHANNEL, or the deployment's own once join() has named it.
        self.channel = channel
        self.keepalive_s = keepalive_s
        self.backoff_max_s = backoff_max_s
        self.connected = False
        self.reconnects = 0
        self.dropped = 0
        self._on_news: OnNews | None = None
        self._outgoing: deque[str] = deque()
        self._wakeup = anyio.Event()

    def join(self, deployment_id: str) -> None:
        if self.channel is None:
            self.channel = deployment_channel(deployment_id)

    async def run(self, on_news: OnNews, on_resync: OnResync, *, task_status: TaskStatus[None]) -> None:
        channel = self.channel
        if channel is None:
            raise RuntimeError("RedisBus.run() before join(): no channel to publish on")
        self._on_news = on_news
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._publisher, channel)
                await tg.start(self._listener, channel, on_resync)
                task_status.started()
        finally:
            self._on_news = None

    async def announce(self, tx: WriteTx, news: Sequence[News]) -> None:
        pass

    def publish(self, news: News) -> None:
        if self._on_news is None:
            return
        self._on_news(news)
        if len(self._outgoing) >= MAX_OUTGOING:
            self._outgoing.popleft()
            self.dropped += 1
        self._outgoing.append(news.encode())
        self._wakeup.set()

    async def _publisher(self, channel: str) -> None:
        delay = 0.1
        client = Redis.from_url(
            self.url,
            socket_timeout=self.keepalive_s,
            socket_connect_timeout=5,
            client_name=client_name(channel),
        )
        try:
            while True:
                if not self._outgoing:
                    self._wakeup = anyio.Event()
                    await self._wakeup.wait()
                batch, self._outgoing = self._outgoing, deque()
                try:
                    async with client.pipeline(transaction=False) as pipe:
                        for text in batch:
                            pipe.publish(channel, text)
                        await pipe.execute()
                except (RedisError, OSError) as exc:
                    # Dropped: other processes see these entries at their next check of the store.
                    self.dropped += len(batch)
                    log.warning("bus: cannot publish to Redis (%s); retrying in %.1fs", one_line(exc), delay)
                    await anyio.sleep(delay * random.uniform(0.5, 1.0))
                    delay = min(delay * 2, self.backoff_max_s)
                    continue
                delay = 0.1
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                await client.aclose()

    async def _listener(self, channel: str, on_resync: OnResync, *, task_status: TaskStatus[None]) -> None:
        started = False
        delay = 0.1
        while True:
            subscribed_at: float | None = None
            client = Redis.from_url(
                self.url, socket_timeout=None, socket_connect_timeout=5, client_name=client_name(channel)
            )
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                self.connected = True
                self.reconnects += 1
                on_resync()  # whatever was published while nobody listened is read from the store
                if not started:
                    task_status.started()
                    started = True
                subscribed_at = last_ping = anyio.current_time()
                while True:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None and message.get("type") == "message":
                        self._heard(message["data"])
                    elif anyio.current_time() - last_ping >= self.keepalive_s:
                        with anyio.fail_after(self.keepalive_s):
                            await pubsub.ping()
                        last_ping = anyio.current_time()
            except Exception as exc:  # any failure of the connection: listen again, after a pause
                if not started:  # the gateway starts anyway; the store check covers the outage
                    task_status.started()
                    started = True
                log.warning("bus: cannot listen on Redis (%s); retrying in %.1fs", one_line(exc), delay)
            finally:
                self.connected = False
                with anyio.CancelScope(shield=True), anyio.move_on_after(1):
                    await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # typed in some redis releases
                    await client.aclose()
            # A subscription that stayed up a while resets the backoff; one that fails at once backs off.
            if subscribed_at is not None and anyio.current_time() - subscribed_at >= STABLE_S:
                delay = 0.1
            await anyio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self.backoff_max_s)

    def _heard(self, data: bytes | str) -> None:
        if self._on_news is None:
            return
        try:
            news = News.decode(data)
        except ValueError:
            log.warning("bus: ignored a message that is not the gateway's on channel %s", self.channel)
            return
        self._on_news(news)
