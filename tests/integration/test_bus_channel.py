"""Each deployment has a bus channel of its own.

Redis pub/sub spans a whole Redis server (the database number of ``GATEWAY_BUS_URL`` does not separate
channels), so two deployments on one Redis, or two test runs on one machine, would hear each other's
entries on one fixed channel, and a hub pushes a bus frame as it came: a subscriber of task ``t1`` would
be sent the other deployment's ``t1`` at the same version. A deployment is a database: the first gateway
that starts on it makes a random id kept there (``gateway.store.deployment``), and its channel is named
for that id, unless ``GATEWAY_BUS_CHANNEL`` names one. What is asserted:

- two deployments sharing one broker, each with a subscriber of a task of the same id, never hear each
  other: each subscriber gets exactly its own deployment's entries, and each channel carries only its
  deployment's messages;
- processes started together on one new database make one id between them and share its channel (said
  in their start-up lines), over which their entries travel; a restarted one keeps it;
- a configured channel is the one every bus uses, Redis and PostgreSQL alike.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import asyncpg  # type: ignore[import-untyped]  # no stubs, no py.typed (as in gateway/store/database.py)
import pytest
from redis.asyncio import Redis

from gateway.bus import bus_for, deployment_channel
from gateway.bus.base import News
from gateway.bus.memory import MemoryBus
from gateway.bus.redis import RedisBus
from tests.integration.test_bus_conformance import REDIS_URL, WITHIN_S, redis_or_skip, watched_run
from tests.integration.test_live_support import (
    create_task,
    get_task,
    live_gateway,
    loads,
    post_event,
    recv_frame,
    socket,
    ws_url,
)
from tests.support import Running, http_client, postgres_database, wait_until
from tests.support.processes import gateway_processes

pytestmark = pytest.mark.anyio

# The task both deployments have.
TASK_ID = "t1"
BUS_LINE = re.compile(r"INFO: +gateway: bus Redis (\S+), channel (\S+)\n")
# Said once the server listens, after uvicorn's "Uvicorn running on" (which ``serving()`` waits for).
SAID_BUS = re.compile(BUS_LINE.pattern.encode())


@pytest.fixture(params=["redis", "memory"])
async def shared_bus(request: pytest.FixtureRequest) -> str:
    """One broker for both deployments: this machine's Redis, or the in-memory twin's broker."""
    if request.param == "redis":
        await redis_or_skip()
        return REDIS_URL
    return f"memory://shared-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


@pytest.fixture
def two_databases() -> Iterator[tuple[str, str]]:
    # Both are copies of one migrated template: the id is made at the first start, not inherited.
    with postgres_database() as first, postgres_database() as second:
        yield first, second


async def stored_id(database_url: str) -> list[str]:
    """The deployment ids the database holds (one, once a gateway has started on it)."""
    conn = await asyncpg.connect(database_url, timeout=5)
    try:
        return [row[0] for row in await conn.fetch("SELECT value FROM deployment WHERE name = 'id'")]
    finally:
        await conn.close()


def channel_of(gw: Running) -> str:
    bus = gw.gateway.bus
    assert isinstance(bus, RedisBus | MemoryBus), bus
    assert bus.channel is not None
    return bus.channel


@asynccontextmanager
async def listening(bus_url: str, database_url: str, channel: str) -> AsyncIterator[list[News]]:
    """What a third party subscribed to ``channel`` of the broker hears, in order."""
    heard: list[News] = []
    listener = bus_for(bus_url, database_url, channel)
    async with anyio.create_task_group() as tg:
        await tg.start(listener.run, heard.append, lambda: None)
        yield heard
        tg.cancel_scope.cancel()


async def heard_version(heard: list[News], version: int, what: str) -> None:
    await wait_until(
        lambda: any(news.version == version for news in heard),
        lambda: f"{what}: version {version} on its channel (heard {[n.version for n in heard]})",
        within_s=WITHIN_S,
    )


class Watcher:
    """A subscriber of ``TASK_ID`` on one gateway, from version 0 to the task's end: every frame it got."""

    def __init__(self, gw: Running, token: str) -> None:
        self.gw = gw
        self.token = token
        self.frames: list[dict[str, Any]] = []
        self.opened = anyio.Event()
        self.close_code: int | None = None

    async def run(self) -> None:
        async with socket(ws_url(self.gw, f"/v1/tasks/{TASK_ID}/ws", cursor=0, token=self.token)) as ws:
            self.frames.append(await recv_frame(ws))
            self.opened.set()
            with anyio.fail_after(WITHIN_S):
                async for raw in ws:
                    self.frames.append(loads(raw))
            self.close_code = ws.close_code

    def events(self) -> list[dict[str, Any]]:
        return [frame for frame in self.frames if frame["type"] == "event"]


async def history(gw: Running) -> list[dict[str, Any]]:
    """The task's whole history as the gateway stored it: ``{version, event}`` of each entry."""
    answer = await gw.client.get(f"/v1/tasks/{TASK_ID}/events", params={"cursor": 0})
    assert answer.status_code == 200, answer.text
    return list(answer.json()["events"])


def as_stored(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"version": frame["version"], "event": frame["event"]} for frame in frames]


@pytest.mark.postgres
async def test_two_deployments_on_one_broker_never_hear_each_other(
    shared_bus: str, two_databases: tuple[str, str]
) -> None:
    """Deployment A's task ``t1`` runs ahead (versions 1 to 5) before deployment B's ``t1`` runs its whole
    life (versions 1 to 3): on one channel B's subscriber would be sent A's entries as its own. Each
    subscriber gets exactly its own deployment's entries, and each channel carries only its own."""
    url_a, url_b = two_databases
    async with AsyncExitStack() as stack:
        a = await stack.enter_async_context(live_gateway(url_a, bus_url=shared_bus))
        b = await stack.enter_async_context(live_gateway(url_b, bus_url=shared_bus))
        # Each database made an id of its own at the first start; each channel is named for it.
        ids_a, ids_b = await stored_id(url_a), await stored_id(url_b)
        assert len(ids_a) == len(ids_b) == 1 and ids_a != ids_b, (ids_a, ids_b)
        assert channel_of(a) == deployment_channel(ids_a[0])
        assert channel_of(b) == deployment_channel(ids_b[0])
        on_a = await stack.enter_async_context(listening(shared_bus, url_a, channel_of(a)))
        on_b = await stack.enter_async_context(listening(shared_bus, url_b, channel_of(b)))

        made_a, made_b = await create_task(a, TASK_ID), await create_task(b, TASK_ID)
        watch_a = Watcher(a, made_a["subscribeToken"])
        watch_b = Watcher(b, made_b["subscribeToken"])
        async with anyio.create_task_group() as tg:
            for watcher in (watch_a, watch_b):
                tg.start_soon(watcher.run)
                with anyio.fail_after(WITHIN_S):
                    await watcher.opened.wait()
            token_a, token_b = made_a["callbackToken"], made_b["callbackToken"]
            await post_event(a, TASK_ID, token_a, {"type": "start", "worker": "worker-of-a"})
            for progress in (10, 20, 30, 40):
                await post_event(
                    a, TASK_ID, token_a, {"type": "progress", "progress": progress, "cursor": f"a{progress}"}
                )
            # A's entries are on the broker: on a shared channel B would have been sent them by now.
            await heard_version(on_a, 5, "deployment A's entries")

            await post_event(b, TASK_ID, token_b, {"type": "start", "worker": "worker-of-b"})
            await post_event(b, TASK_ID, token_b, {"type": "progress", "progress": 50, "cursor": "b50"})
            await post_event(b, TASK_ID, token_b, {"type": "succeed", "resultRef": "b", "resultHash": "h"})
            await heard_version(on_b, 3, "deployment B's entries")
            # Published after all of B's: on A's channel, B's would have come before it.
            await post_event(a, TASK_ID, token_a, {"type": "succeed", "resultRef": "a", "resultHash": "h"})
            await heard_version(on_a, 6, "deployment A's last entry")

        for gw, watcher, versions in ((a, watch_a, 6), (b, watch_b, 3)):
            stored = await history(gw)
            assert [entry["version"] for entry in stored] == list(range(1, versions + 1))
            assert watcher.frames[0]["type"] == "caught-up" and watcher.frames[0]["version"] == 0
            assert as_stored(watcher.events()) == stored, (gw.url, watcher.frames)
            assert watcher.frames[-1]["task"] == await get_task(gw, TASK_ID)
            assert watcher.close_code == 1000
        # Each channel carried its own deployment's entries, in order, and nothing else.
        assert [as_frame(news) for news in on_a] == watch_a.events()
        assert [as_frame(news) for news in on_b] == watch_b.events()


async def test_a_deployment_keeps_its_channel_across_restarts(database_url: str) -> None:
    """The id is made once: a process restarted still shares the channel of the processes that were not."""
    await redis_or_skip()
    channels = []
    for _ in range(2):
        async with live_gateway(database_url, bus_url=REDIS_URL) as gw:
            channels.append(channel_of(gw))
    assert channels[0] == channels[1] and channels[0].startswith("task_gateway:"), channels


def as_frame(news: News) -> dict[str, Any] | None:
    return None if news.frame is None else loads(news.frame.text)


@pytest.mark.postgres
async def test_processes_started_together_on_a_new_database_share_its_channel(
    pg_url: str, tmp_path: Path
) -> None:
    """Two ``gateway serve`` processes start at once on a database no gateway has served: one id is made
    between them, both say they use its channel, and an entry committed by one reaches a subscriber of
    the other over it (their periodic check of the store is too rare to bring it within the test)."""
    await redis_or_skip()
    env = {"GATEWAY_BUS_URL": REDIS_URL, "GATEWAY_RECONCILE_INTERVAL_MS": "600000"}
    async with gateway_processes(2, pg_url, tmp_path, env=env) as (first, second):
        (made,) = await stored_id(pg_url)
        for gw in (first, second):
            await gw.wait_for(SAID_BUS)
            said = BUS_LINE.findall(gw.output())
            assert said == [("127.0.0.1:6379/0", deployment_channel(made))], gw.output()
        async with http_client(timeout=10) as client:
            answer = await client.post(
                f"{first.url}/v1/tasks", json={"id": TASK_ID, "ttlMs": 60_000, "maxAttempts": 1}
            )
            assert answer.status_code == 201, answer.text
            created = answer.json()
            subscribe = f"{second.ws_url}/v1/tasks/{TASK_ID}/ws?cursor=0&token={created['subscribeToken']}"
            async with socket(subscribe) as ws:
                assert (await recv_frame(ws))["type"] == "caught-up"
                answer = await client.post(
                    f"{first.url}/v1/tasks/{TASK_ID}/callbacks",
                    json={"event": {"type": "start", "worker": "w1"}},
                    headers={"Authorization": f"Bearer {created['callbackToken']}"},
                )
                assert answer.status_code == 200, answer.text
                frame = await recv_frame(ws, within_s=WITHIN_S)
                assert frame["type"] == "event" and frame["version"] == 1, frame
                assert frame["event"]["worker"] == "w1", frame


@pytest.mark.postgres
@pytest.mark.parametrize("kind", ["postgres", "redis"])
async def test_a_configured_channel_is_the_one_the_bus_uses(kind: str, pg_url: str) -> None:
    """``GATEWAY_BUS_CHANNEL`` overrides the deployment's channel, on Redis and on PostgreSQL: both
    processes use it, and an entry travels over it (their periodic check of the store is too rare)."""
    channel = f"gateway_test.{uuid.uuid4().hex[:12]}"  # this run's own
    bus_url = None
    if kind == "redis":
        await redis_or_skip()
        bus_url = REDIS_URL
    async with AsyncExitStack() as stack:
        pair = [
            await stack.enter_async_context(
                live_gateway(pg_url, bus_url=bus_url, bus_channel=channel, reconcile_interval_ms=600_000)
            )
            for _ in range(2)
        ]
        for gw in pair:
            assert getattr(gw.gateway.bus, "channel", None) == channel
        if kind == "redis":
            client = Redis.from_url(REDIS_URL)
            try:
                assert await client.pubsub_numsub(channel) == [(channel.encode(), 2)]
            finally:
                await client.aclose()
        await watched_run(pair[0], pair[1], "configured")
