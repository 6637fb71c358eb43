"""The Python ``Worker`` against a real server: a callback that has no effect is an exception the worker's
author cannot miss (carrying the reason and the task), a harmless repeat is not, and ``start`` never adopts
an attempt another worker began unless told to."""

from __future__ import annotations

import httpx
import pytest

from gateway.client import (
    CallbackError,
    CallbackIgnored,
    ClientError,
    TaskAlreadyRunning,
    Worker,
    WorkerError,
)
from tests.support import FakeClock, create_task, http_client, running_gateway


@pytest.mark.anyio
async def test_callbacks_on_a_finished_task_raise_with_the_reason_and_the_task(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        made = await create_task(gw, "done-1", ttl_ms=120_000, max_attempts=1)
        async with Worker(gw.url, "done-1", made.callback_token) as first:
            await first.start("w1")
            await first.succeed("s3://r/1", "sha256:1")
            # The same result again is a harmless repeat (duplicate-result), not an error.
            again = await first.succeed("s3://r/1", "sha256:1")
            assert again["reason"] == "duplicate-result"
            with pytest.raises(CallbackIgnored) as ignored:
                await first.progress(50, "late")
        assert isinstance(ignored.value, WorkerError) and isinstance(ignored.value, ClientError)
        assert ignored.value.reason == "terminal-conflict"
        assert ignored.value.task_id == "done-1"
        assert ignored.value.task is not None and ignored.value.task["state"] == "succeeded"
        assert "terminal-conflict" in str(ignored.value) and "done-1" in str(ignored.value)

        # A worker that comes along later learns the task's fate at once, from its start.
        async with Worker(gw.url, "done-1", made.callback_token) as late:
            with pytest.raises(CallbackIgnored, match="terminal-conflict"):
                await late.start("w2")
            with pytest.raises(CallbackIgnored, match="terminal-conflict"):
                await late.fail("gave up", retryable=False)


@pytest.mark.anyio
async def test_a_second_worker_does_not_adopt_a_running_attempt_unless_told_to(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        made = await create_task(gw, "twice-1", ttl_ms=120_000, max_attempts=2)
        async with (
            Worker(gw.url, "twice-1", made.callback_token) as first,
            Worker(gw.url, "twice-1", made.callback_token) as second,
        ):
            await first.start("w1")
            with pytest.raises(TaskAlreadyRunning) as running:
                await second.start("w2")
            assert running.value.reason == "already-running"
            assert running.value.task is not None and running.value.task["attempts"] == 1
            assert second.attempt is None  # it holds no attempt, so its callbacks are not fenced as w1's

            answer = await second.start("w2", take_over=True)
            assert answer["reason"] == "already-running" and second.attempt == 1
            await second.progress(30, "adopted")
        task = (await gw.client.get("/v1/tasks/twice-1")).json()
        assert task["state"] == "running" and task["attempts"] == 1 and task["progress"] == 30


@pytest.mark.anyio
async def test_a_worker_of_an_old_attempt_gets_stale_attempt(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        made = await create_task(gw, "old-1", ttl_ms=120_000, max_attempts=2)
        async with (
            Worker(gw.url, "old-1", made.callback_token) as old,
            Worker(gw.url, "old-1", made.callback_token) as new,
        ):
            await old.start("w1")
            await old.fail("lost the lease", retryable=True)  # requeued: an applied transition
            # Not started yet: progress on a queued task changes nothing.
            with pytest.raises(CallbackIgnored, match="not-running"):
                await new.progress(10, "too early")
            await new.start("w2")
            with pytest.raises(CallbackError) as stale:
                await old.succeed("s3://r/old", "sha256:old")
        assert isinstance(stale.value, WorkerError)
        assert stale.value.status == 409 and stale.value.reason == "stale-attempt"
        assert stale.value.task_id == "old-1"
        task = (await gw.client.get("/v1/tasks/old-1")).json()
        assert task["state"] == "running" and task["attempts"] == 2


@pytest.mark.anyio
async def test_a_callback_after_the_deadline_raises_expired(sqlite_url: str) -> None:
    clock = FakeClock()
    async with running_gateway(sqlite_url, clock=clock, sweep_interval_ms=0) as gw:
        made = await create_task(gw, "late-1", ttl_ms=1_000, max_attempts=1)
        async with Worker(gw.url, "late-1", made.callback_token) as worker:
            await worker.start("w1")
            await worker.progress(10, "a")
            await worker.progress(10, "a")  # the same progress again: harmless (duplicate-progress)
            with pytest.raises(CallbackIgnored, match="stale-progress"):
                await worker.progress(5, "back")
            clock.advance(1_000)
            with pytest.raises(CallbackIgnored) as late:
                await worker.succeed("s3://r/late", "sha256:late")
        assert late.value.reason == "expired"
        assert late.value.task is not None and late.value.task["state"] == "expired"


@pytest.mark.anyio
async def test_a_worker_over_its_tasks_callback_rate_waits_and_every_callback_is_applied(
    sqlite_url: str,
) -> None:
    """Issue 9's callback rate per task (429 with Retry-After): the Python Worker waits as told and posts
    the same callback again, so a worker reporting faster than the limit loses no update and raises
    nothing; and it lets go of an idle pooled connection before the gateway's idle timeout closes it."""
    from gateway.client.worker import KEEPALIVE_S
    from gateway.settings import Settings

    assert Settings().idle_timeout_ms / 1000 > KEEPALIVE_S
    statuses: list[int] = []

    async def seen(response: httpx.Response) -> None:
        statuses.append(response.status_code)

    async with (
        running_gateway(sqlite_url, callback_rate_per_s=2) as gw,
        http_client(timeout=10, event_hooks={"response": [seen]}) as client,
    ):
        made = await create_task(gw, "fast-1", ttl_ms=120_000, max_attempts=1)
        worker = Worker(gw.url, "fast-1", made.callback_token, client=client)
        await worker.start("w1")
        for p in (10, 20, 30, 40):
            answer = await worker.progress(p, f"row-{p}")
            assert answer["reason"] == "progress", answer
        await worker.succeed("s3://r/fast-1", "sha256:1")
        task = (await gw.client.get("/v1/tasks/fast-1")).json()
    assert (task["state"], task["version"]) == ("succeeded", 6), task
    assert 429 in statuses and set(statuses) == {200, 429}, statuses  # the limit was hit, and waited out
