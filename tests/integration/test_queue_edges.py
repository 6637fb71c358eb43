"""The RQ and arq integrations where the happy path ends: a producer that cannot reach the gateway still
publishes the job (saying so), and the worker creates the task with the parameters the job carries; a job
stopped by the queue's own time limit fails for good on the gateway, with the queue's error; an RQ job that
returns ``Retry`` is a retryable fail, and its next run the next attempt.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from arq.connections import RedisSettings, create_pool
from arq.jobs import Job as ArqJob
from redis import Redis
from rq import Queue, Retry
from rq.job import Job, JobStatus

from gateway.integrations import arq as gateway_arq
from gateway.integrations import rq as gateway_rq
from tests.support import eventually, http_client, running_gateway
from tests.support.processes import free_port
from tests.support.queue_runs import (
    API_KEY,
    ARQ_DB,
    RQ_DB,
    gateway_headers,
    queue_workers,
    redis_space,
    worker_environ,
)

WITHIN_S = 60.0


async def _ended(client: httpx.AsyncClient, task_id: str) -> dict[str, Any]:
    async def probe() -> httpx.Response:
        return await client.get(f"/v1/tasks/{task_id}")

    answer = await eventually(
        probe,
        lambda a: a.status_code == 200 and a.json()["state"] in ("succeeded", "failed", "expired"),
        f"{task_id} ended",
        WITHIN_S,
    )
    task: dict[str, Any] = answer.json()
    return task


@pytest.mark.anyio
async def test_rq_unreachable_producer_time_limit_and_returned_retry(
    tmp_path: Path, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        running_gateway(sqlite_url, api_key=API_KEY) as gw,
        redis_space(RQ_DB) as space,
        http_client(base_url=gw.url, headers=gateway_headers(), timeout=30) as client,
    ):
        redis = Redis.from_url(space.url)
        queue = Queue(space.token, connection=redis)
        orphan, slow, again = f"{space.token}-orphan", f"{space.token}-slow", f"{space.token}-again"
        gateway_rq.install(url=f"http://127.0.0.1:{free_port()}", api_key=API_KEY, timeout=1.0)
        with caplog.at_level(logging.WARNING, logger="gateway.integrations"):
            await anyio.to_thread.run_sync(
                lambda: gateway_rq.enqueue(
                    queue,
                    "tests.jobs.rq_jobs.work",
                    "ok",
                    job_id=orphan,
                    retry=Retry(max=2),
                    gateway={"tags": ["t:1"]},
                )
            )
        assert f"could not create task {orphan}" in caplog.text
        gateway_rq.install(url=gw.url, api_key=API_KEY, timeout=5.0)
        await anyio.to_thread.run_sync(
            lambda: gateway_rq.enqueue(queue, "tests.jobs.rq_jobs.work", "slow", job_id=slow, job_timeout=1)
        )
        await anyio.to_thread.run_sync(
            lambda: gateway_rq.enqueue(
                queue, "tests.jobs.rq_jobs.work", "again", job_id=again, gateway={"maxAttempts": 2}
            )
        )
        argv = [
            "-m",
            "rq.cli",
            "worker",
            "--url",
            space.url,
            "--worker-class",
            "gateway.integrations.rq.GatewayWorker",
            "--job-class",
            "gateway.integrations.rq.GatewayJob",
        ]
        argv += ["--name", f"{space.token}-w", space.token]
        async with queue_workers([("rq", argv, worker_environ(gw.url, space, space.token))], tmp_path):
            made = await _ended(client, orphan)
            timed_out = await _ended(client, slow)
            retried = await _ended(client, again)
            status = await eventually(
                lambda: anyio.to_thread.run_sync(lambda: Job.fetch(slow, connection=redis).get_status()),
                lambda s: s == JobStatus.FAILED,
                "RQ failed the slow job",
            )
        assert status == JobStatus.FAILED
        # Created by the worker with what the job carried: its attempts (Retry(max=2): 3) and tags.
        assert (made["state"], made["maxAttempts"], made["tags"], made["resultRef"]) == (
            "succeeded",
            3,
            ["t:1"],
            f"s3://results/{orphan}",
        )
        assert (timed_out["state"], timed_out["attempts"]) == ("failed", 1)
        assert timed_out["error"].startswith("JobTimeoutException"), timed_out
        assert (retried["state"], retried["attempts"], retried["error"], retried["resultRef"]) == (
            "succeeded",
            2,
            "Retry: the job asked to be run again",
            f"s3://results/{again}",
        )
        redis.close()


@pytest.mark.anyio
async def test_arq_unreachable_producer_and_time_limit(
    tmp_path: Path, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with (
        running_gateway(sqlite_url, api_key=API_KEY) as gw,
        redis_space(ARQ_DB) as space,
        http_client(base_url=gw.url, headers=gateway_headers(), timeout=30) as client,
    ):
        redis = await create_pool(RedisSettings(host="127.0.0.1", port=6379, database=ARQ_DB))
        try:
            queue = space.key("queue")
            orphan, slow = f"{space.token}-orphan", f"{space.token}-slow"
            gateway_arq.configure(url=f"http://127.0.0.1:{free_port()}", api_key=API_KEY, timeout=1.0)
            with caplog.at_level(logging.WARNING, logger="gateway.integrations"):
                await gateway_arq.enqueue_job(
                    redis,
                    "work",
                    "ok",
                    _job_id=orphan,
                    _queue_name=queue,
                    _gateway={"maxAttempts": 2, "tags": ["t:1"]},
                )
            assert f"could not create task {orphan}" in caplog.text
            gateway_arq.configure(url=gw.url, api_key=API_KEY, timeout=5.0)
            await gateway_arq.enqueue_job(redis, "work", "slow", _job_id=slow, _queue_name=queue)
            env = worker_environ(gw.url, space, queue)
            env["TG_TEST_JOB_TIMEOUT_S"] = "1"
            async with queue_workers(
                [("arq", ["-m", "arq", "tests.jobs.arq_jobs.WorkerSettings"], env)], tmp_path
            ):
                made = await _ended(client, orphan)
                timed_out = await _ended(client, slow)
                info = await eventually(
                    lambda: ArqJob(slow, redis).result_info(),
                    lambda i: i is not None,
                    "arq ended the slow job",
                )
            assert info is not None and not info.success and isinstance(info.result, TimeoutError)
        finally:
            await redis.aclose()
        assert (made["state"], made["maxAttempts"], made["tags"], made["resultRef"]) == (
            "succeeded",
            2,
            ["t:1"],
            f"s3://results/{orphan}",
        )
        # arq's time limit cancels the try (as an abort does), and the task fails rather than being cancelled.
        assert (timed_out["state"], timed_out["attempts"]) == ("failed", 1)
        assert timed_out["error"].startswith("TimeoutError"), timed_out
