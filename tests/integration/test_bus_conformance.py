"""One conformance suite for every bus that links processes: LISTEN/NOTIFY, Redis pub/sub and the
in-memory twin.

Two gateways (each a whole app under its own uvicorn server, its own pool and its own bus listener) share
one PostgreSQL database, as two processes would: one deployment, so one bus channel, the database's own
(test_bus_channel.py: other deployments', and other test runs', are apart). What a subscriber of one must
see when callbacks are posted to the other: every entry, in order, with no gap, however the bus behaves: a
frame too big for a message, a listener whose connection is cut, a message that is lost. The local bus,
which links nothing, is checked for the one thing it promises: this process's subscribers. A task created
with a tag is news on the bus too: a subscriber of the tag on the other gateway hears of it, or, its news
lost, the periodic check finds it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from typing import Any

import anyio
import asyncpg  # type: ignore[import-untyped]  # no stubs, no py.typed (as in gateway/store/database.py)
import orjson
import pytest
from redis.asyncio import Redis

from gateway.bus.base import MAX_PAYLOAD_BYTES, News
from gateway.bus.memory import MemoryBus
from gateway.bus.postgres import APPLICATION_NAME
from gateway.bus.redis import RedisBus, client_name
from gateway.jobs.sweeper import sweep_once
from gateway.store.base import WriteTx
from tests.integration.test_live_support import (
    StreamCheck,
    TagWatch,
    create_task,
    get_task,
    live_gateway,
    post_event,
    read_to_close,
    recv_frame,
    socket,
    tag_subscribe,
    ws_url,
)
from tests.support import FakeClock, Running, bearer, postgres_database, wait_until
from tests.support.stream_text import StreamText

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

REDIS_URL = os.environ.get("GATEWAY_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
STEPS = 6
WITHIN_S = 15.0


@pytest.fixture
def pg_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


def bus_url(kind: str) -> str | None:
    # Unset on PostgreSQL means LISTEN/NOTIFY.
    return {"postgres": None, "redis": REDIS_URL, "memory": "memory://conformance"}[kind]


async def redis_or_skip() -> None:
    client = Redis.from_url(REDIS_URL, socket_connect_timeout=3)
    try:
        await client.ping()
    except OSError as exc:  # redis' ConnectionError is an OSError
        message = f"Redis is not reachable at {REDIS_URL} ({exc}); start it to run this test"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI must run every Redis test)")
        pytest.skip(message)
    finally:
        await client.aclose()


@pytest.fixture(params=["postgres", "redis", "memory"])
async def pair(request: pytest.FixtureRequest, pg_url: str) -> AsyncIterator[tuple[Running, Running]]:
    """Two gateways on one database, on the bus of the test's parameter; the second checks the store for
    lost messages every 300 ms."""
    if request.param == "redis":
        await redis_or_skip()
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(live_gateway(pg_url, bus_url=bus_url(request.param)))
        second = await stack.enter_async_context(
            live_gateway(pg_url, bus_url=bus_url(request.param), reconcile_interval_ms=300)
        )
        yield first, second


async def watch_to_end(gw: Running, task_id: str, token: str, opened: anyio.Event) -> StreamCheck:
    check = StreamCheck(task_id, 0)
    async with socket(ws_url(gw, f"/v1/tasks/{task_id}/ws", cursor=0, token=token)) as ws:
        check.feed(await recv_frame(ws))
        opened.set()
        with anyio.fail_after(WITHIN_S):
            assert await read_to_close(ws, check) == 1000
    return check


async def watched_run(
    writer: Running, reader: Running, task_id: str, during: Any = None, **drive_args: Any
) -> StreamCheck:
    """Subscribe on ``reader``, then post a task's whole life to ``writer`` (calling ``during(step)`` before
    each progress step); returns the subscriber's checked stream, which must end at the stored task."""
    created = await create_task(writer, task_id)
    opened = anyio.Event()
    checks: list[StreamCheck] = []

    async def subscriber() -> None:
        checks.append(await watch_to_end(reader, task_id, created["subscribeToken"], opened))

    async with anyio.create_task_group() as tg:
        tg.start_soon(subscriber)
        with anyio.fail_after(WITHIN_S):
            await opened.wait()
        token = created["callbackToken"]
        await post_event(writer, task_id, token, {"type": "start", "worker": "w1"})
        for step in range(1, STEPS + 1):
            if during is not None:
                await during(step)
            await post_event(
                writer, task_id, token, {"type": "progress", "progress": step, "cursor": f"c{step}"}
            )
        result_ref = drive_args.get("result_ref", "s3://r")
        await post_event(
            writer, task_id, token, {"type": "succeed", "resultRef": result_ref, "resultHash": "sha256:1"}
        )
    (check,) = checks
    check.assert_final(await get_task(reader, task_id))
    assert check.event_versions == list(range(1, STEPS + 3))
    return check


async def test_entries_reach_the_subscribers_of_another_process(pair: tuple[Running, Running]) -> None:
    first, second = pair
    await watched_run(first, second, "across")
    await watched_run(second, first, "back")


async def test_a_frame_too_big_for_a_message_comes_from_the_store(pair: tuple[Running, Running]) -> None:
    """PostgreSQL refuses NOTIFY payloads of 8000 bytes: such an entry travels as id and version, and the
    other process reads it from the store (its subscriber sees the exact frame all the same)."""
    big = "s3://bucket/" + "x" * (MAX_PAYLOAD_BYTES + 100)
    first, second = pair
    await watched_run(first, second, "big", result_ref=big)
    final = await get_task(second, "big")
    assert final["resultRef"] == big


async def test_a_listener_cut_off_catches_up_from_the_store(
    pair: tuple[Running, Running], pg_url: str
) -> None:
    """The second gateway's bus connection is killed mid-run (a network blip, a failover): it reconnects by
    itself and reads from the store what was committed meanwhile; its subscriber sees no gap."""
    first, second = pair
    bus = second.gateway.bus
    connections_before = bus.reconnects

    async def cut(step: int) -> None:
        kind = bus_url_of(second)
        if kind is not None and kind.startswith("memory://"):
            # The twin loses what is sent while it is disconnected and reconnects when told.
            assert isinstance(bus, MemoryBus)
            if step == 1:
                bus.disconnect()
            elif step == STEPS:
                bus.reconnect()
            return
        if step != 1:
            return
        if kind is None:
            conn = await asyncpg.connect(pg_url, timeout=5)
            try:
                killed = await conn.fetchval(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                    "WHERE application_name = $1 AND datname = current_database()",
                    APPLICATION_NAME,
                )
            finally:
                await conn.close()
            assert killed == 2  # one listener per gateway
        else:
            # Only this pair's listeners (named for their channel): another deployment on this Redis, or
            # another test run, keeps its own.
            assert isinstance(bus, RedisBus) and bus.channel is not None
            client = Redis.from_url(REDIS_URL)
            try:
                ours = [
                    c["id"]
                    for c in await client.client_list(_type="pubsub")
                    if c["name"] == client_name(bus.channel)
                ]
                assert len(ours) == 2, ours  # one listener per gateway
                for client_id in ours:
                    assert await client.client_kill_filter(_id=client_id) == 1
            finally:
                await client.aclose()

    await watched_run(first, second, "cut", during=cut)
    # Its subscriber can have every entry from the periodic check of the store before the listener is back
    # (it reconnects after a backoff): wait for the reconnect itself.
    await wait_until(
        lambda: bus.connected and bus.reconnects > connections_before,
        lambda: (
            f"the second gateway's bus listening again (connected {bus.connected}, "
            f"{bus.reconnects} connects, {connections_before} before the cut)"
        ),
        within_s=WITHIN_S,
    )
    # Operators see it: the listener is connected again, and has connected more than once.
    metrics = (await second.client.get("/metrics")).text.splitlines()
    assert "gateway_bus_connected 1.0" in metrics, metrics
    connects = next(line for line in metrics if line.startswith("gateway_bus_connects "))
    assert float(connects.split()[1]) >= 2, connects


def bus_url_of(gw: Running) -> str | None:
    return gw.gateway.settings.bus_url


async def test_a_lost_message_is_found_by_the_periodic_check(pair: tuple[Running, Running]) -> None:
    """The messages of one entry are lost (Redis down at that moment, say): no later entry reveals the gap,
    so only the second gateway's periodic check of the store can find it, and its subscriber must get it."""
    first, second = pair
    bus = first.gateway.bus
    created = await create_task(first, "lost")
    opened = anyio.Event()
    checks: list[StreamCheck] = []

    async def subscriber() -> None:
        checks.append(await watch_to_end(second, "lost", created["subscribeToken"], opened))

    async with anyio.create_task_group() as tg:
        tg.start_soon(subscriber)
        with anyio.fail_after(WITHIN_S):
            await opened.wait()
        token = created["callbackToken"]
        await post_event(first, "lost", token, {"type": "start", "worker": "w1"})
        with lost_messages(bus) as dropped:
            await post_event(first, "lost", token, {"type": "progress", "progress": 1, "cursor": "c1"})
        assert {n.version for n in dropped} == {2}  # its announcement and its publish
        # The hub has no event for "caught up", so this polls its state (bounded), not a guessed time.
        await wait_until(
            lambda: handed_out(second, "lost", 2),
            "the lost entry (version 2) found by the second gateway's periodic check",
            within_s=WITHIN_S,
        )
        await post_event(first, "lost", token, {"type": "succeed", "resultRef": "r", "resultHash": "h"})
    (check,) = checks
    assert check.event_versions == [1, 2, 3]
    check.assert_final(await get_task(second, "lost"))


async def test_an_appends_lost_message_and_one_too_big_for_a_message_come_from_the_store(
    pair: tuple[Running, Running],
) -> None:
    """Chunks appended through the first gateway reach a subscriber of the second: a batch whose messages
    are lost (found by the periodic check of the streams' offsets, no later append revealing it) and one
    too big for a message (its message says only where the stream ends) included."""
    first, second = pair
    bus = first.gateway.bus
    created = await create_task(first, "chunks")
    token = created["callbackToken"]
    await post_event(first, "chunks", token, {"type": "start", "worker": "w1"})
    holder = StreamText("chunks", {"output": 0})

    async def append(seq: int, *chunks: str) -> None:
        body = {"attempt": 1, "seq": seq, "chunks": list(chunks)}
        answer = await first.client.post("/v1/tasks/chunks/streams/output", json=body, headers=bearer(token))
        assert answer.status_code == 200, answer.text

    query = {"cursor": 1, "token": created["subscribeToken"], "streams": "output"}
    async with socket(ws_url(second, "/v1/tasks/chunks/ws", **query)) as ws:

        async def until(offset: int) -> None:
            with anyio.fail_after(WITHIN_S):
                while holder.offsets["output"] < offset:
                    holder.feed(await recv_frame(ws))

        holder.feed(await recv_frame(ws))
        await append(0, "a")
        await until(1)
        with lost_messages(bus) as dropped:
            await append(1, "lost")
        assert dropped and all(n.run is not None for n in dropped)  # its announcement and its publish
        await until(2)
        big = ["x" * 1000] * (MAX_PAYLOAD_BYTES // 1000 + 1)
        bare = News.decode(News.appended("chunks", "output", 1, 2, len(big), orjson.dumps(big)).encode()).run
        assert bare is not None and bare.items() is None  # where the stream ends, only
        await append(2, *big)
        await until(2 + len(big))
        await post_event(first, "chunks", token, {"type": "succeed", "resultRef": "r", "resultHash": "h"})
        with anyio.fail_after(WITHIN_S):
            assert await read_to_close(ws, None) == 1000
    assert holder.texts == {"output": "alost" + "".join(big)}


@contextmanager
def lost_messages(bus: object) -> Iterator[list[News]]:
    """Within the block, ``bus`` loses every message (its announcements and its publishes): returned."""
    dropped: list[News] = []

    async def drop_announce(tx: WriteTx, news: Sequence[News]) -> None:
        dropped.extend(news)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bus, "publish", dropped.append)
        patch.setattr(bus, "announce", drop_announce)
        yield dropped


def handed_out(gw: Running, task_id: str, version: int) -> bool:
    """Whether the gateway's hub has handed ``version`` of the task to its subscribers."""
    channel = gw.gateway.hub.fanout.channels.get(task_id)
    return channel is not None and channel.version >= version


async def test_the_local_bus_serves_its_own_process(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url) as gw:
        assert type(gw.gateway.bus).__name__ == "LocalBus"
        await watched_run(gw, gw, "local")


async def test_tasks_expired_in_one_batch_reach_the_other_process(pg_url: str) -> None:
    """One expiry pass writes several tasks in one transaction (one NOTIFY statement for the batch on
    PostgreSQL): each subscriber of the other process gets its task's expire entry and the close."""
    clock = FakeClock()
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(live_gateway(pg_url, clock=clock))
        second = await stack.enter_async_context(live_gateway(pg_url, clock=clock))
        ids = [f"batch-{i}" for i in range(5)]
        created = {task_id: await create_task(first, task_id, ttl_ms=1_000) for task_id in ids}
        checks: list[StreamCheck] = []
        async with anyio.create_task_group() as tg:
            opened = [anyio.Event() for _ in ids]
            for task_id, ready in zip(ids, opened, strict=True):

                async def subscriber(task_id: str = task_id, ready: anyio.Event = ready) -> None:
                    token = created[task_id]["subscribeToken"]
                    checks.append(await watch_to_end(second, task_id, token, ready))

                tg.start_soon(subscriber)
            with anyio.fail_after(WITHIN_S):
                for ready in opened:
                    await ready.wait()
            clock.advance(5_000)
            assert await sweep_once(first.gateway.book) == len(ids)
        for check in checks:
            assert check.types == ["caught-up", "event"]
            check.assert_final(await get_task(second, check.task_id))
            assert check.task is not None and check.task["state"] == "expired"


async def test_a_lost_creation_is_found_by_the_tags_reconcile(pair: tuple[Running, Running]) -> None:
    """The messages of a task's creation are lost: no entry of it reaches a subscriber of its tag on the
    second gateway (it streams no such task), so only that gateway's periodic check, listing the watched
    tags again, can find it: then it is announced, and its entries follow."""
    first, second = pair
    bus = first.gateway.bus
    tag = f"run:{uuid.uuid4().hex[:12]}"  # a Redis channel is shared by every gateway on that Redis
    watch = TagWatch(tag)
    async with socket(ws_url(second, "/v1/ws")) as ws:
        await ws.send(tag_subscribe(tag))
        watch.feed(await recv_frame(ws))
        with lost_messages(bus) as dropped:
            created = await create_task(first, "lost-creation", tags=[tag])
        assert [n.created for n in dropped] == [True, True]  # its announcement and its publish
        with anyio.fail_after(WITHIN_S):
            watch.feed(await recv_frame(ws, WITHIN_S))
            watch.feed(await recv_frame(ws, WITHIN_S))
        assert watch.added == ["lost-creation"]
        token = created.callback_token
        await post_event(first, "lost-creation", token, {"type": "start", "worker": "w1"})
        watch.feed(await recv_frame(ws))
    watch.checks["lost-creation"].assert_final(await get_task(second, "lost-creation"))
