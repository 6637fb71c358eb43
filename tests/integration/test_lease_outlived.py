"""A ``Worker`` (and a ``SyncWorker``) whose job outlives its heartbeat lease (issue 32's defect 6).

While the task is queued at the worker's attempt because its lease ran out (the gateway's ``fail``,
``heartbeat-timeout``) and no newer attempt has started, the worker takes the task back as the next
attempt: a new ``start``, the progress it had reached, then what the job reports, so that a job that went
on to its end is not shown waiting for a run that will not come. A task that went on without it (a newer
attempt started, or no attempt left) is said at ERROR, with what is lost, and raised as before.

Against a gateway stopped (SIGTERM) and restarted on the same database past the lease, and, for the
outcomes that need no outage, a gateway in this process and a worker that sends no heartbeat (outside
``async with``), whose lease runs out by itself.
"""

from __future__ import annotations

import logging
import threading
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from gateway.client import AttemptOver, CallbackIgnored, SyncWorker, Worker
from tests.support import STEP_S, FakeClock, Running, bearer, eventually, http_client, running_gateway
from tests.support.celery_processes import API_KEY
from tests.support.lease_outage import TIMED_OUT, RestartableGateway, restartable_gateway

pytestmark = pytest.mark.anyio

LEASE_MS = 2_000
SHORT_LEASE_MS = 1_000  # the gateway's least
RESULT = ("s3://reports/outlived", "sha256:9f2c")


async def _create(
    place: RestartableGateway | Running, max_attempts: int, lease_ms: int = LEASE_MS
) -> tuple[str, str]:
    """A task with a lease: its id and callback token."""
    task_id = f"outlived-{uuid.uuid4().hex[:8]}"
    body = {"id": task_id, "ttlMs": 600_000, "maxAttempts": max_attempts, "heartbeatMs": lease_ms}
    if isinstance(place, Running):
        answer = await place.client.post("/v1/tasks", json=body)
    else:
        async with http_client(base_url=place.url, headers=bearer(API_KEY)) as client:
            answer = await client.post("/v1/tasks", json=body)
    assert answer.status_code == 201, answer.text
    return task_id, str(answer.json()["callbackToken"])


def _shape(events: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Each event as its type and what says most about it."""
    said = {"start": "worker", "progress": "progress", "fail": "error", "succeed": "resultRef"}
    return [(e["type"], e.get(said.get(e["type"], ""))) for e in events]


async def test_a_worker_whose_lease_a_gateway_restart_ended_takes_its_task_back(tmp_path: Path) -> None:
    async with restartable_gateway(tmp_path) as place:
        task_id, token = await _create(place, max_attempts=2)
        with anyio.fail_after(60):
            async with Worker(place.workers_url, task_id, token) as worker:
                await worker.start("w1")
                for value in (10, 20, 30, 40, 50):
                    await worker.progress(value, cursor=f"row-{value}")
                await place.outlive_lease(task_id)
                for value in (60, 70):
                    await worker.progress(value, cursor=f"row-{value}")
                answer = await worker.succeed(*RESULT)
        assert answer["reason"] == "succeeded" and worker.attempt == 2
        task = await place.task(task_id)
        assert (task["state"], task["attempts"], task["resultRef"]) == ("succeeded", 2, RESULT[0])
        assert _shape(await place.history(task_id)) == [
            ("start", "w1"),
            *[("progress", v) for v in (10, 20, 30, 40, 50)],
            ("fail", TIMED_OUT),
            ("start", "w1"),
            ("progress", 50),  # where it was, again
            ("progress", 60),
            ("progress", 70),
            ("succeed", RESULT[0]),
        ]


async def test_a_sync_worker_whose_heartbeat_learns_its_lease_ended_takes_its_task_back(
    tmp_path: Path,
) -> None:
    """The job's thread is busy (waiting) through the outage: the background heartbeat is what learns the
    lease ended, and takes the task back before the job reports again."""
    async with restartable_gateway(tmp_path) as place:
        task_id, token = await _create(place, max_attempts=2)
        go = threading.Event()

        def job() -> dict[str, Any]:
            with SyncWorker(place.workers_url, task_id, token) as worker:
                worker.start("w1")
                worker.progress(50, cursor="row-50")
                go.wait(STEP_S * 6)
                worker.progress(80, cursor="row-80")
                return worker.succeed(*RESULT)

        async with anyio.create_task_group() as tg:
            answers: list[dict[str, Any]] = []

            async def run() -> None:
                answers.append(await anyio.to_thread.run_sync(job))

            tg.start_soon(run)
            try:
                await place.until(task_id, "at 50", lambda t: t["progress"] == 50)
                await place.outlive_lease(task_id)
                await place.until(
                    task_id, "taken back", lambda t: (t["state"], t["attempts"]) == ("running", 2)
                )
            finally:
                go.set()
        assert answers[0]["reason"] == "succeeded"
        assert _shape(await place.history(task_id)) == [
            ("start", "w1"),
            ("progress", 50),
            ("fail", TIMED_OUT),
            ("start", "w1"),
            ("progress", 50),
            ("progress", 80),
            ("succeed", RESULT[0]),
        ]


async def _lease_ended(gw: Running, task_id: str) -> dict[str, Any]:
    task: dict[str, Any] = await eventually(
        lambda: _read(gw, task_id), lambda t: t["state"] != "running", f"{task_id}'s lease ended"
    )
    assert task.get("error") == TIMED_OUT, task
    return task


async def _read(gw: Running, task_id: str) -> dict[str, Any]:
    answer = await gw.client.get(f"/v1/tasks/{task_id}")
    task: dict[str, Any] = answer.json()
    return task


async def test_a_worker_whose_lease_ran_out_takes_its_task_back_at_its_next_callback(
    sqlite_url: str, clock: FakeClock
) -> None:
    # The gateway's time moves when the test says: the lease runs out after the progress, not before it (a
    # second of the real clock, which two requests on a loaded machine can take).
    async with running_gateway(sqlite_url, clock=clock) as gw, http_client() as client:
        task_id, token = await _create(gw, max_attempts=2, lease_ms=SHORT_LEASE_MS)
        # Outside ``async with``: no heartbeats (and the test's client, which it closes).
        worker = Worker(gw.url, task_id, token, client=client)
        await worker.start("w1")
        await worker.progress(40, cursor="row-40")
        clock.advance(SHORT_LEASE_MS)
        await _lease_ended(gw, task_id)
        answer = await worker.succeed(*RESULT)
        assert answer["reason"] == "succeeded" and worker.attempt == 2
        events = (await gw.client.get(f"/v1/tasks/{task_id}/events", params={"cursor": 0})).json()["events"]
        assert _shape([e["event"] for e in events]) == [
            ("start", "w1"),
            ("progress", 40),
            ("fail", TIMED_OUT),
            ("start", "w1"),
            ("progress", 40),
            ("succeed", RESULT[0]),
        ]


@pytest.mark.parametrize(
    ("max_attempts", "again_elsewhere", "raised", "why"),
    [
        (1, False, CallbackIgnored, "no attempt left"),  # the lease ended the last attempt
        (2, True, AttemptOver, "another attempt has started"),  # the queue ran the job again elsewhere
    ],
    ids=["last attempt", "started again elsewhere"],
)
async def test_a_worker_whose_task_went_on_without_it_says_its_result_is_lost(
    max_attempts: int,
    again_elsewhere: bool,
    raised: type[Exception],
    why: str,
    sqlite_url: str,
    clock: FakeClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The gateway's time moves when the test says: the other worker's lease does not run out too before the
    # late one's result is refused and the task read (a second of the real clock).
    async with running_gateway(sqlite_url, clock=clock) as gw, http_client() as client:
        task_id, token = await _create(gw, max_attempts=max_attempts, lease_ms=SHORT_LEASE_MS)
        late = Worker(gw.url, task_id, token, client=client)
        await late.start("w1")
        clock.advance(SHORT_LEASE_MS)
        await _lease_ended(gw, task_id)
        if again_elsewhere:
            await Worker(gw.url, task_id, token, client=client).start("w2")
        with caplog.at_level(logging.ERROR, logger="gateway.client"), pytest.raises(raised):
            await late.succeed(*RESULT)
        # The task as the gateway had it: failed, or running the other worker's attempt.
        assert (await _read(gw, task_id))["state"] == ("running" if again_elsewhere else "failed")
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and task_id in errors[0] and why in errors[0], errors
    assert RESULT[0] in errors[0], errors  # what was lost
