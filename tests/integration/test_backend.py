"""``AsyncBackend`` and ``Backend`` against a real gateway with an API key: every method does what its
route says, a refusal raises the error of its code, and the calls that retry do so without changing
anything twice (a create whose answer was lost, a drain whose answer was lost: its key brings the same
batch back)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio.from_thread
import httpx
import pytest

from gateway.client import (
    AsyncBackend,
    Backend,
    BackendError,
    ClientError,
    SyncWorker,
    TaskExists,
    UnknownTask,
    Worker,
)
from tests.support import Running, TcpProxy, bearer, running_gateway
from tests.support.threaded import Threaded, threaded_gateway

API_KEY = "backend-test-key-0123456789"
TAGS = ["owner:u1", "project:7"]


def port_of(url: str) -> int:
    return int(url.rpartition(":")[2])


async def finish(gw: Running, backend: AsyncBackend, task_id: str) -> None:
    """Create ``task_id`` and see it succeed."""
    made = await backend.create(task_id, ttl_ms=60_000)
    async with Worker(gw.url, task_id, made.callback_token) as worker:
        await worker.start("w1")
        await worker.succeed(f"s3://r/{task_id}", "sha256:r")


@pytest.mark.anyio
async def test_the_async_backend_creates_lists_cancels_delivers_and_drains(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, api_key=API_KEY) as gw, AsyncBackend(gw.url, API_KEY) as backend:
        made = await backend.create("rep-1", ttl_ms=60_000, max_attempts=2, heartbeat_ms=5_000, tags=TAGS)
        assert made.created and made.task["state"] == "queued" and made.task["tags"] == TAGS
        again = await backend.create(
            "rep-1", ttl_ms=60_000, max_attempts=2, heartbeat_ms=5_000, tags=TAGS[::-1]
        )
        assert not again.created and again.task == made.task  # the same parameters: the task, 200
        assert await backend.get("rep-1") == made.task
        named = await backend.create(ttl_ms=60_000, tags=["owner:u2"])
        assert named.created and str(uuid.UUID(named.task["id"])) == named.task["id"]  # a UUID, named here

        # The tokens are the task's: the worker's and the subscriber's.
        async with Worker(gw.url, "rep-1", made.callback_token) as worker:
            await worker.start("w1")
            await worker.succeed("s3://r/1", "sha256:1")
        read = await gw.client.get("/v1/tasks/rep-1", headers=bearer(made.subscribe_token))
        assert read.status_code == 200 and read.json()["state"] == "succeeded"

        tag_token = await backend.tag_token("owner:u1", ttl_s=60)
        listed = await gw.client.get("/v1/tasks", params={"tag": "owner:u1"}, headers=bearer(tag_token.token))
        assert [task["id"] for task in listed.json()["tasks"]] == ["rep-1"]
        assert tag_token.expires_at_ms > made.task["createdAtMs"]

        for n in range(2, 6):
            await backend.create(f"rep-{n}", ttl_ms=60_000, tags=["owner:u1"])
        page = await backend.list(tags=["owner:u1"], limit=2)
        assert [task["id"] for task in page.tasks] == ["rep-5", "rep-4"] and page.next_cursor is not None
        every = [task["id"] async for task in backend.list_all(tags=["owner:u1"], limit=2)]
        assert every == ["rep-5", "rep-4", "rep-3", "rep-2", "rep-1"]
        queued = [task["id"] async for task in backend.list_all(state="queued", limit=2)]
        assert sorted(queued) == sorted([named.task["id"], "rep-2", "rep-3", "rep-4", "rep-5"])

        cancelled = await backend.cancel("rep-2", "started by mistake")
        assert cancelled["reason"] == "cancelled" and cancelled["task"]["error"] == "cancelled"
        assert (await backend.cancel("rep-2"))["reason"] == "terminal-conflict"

        delivered = await backend.deliver("rep-1", "deliver-1")
        assert delivered["reason"] == "delivered" and delivered["receipt"]["resultRef"] == "s3://r/1"
        assert (await backend.deliver("rep-1", "deliver-1"))["reason"] == "duplicate-delivery"

        drained = await backend.drain(limit=1)
        assert drained.more and len(drained.notifications) == 1 and drained.idempotency_key
        assert await backend.drain(idempotency_key=drained.idempotency_key) == drained  # kept under its key
        rest = await backend.drain()
        assert not rest.more and rest.idempotency_key != drained.idempotency_key
        taken = {n["taskId"]: n["state"] for n in drained.notifications + rest.notifications}
        assert taken == {"rep-1": "succeeded", "rep-2": "failed"}


@pytest.mark.anyio
async def test_a_refusal_raises_the_error_of_its_code_with_the_task(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, api_key=API_KEY) as gw, AsyncBackend(gw.url, API_KEY) as backend:
        await backend.create("err-1", ttl_ms=60_000)
        with pytest.raises(TaskExists) as exists:
            await backend.create("err-1", ttl_ms=60_000, max_attempts=3)
        assert (exists.value.status, exists.value.code, exists.value.task_id) == (409, "task-exists", "err-1")
        assert isinstance(exists.value, BackendError) and isinstance(exists.value, ClientError)
        for call in (backend.get("nope"), backend.cancel("nope"), backend.deliver("nope", "k")):
            with pytest.raises(UnknownTask) as unknown:
                await call
            assert (unknown.value.status, unknown.value.task_id) == (404, "nope")
        with pytest.raises(BackendError) as not_succeeded:
            await backend.deliver("err-1", "k")
        assert (not_succeeded.value.status, not_succeeded.value.code) == (409, "not-succeeded")
        with pytest.raises(BackendError) as invalid:
            await backend.create("err-2", ttl_ms=0)
        assert invalid.value.code == "invalid-request" and "ttlMs" in invalid.value.message
        async with AsyncBackend(gw.url, "not-the-key") as stranger:
            with pytest.raises(BackendError) as unauthorized:
                await stranger.list()
        assert (unauthorized.value.status, unauthorized.value.code) == (401, "unauthorized")


@pytest.mark.anyio
async def test_a_create_and_a_drain_whose_answers_were_lost_are_retried_to_the_same_outcome(
    sqlite_url: str,
) -> None:
    async with running_gateway(sqlite_url, api_key=API_KEY) as gw, TcpProxy(port_of(gw.url)) as proxy:
        async with AsyncBackend(proxy.url, API_KEY) as backend:
            proxy.drop_responses = 1  # the gateway creates the task; its answer never arrives
            made = await backend.create("lost-1", ttl_ms=60_000, max_attempts=2)
            assert not made.created and made.task["version"] == 0  # the retry found it made: one task
            assert proxy.accepted == 2

            await finish(gw, backend, "lost-2")
            proxy.drop_responses = 1  # the gateway takes the batch; its answer never arrives
            drained = await backend.drain()
            assert [n["taskId"] for n in drained.notifications] == ["lost-2"]  # the retry, same key
            assert (await backend.drain()).notifications == []
        listed = await gw.client.get("/v1/tasks", headers=bearer(API_KEY))
        assert [task["id"] for task in listed.json()["tasks"]] == ["lost-1", "lost-2"]


# --- the sync Backend: the same calls, from a thread with no event loop -----------------------------------


@contextmanager
def proxied(threaded: Threaded) -> Iterator[tuple[TcpProxy, Any]]:
    """A TcpProxy to the gateway, on an event loop of its own; with the portal that runs it."""
    with (
        anyio.from_thread.start_blocking_portal("asyncio") as portal,
        portal.wrap_async_context_manager(TcpProxy(port_of(threaded.url))) as proxy,
    ):
        yield proxy, portal


def test_the_sync_backend_does_the_same_and_retries_the_same(tmp_path: Path) -> None:
    with (
        threaded_gateway(f"sqlite:///{tmp_path / 'gateway.db'}", api_key=API_KEY) as threaded,
        proxied(threaded) as (proxy, portal),
        Backend(proxy.url, API_KEY) as backend,
    ):
        portal.call(setattr, proxy, "drop_responses", 1)
        made = backend.create("sync-1", ttl_ms=60_000, max_attempts=2, heartbeat_ms=5_000, tags=TAGS)
        assert not made.created and made.task["tags"] == TAGS and portal.call(getattr, proxy, "accepted") == 2
        assert backend.create("sync-2", ttl_ms=60_000, tags=["owner:u1"]).created
        assert backend.get("sync-1") == made.task
        assert [task["id"] for task in backend.list_all(tags=["owner:u1"], limit=1)] == ["sync-2", "sync-1"]
        assert backend.list(state="running").tasks == []
        assert threaded.client.get(
            "/v1/tasks/sync-2", headers=bearer(backend.tag_token("owner:u1").token)
        ).is_success

        with SyncWorker(threaded.url, "sync-1", made.callback_token) as worker:
            worker.start("w1")
            worker.succeed("s3://r/sync-1", "sha256:s")
        assert backend.deliver("sync-1", "d-1")["receipt"]["resultHash"] == "sha256:s"
        assert backend.cancel("sync-2", "no longer wanted")["reason"] == "cancelled"
        portal.call(setattr, proxy, "drop_responses", 1)
        drained = backend.drain()
        assert sorted(n["taskId"] for n in drained.notifications) == ["sync-1", "sync-2"] and not drained.more
        assert backend.drain(idempotency_key=drained.idempotency_key) == drained
        assert backend.drain().notifications == []

        with pytest.raises(TaskExists):
            backend.create("sync-1", ttl_ms=1_000)
        with pytest.raises(UnknownTask):
            backend.cancel("nope")
        with pytest.raises(BackendError, match="not-succeeded"):
            backend.deliver("sync-2", "d-2")


def test_the_sync_backend_in_open_mode_sends_no_key_and_uses_a_client_given_to_it(tmp_path: Path) -> None:
    with (
        threaded_gateway(f"sqlite:///{tmp_path / 'gateway.db'}") as threaded,
        httpx.Client(timeout=5) as client,
    ):
        with Backend(threaded.url, client=client) as backend:
            assert backend.create("open-1", ttl_ms=60_000).created
        assert not client.is_closed  # the caller's client is the caller's to close
        assert Backend(threaded.url, client=client).get("open-1")["id"] == "open-1"
