"""A queue's job that outlives its heartbeat lease (issue 32's defect 6), on real workers: a job with a 2 s
lease is at its 5th step when the gateway is stopped (SIGTERM) and restarted on the same database once the
lease is over, or when its worker process is stopped (SIGSTOP) until the gateway's sweeper has ended the
lease. The sweeper requeues the task (``fail``, ``heartbeat-timeout``, retryable) while the job goes on; the
queue has the job as running (or done, and acknowledged), so nothing else will run it. The run takes the
task back, as its next attempt (a new ``start``, the progress it had reached, the rest of its reports), and
the task ends as the job did, instead of reading "Retrying" until its deadline.

Celery on RabbitMQ (both outages) and arq (its worker process stopped).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest
from arq.connections import RedisSettings, create_pool

from gateway.integrations import arq as gateway_arq
from gateway.integrations.celery import uninstall
from gateway.machine import TERMINAL
from tests.support import eventually
from tests.support.celery_processes import API_KEY, celery_worker, publishing_app, rabbitmq_broker
from tests.support.lease_outage import TIMED_OUT, RestartableGateway, restartable_gateway
from tests.support.queue_runs import ARQ_DB, queue_workers, redis_space, worker_environ

pytestmark = pytest.mark.anyio

LEASE_MS = 2_000
FIRST, REST = [10, 20, 30, 40, 50], [60, 70, 80, 90, 100]
WITHIN_S = 30.0


def _attempts(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The events of each attempt (cut at each ``start``)."""
    runs: list[list[dict[str, Any]]] = []
    for event in events:
        if event["type"] == "start":
            runs.append([])
        runs[-1].append(event)
    return runs


def _progress(run: list[dict[str, Any]]) -> list[int]:
    return [e["progress"] for e in run if e["type"] == "progress"]


async def _ended_as_the_job_did(place: RestartableGateway, task_id: str, result_ref: str) -> None:
    """The task succeeded with the job's result, as its second attempt: the first ended by the lease, the
    second begun by the same run, from the progress it had reached to the job's last."""
    task = await place.until(task_id, "ended", lambda t: t["state"] in TERMINAL, WITHIN_S)
    assert (task["state"], task["attempts"], task["resultRef"]) == ("succeeded", 2, result_ref), task
    first, second = _attempts(await place.history(task_id))
    assert first[-1]["type"] == "fail" and (first[-1]["error"], first[-1]["retryable"]) == (TIMED_OUT, True)
    assert _progress(first)[-1] == 50, first
    assert second[0]["worker"] == first[0]["worker"], (first, second)  # the same run took it back
    assert second[-1]["type"] == "succeed", second
    assert _progress(second)[0] >= 50 and _progress(second)[-1] == 100, second  # from where it was
    assert _progress(second) == sorted(set(_progress(second))), second


async def _written(path: Path) -> str:
    """The file's text, once the job has written it."""

    async def read() -> str | None:
        found = anyio.Path(path)
        return await found.read_text() if await found.exists() else None

    text = await eventually(read, lambda found: found is not None, f"{path.name} written")
    assert text is not None
    return text


@pytest.mark.parametrize("outage", ["gateway restarted", "pool process stopped"])
async def test_a_celery_job_that_outlives_its_lease_ends_its_task_as_it_ended(
    outage: str, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    with rabbitmq_broker() as broker:
        async with (
            restartable_gateway(tmp_path) as place,
            celery_worker(broker, place.workers_url, shared),
        ):
            app = publishing_app(broker, place.url, shared)
            try:
                sent = await anyio.to_thread.run_sync(
                    lambda: app.signature("tg.outlives").apply_async(
                        (FIRST, REST), headers={"gateway": {"heartbeatMs": LEASE_MS}}
                    )
                )
            finally:
                uninstall(app)
                app.close()
            task_id = str(sent.id)
            await place.until(task_id, "at its 5th step", lambda t: t["progress"] == 50)
            pid = int(await _written(shared / f"{task_id}.pid"))
            if outage == "gateway restarted":
                place.cut_off()
                await place.stop()
                (shared / f"{task_id}.go").touch()
                await _written(shared / f"{task_id}.done")  # the job has returned: its message is done
                await place.restart_past_the_lease(task_id)
            else:
                os.kill(pid, signal.SIGSTOP)
                try:
                    await place.until(
                        task_id, "its lease ended", lambda t: t.get("error") == TIMED_OUT, WITHIN_S
                    )
                finally:
                    os.kill(pid, signal.SIGCONT)
                (shared / f"{task_id}.go").touch()
            await _ended_as_the_job_did(place, task_id, f"s3://outlived/{task_id}")


async def test_an_arq_job_whose_worker_was_stopped_past_its_lease_ends_its_task_as_it_ended(
    tmp_path: Path,
) -> None:
    async with (
        restartable_gateway(tmp_path) as place,
        redis_space(ARQ_DB) as space,
    ):
        queue = space.key("queue")
        gateway_arq.configure(url=place.url, api_key=API_KEY, timeout=5.0)
        redis = await create_pool(RedisSettings(host="127.0.0.1", port=6379, database=ARQ_DB))
        try:
            job_id = f"{space.token}-outlive"
            job = await gateway_arq.enqueue_job(
                redis,
                "work",
                "outlive",
                _job_id=job_id,
                _queue_name=queue,
                _gateway={"maxAttempts": 2, "heartbeatMs": LEASE_MS},
            )
            assert job is not None
            argv = ["-m", "arq", "tests.jobs.arq_jobs.WorkerSettings"]
            environ = worker_environ(place.workers_url, space, queue)
            async with queue_workers([("arq-outlive", argv, environ)], tmp_path) as (worker,):
                await place.until(job_id, "at its 5th step", lambda t: t["progress"] == 50)
                await eventually(
                    lambda: space.client.get(f"{space.token}:at:{job_id}"), bool, "the job waiting for its go"
                )
                os.kill(worker.pid, signal.SIGSTOP)
                try:
                    await place.until(
                        job_id, "its lease ended", lambda t: t.get("error") == TIMED_OUT, WITHIN_S
                    )
                finally:
                    os.kill(worker.pid, signal.SIGCONT)
                await space.client.set(f"{space.token}:go:{job_id}", 1)
                await _ended_as_the_job_did(place, job_id, f"s3://results/{job_id}")
        finally:
            await redis.aclose()
