"""``SyncWorker`` against a real gateway, from plain sync code: the ``Worker``'s answers, errors and
stable callback ids; inside ``with``, heartbeats that hold the task while the job's own thread is busy,
and a cancel the heartbeat learns of raised at the job's next call and at the block's end."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.client import (
    Backend,
    CallbackIgnored,
    SyncWorker,
    TaskAlreadyRunning,
    TaskCancelled,
    Worker,
)
from tests.support import running_gateway
from tests.support.threaded import Threaded, threaded_gateway, until


@pytest.fixture
def threaded(tmp_path: Path) -> Iterator[Threaded]:
    with threaded_gateway(f"sqlite:///{tmp_path / 'gateway.db'}") as threaded:
        yield threaded


@pytest.fixture
def backend(threaded: Threaded) -> Iterator[Backend]:
    with Backend(threaded.url) as backend:
        yield backend


def heartbeats(threaded: Threaded) -> float:
    text = threaded.client.get("/metrics").text
    (line,) = [line for line in text.splitlines() if line.startswith("gateway_heartbeats_total ")]
    return float(line.rpartition(" ")[2])


def history(threaded: Threaded, task_id: str) -> list[str]:
    events = threaded.client.get(f"/v1/tasks/{task_id}/events", params={"cursor": 0}).json()["events"]
    return [entry["event"]["type"] for entry in events]


def test_the_sync_worker_answers_and_raises_as_the_worker_does_with_stable_ids(
    threaded: Threaded, backend: Backend
) -> None:
    made = backend.create("sync-1", ttl_ms=60_000, max_attempts=2)
    threads = threading.active_count()
    first = SyncWorker(threaded.url, "sync-1", made.callback_token)  # no ``with``: no heartbeats, close()
    second = SyncWorker(threaded.url, "sync-1", made.callback_token)
    try:
        assert first.start("w1")["reason"] == "started" and first.attempt == 1
        assert first.progress(40, "row-400", callback_id="sync-1:1:p1")["reason"] == "progress"
        # Another process sending the same logical callback (a redelivered job) changes nothing twice.
        with pytest.raises(TaskAlreadyRunning):
            second.start("w2")
        assert second.start("w2", take_over=True)["reason"] == "already-running" and second.attempt == 1
        again = second.progress(40, "row-400", callback_id="sync-1:1:p1")
        assert again["reason"] == "duplicate-callback" and again["duplicateCallback"]
        assert first.heartbeat()["heartbeatMs"] is None  # a task without a lease: nothing to renew
        assert first.succeed("s3://r/1", "sha256:1", callback_id="sync-1:1:end")["reason"] == "succeeded"
        assert second.succeed("s3://r/1", "sha256:1", callback_id="sync-1:1:end")["duplicateCallback"]
        with pytest.raises(CallbackIgnored) as late:
            first.progress(50, "late")
        assert late.value.reason == "terminal-conflict" and late.value.task_id == "sync-1"
        unchecked = first.send({"type": "progress", "progress": 60, "cursor": ""}, fenced=True, check=False)
        assert unchecked["reason"] == "terminal-conflict"
        with pytest.raises(CallbackIgnored, match="terminal-conflict"):
            first.fail("too late", retryable=False)
    finally:
        first.close()
        second.close()
    assert threading.active_count() == threads  # each one's thread has ended
    assert history(threaded, "sync-1") == ["start", "progress", "succeed"]


def test_inside_with_it_heartbeats_while_the_jobs_thread_is_busy(
    threaded: Threaded, backend: Backend
) -> None:
    made = backend.create("beat-1", ttl_ms=60_000, max_attempts=1, heartbeat_ms=1_000)
    with SyncWorker(threaded.url, "beat-1", made.callback_token) as worker:
        worker.start("w1")
        assert worker.heartbeating and worker.heartbeat()["heartbeatMs"] == 1_000
        before = heartbeats(threaded)
        # The job's thread (this one) calls nothing of the worker: the lease is held by the background alone.
        until(lambda: heartbeats(threaded) >= before + 4, "four heartbeats, more than a lease's length")
        assert (backend.get("beat-1")["state"], backend.get("beat-1")["version"]) == ("running", 1)
        worker.succeed("s3://r/beat", "sha256:b")
        assert not worker.heartbeating  # stopped with the attempt's last callback
    assert history(threaded, "beat-1") == ["start", "succeed"]


def test_a_cancel_the_heartbeat_learns_of_is_raised_at_the_next_call_and_the_blocks_end(
    threaded: Threaded, backend: Backend
) -> None:
    made = backend.create("cancel-1", ttl_ms=60_000, max_attempts=2, heartbeat_ms=1_000)
    with (
        pytest.raises(TaskCancelled) as raised,
        SyncWorker(threaded.url, "cancel-1", made.callback_token) as worker,
    ):
        worker.start("w1")
        backend.cancel("cancel-1", "not wanted")
        until(lambda: worker.worker.over is not None, "the background heartbeat to learn of the cancel")
        with pytest.raises(TaskCancelled):
            worker.progress(50, "half")
    assert raised.value.event_type == "heartbeat" and raised.value.reason == "not-running"
    assert history(threaded, "cancel-1") == ["start", "cancel"]


def test_a_jobs_own_error_leaves_the_block_as_it_was_raised(threaded: Threaded, backend: Backend) -> None:
    made = backend.create("raises-1", ttl_ms=60_000, max_attempts=1, heartbeat_ms=1_000)
    with (
        pytest.raises(ValueError, match="bad row"),
        SyncWorker(threaded.url, "raises-1", made.callback_token) as worker,
    ):
        worker.start("w1")
        assert worker.heartbeating
        raise ValueError("bad row")
    assert not worker.heartbeating


@pytest.mark.anyio
async def test_the_async_workers_callbacks_take_stable_ids(sqlite_url: str) -> None:
    """``Worker.progress``/``succeed``/``fail`` with ``callback_id``: the run of a job redelivered to
    another process sends its callbacks again, under the same ids, and changes nothing twice."""
    async with running_gateway(sqlite_url) as gw:
        made = (
            await gw.client.post("/v1/tasks", json={"id": "ids-1", "ttlMs": 60_000, "maxAttempts": 2})
        ).json()
        async with (
            Worker(gw.url, "ids-1", made["callbackToken"]) as first,
            Worker(gw.url, "ids-1", made["callbackToken"]) as redelivered,
        ):
            await first.start("w1")
            await first.progress(30, "a", callback_id="ids-1:1:p1")
            await first.fail("boom", retryable=True, callback_id="ids-1:1:end")
            await redelivered.start("w2")  # attempt 2
            assert redelivered.attempt == 2
            # The first run's callbacks again (its answers were lost, say): the same ids, nothing changes.
            assert (await first.progress(30, "a", callback_id="ids-1:1:p1"))["duplicateCallback"]
            assert (await first.fail("boom", retryable=True, callback_id="ids-1:1:end"))["duplicateCallback"]
            await redelivered.succeed("s3://r", "sha256:r", callback_id="ids-1:2:end")
        events = (await gw.client.get("/v1/tasks/ids-1/events", params={"cursor": 0})).json()["events"]
        assert [e["event"]["type"] for e in events] == ["start", "progress", "fail", "start", "succeed"]
