"""Tag subscriptions across gateway processes: two ``gateway serve`` processes (tests/support/processes.py) on
one PostgreSQL database, joined by LISTEN/NOTIFY or by Redis.

A subscriber of a tag on one process hears of every task created with the tag through the other (the
creation is news on the bus, as an entry is): ``added``, its ``snapshot`` ``new``, then every entry posted
through the other process, in order, to the task's end; so does a task made again there under the id of
one retention deleted (another epoch: another task). (A creation whose news is lost is found by the
periodic check: test_bus_conformance.py.)
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.integration.test_live_support import STEP_S, TagWatch, loads, tag_subscribe
from tests.support import eventually, http_client, postgres_database
from tests.support.processes import gateway_processes, redis_or_skip

pytestmark = pytest.mark.anyio

REDIS_URL = "redis://127.0.0.1:6379/0"
BUSES = [pytest.param(None, id="postgres"), pytest.param(REDIS_URL, id="redis")]
TEST_S = 90.0


@pytest.fixture
def pg_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


def unique(prefix: str) -> str:
    """Unique per run: a Redis channel is shared by every gateway that uses that Redis."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def create(client: httpx.AsyncClient, url: str, task_id: str, tag: str) -> dict[str, Any]:
    body = {"id": task_id, "ttlMs": 600_000, "maxAttempts": 2, "tags": [tag]}
    answer = await client.post(f"{url}/v1/tasks", json=body)
    assert answer.status_code == 201, answer.text
    return dict(answer.json())


async def read(ws: ClientConnection, watch: TagWatch, n: int) -> None:
    """The socket's next ``n`` frames, each fed to ``watch`` as it comes."""
    for _ in range(n):
        with anyio.fail_after(STEP_S):
            watch.feed(loads(await ws.recv()))


async def post(client: httpx.AsyncClient, url: str, made: dict[str, Any], event: dict[str, Any]) -> None:
    task_id, token = made["task"]["id"], made["callbackToken"]
    answer = await client.post(
        f"{url}/v1/tasks/{task_id}/callbacks",
        json={"event": event},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert answer.status_code == 200, answer.text


@pytest.mark.postgres
@pytest.mark.parametrize("bus", BUSES)
async def test_a_task_created_through_one_process_reaches_a_tag_subscriber_on_another(
    bus: str | None, pg_url: str, tmp_path: Path
) -> None:
    env: dict[str, str] = {}
    if bus is not None:
        await redis_or_skip(bus)
        env["GATEWAY_BUS_URL"] = bus
    tag = unique("proj")
    with anyio.fail_after(TEST_S):
        async with (
            gateway_processes(2, pg_url, tmp_path, env=env) as (a, b),
            http_client(timeout=STEP_S) as client,
        ):
            old = await create(client, a.url, unique("old"), tag)
            watch = TagWatch(tag)
            async with connect(f"{b.ws_url}/v1/ws", open_timeout=STEP_S, close_timeout=2) as ws:
                await ws.send(tag_subscribe(tag))
                await read(ws, watch, 2)
                assert watch.listed == [old["task"]["id"]]
                made = [await create(client, a.url, unique(f"new{i}"), tag) for i in range(3)]
                await read(ws, watch, 2 * len(made))
                assert watch.added == [m["task"]["id"] for m in made]
                for m in made:
                    await post(client, a.url, m, {"type": "start", "worker": "w1"})
                    await post(client, a.url, m, {"type": "progress", "progress": 50, "cursor": "half"})
                    done = {"type": "succeed", "resultRef": "s3://r", "resultHash": "sha256:1"}
                    await post(client, a.url, m, done)
                await read(ws, watch, 3 * len(made))
            for m in [old, *made]:
                answer = await client.get(f"{a.url}/v1/tasks/{m['task']['id']}")
                watch.checks[m["task"]["id"]].assert_final(answer.json())
    for m in made:
        assert watch.checks[m["task"]["id"]].event_versions == [1, 2, 3]


@pytest.mark.postgres
@pytest.mark.parametrize("bus", BUSES)
async def test_a_task_made_again_through_one_process_is_announced_to_a_tag_subscriber_on_another(
    bus: str | None, pg_url: str, tmp_path: Path
) -> None:
    """Issue 32's recreated id across processes: the subscriber on b followed the old task to its end; it was
    drained and deleted by retention (1 s), and its id made again through a: announced (``added``, a snapshot
    of another epoch) and streamed, the subscriber ending on the new task's state."""
    env = {"GATEWAY_RETAIN_FINISHED_S": "1"}
    if bus is not None:
        await redis_or_skip(bus)
        env["GATEWAY_BUS_URL"] = bus
    tag, task_id = unique("re"), unique("job")
    start = {"type": "start", "worker": "w1"}
    with anyio.fail_after(TEST_S):
        async with (
            gateway_processes(2, pg_url, tmp_path, env=env) as (a, b),
            http_client(timeout=STEP_S) as client,
        ):
            watch = TagWatch(tag)
            async with connect(f"{b.ws_url}/v1/ws", open_timeout=STEP_S, close_timeout=2) as ws:
                await ws.send(tag_subscribe(tag))
                await read(ws, watch, 1)
                old = await create(client, a.url, task_id, tag)
                await post(client, a.url, old, start)
                await post(
                    client, a.url, old, {"type": "succeed", "resultRef": "s3://r", "resultHash": "sha256:1"}
                )
                await read(ws, watch, 4)  # added, its snapshot, two events
                drained = await client.post(f"{a.url}/v1/notifications/drain")
                assert [n["taskId"] for n in drained.json()] == [task_id]
                url = f"{a.url}/v1/tasks/{task_id}"
                await eventually(
                    lambda: client.get(url), lambda r: r.status_code == 404, "deleted by retention"
                )
                new = await create(client, a.url, task_id, tag)
                await post(client, a.url, new, start)
                await post(client, a.url, new, {"type": "progress", "progress": 40, "cursor": "row-40"})
                await read(ws, watch, 4)
            assert watch.added == [task_id, task_id] and watch.recreated == [task_id]
            stored = (await client.get(url)).json()
            watch.checks[task_id].assert_final(stored)
            assert stored["epoch"] == new["task"]["epoch"] != old["task"]["epoch"]
