"""RQ jobs that run while the gateway is down: a real ``rq worker`` (``GatewayWorker``, forking a work horse
per job) on this machine's Redis (db 12, a queue of the test's own) runs them all to their end without
waiting for the gateway; each horse exits with its run's reports unsent, and the worker's main process
sends them once the gateway is back (the same port and database): every task ends as RQ ended its job,
with its attempts, its progress and its result, and a job retried while the gateway was away is the task's
second attempt, after its first run's retryable fail.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import anyio
import pytest
from redis import Redis
from rq import Queue, Retry
from rq.job import Job, JobStatus

from gateway.integrations import rq as gateway_rq
from tests.support import bearer, eventually, http_client
from tests.support.celery_processes import API_KEY, keyed_gateway, read_history
from tests.support.processes import free_port
from tests.support.queue_runs import ENV_KEY, RQ_DB, queue_workers, redis_space, worker_environ

WITHIN_S = 60.0


class Plan(NamedTuple):
    """A job (``tests/jobs/rq_jobs.py``'s plan, its RQ retries), what RQ ends it as, and its gateway task: its
    state, attempts, error (a prefix) and entries (:func:`_shape`)."""

    plan: str
    retries: int
    status: str
    state: str
    attempts: int
    error: str | None
    shape: list[tuple[str, Any]]


PLANS = [
    Plan(
        "ok",
        0,
        JobStatus.FINISHED,
        "succeeded",
        1,
        None,
        [("start", None), ("progress", 75), ("succeed", None)],
    ),
    Plan(
        "fail",
        0,
        JobStatus.FAILED,
        "failed",
        1,
        "ValueError: bad rows in run 1",
        [("start", None), ("progress", 10), ("fail", False)],
    ),
    Plan(
        "retry",
        1,
        JobStatus.FINISHED,
        "succeeded",
        2,
        "RuntimeError: flaky",
        [
            ("start", None),
            ("progress", 30),
            ("fail", True),
            ("start", None),
            ("progress", 60),
            ("succeed", None),
        ],
    ),
]


def _shape(history: dict[str, Any]) -> list[tuple[str, Any]]:
    """Each entry's type, with a progress's value and a fail's ``retryable``; the progress entries of one
    run before its last are left out (coalescing may or may not have sent them)."""
    shape: list[tuple[str, Any]] = []
    for entry in history["events"]:
        event = entry["event"]
        kind = event["type"]
        if kind == "progress":
            if shape and shape[-1][0] == "progress":
                shape.pop()
            shape.append((kind, event["progress"]))
        else:
            shape.append((kind, event["retryable"] if kind == "fail" else None))
    return shape


def _in_state(state: str, history: dict[str, Any]) -> bool:
    return bool(history["task"]["state"] == state)


@pytest.mark.anyio
async def test_rq_jobs_run_while_the_gateway_is_down_end_on_it_once_it_is_back(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    async with redis_space(RQ_DB) as space:
        redis = Redis.from_url(space.url)
        queue = Queue(space.token, connection=redis)
        jobs = {f"{space.token}-{p.plan}": p for p in PLANS}
        async with keyed_gateway(tmp_path, port=port):
            gateway_rq.install(url=url, api_key=API_KEY, timeout=5.0)

            def publish(job_id: str, plan: str, retries: int) -> Job:
                retry = Retry(max=retries) if retries else None
                return gateway_rq.enqueue(queue, "tests.jobs.rq_jobs.work", plan, job_id=job_id, retry=retry)

            for job_id, p in jobs.items():
                await anyio.to_thread.run_sync(publish, job_id, p.plan, p.retries)
        # The gateway is stopped: the worker runs every job to its end all the same.
        env = worker_environ(url, space, space.token)
        env[ENV_KEY] = API_KEY
        argv = ["-m", "rq.cli", "worker", "--url", space.url, "--name", f"{space.token}-w"]
        argv += ["--worker-class", "gateway.integrations.rq.GatewayWorker"]
        argv += ["--job-class", "gateway.integrations.rq.GatewayJob", space.token]
        async with queue_workers([("rq", argv, env)], tmp_path):

            def statuses() -> dict[str, Any]:
                return {job_id: Job.fetch(job_id, connection=redis).get_status() for job_id in jobs}

            seen = await eventually(
                lambda: anyio.to_thread.run_sync(statuses),
                lambda found: all(s in (JobStatus.FINISHED, JobStatus.FAILED) for s in found.values()),
                "RQ ended every job with the gateway down",
                WITHIN_S,
            )
            assert seen == {job_id: p.status for job_id, p in jobs.items()}
            async with (
                keyed_gateway(tmp_path, port=port, name="gw-again") as gw,
                http_client(base_url=gw.url, headers=bearer(API_KEY)) as client,
            ):
                for job_id, (_, _, _, state, attempts, error, shape) in jobs.items():
                    history = await eventually(
                        partial(read_history, client, job_id),
                        partial(_in_state, state),
                        f"{job_id} {state} once the gateway is back",
                        WITHIN_S,
                    )
                    task = history["task"]
                    assert (task["attempts"], _shape(history)) == (attempts, shape), history
                    if error is None:
                        assert task.get("error") is None, task
                    else:
                        assert str(task.get("error")).startswith(error), task
                    if state == "succeeded":
                        assert task["resultRef"] == f"s3://results/{job_id}", task
        redis.close()
