"""RQ jobs on the gateway (gateway.integrations.rq), end to end: two real ``rq worker`` processes on this
machine's Redis (db 12, queue and job names of this test's own), a real gateway, 20 jobs among which some
retry, some fail for good, one is stopped, one cancelled on the gateway and one whose work horse is
SIGKILLed mid-job (a 2 s lease): every gateway task ends as RQ ended its job, with its attempts, its
progress entries rising and its result; the killed one is finished by a second run as a new attempt; a
subscriber of each saw it without a gap; the history checker passes.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, cast

import anyio
import pytest
from redis import Redis
from rq import Queue, Retry
from rq.command import send_stop_job_command
from rq.job import Job, JobStatus

from gateway.integrations import rq as gateway_rq
from tests.support import eventually, http_client, running_gateway, wait_until
from tests.support.queue_runs import (
    API_KEY,
    OK_METADATA,
    OK_OUTPUT,
    RQ_DB,
    Expected,
    Followed,
    RedisSpace,
    gateway_headers,
    queue_workers,
    redis_space,
    worker_environ,
)

LEASE_MS = 2_000
WITHIN_S = 120.0

# (plan, RQ retries, what the gateway task ends as, what RQ ends the job as); the job id is
# ``<token>-<n>-<plan>``, and the results' references are filled in per job.
# What an ``ok`` job leaves: its title (its name and argument) and its metadata.
OK_SHOWN: dict[str, Any] = {"output": OK_OUTPUT, "metadata": OK_METADATA, "title": "work('ok')"}
OK_DICT_SHOWN: dict[str, Any] = {**OK_SHOWN, "title": "work('ok-dict')"}

PLANS: list[tuple[str, int, Expected, str]] = [
    (
        "kill",
        1,
        Expected("succeeded", 2, "heartbeat-timeout", result_ref="", last_progress=(20, 80)),
        JobStatus.FINISHED,
    ),
    ("stop", 0, Expected("failed", 1, "cancelled", last_progress=(10,), cancelled=True), JobStatus.STOPPED),
    ("cancel", 1, Expected("failed", 1, "cancelled", cancelled=True), JobStatus.FAILED),
    *[
        (
            "ok",
            n % 2,
            Expected("succeeded", 1, result_ref="", last_progress=(75,), **OK_SHOWN),
            JobStatus.FINISHED,
        )
        for n in range(7)
    ],
    *[
        (
            "ok-dict",
            1,
            Expected("succeeded", 1, result_ref="rq", last_progress=(75,), **OK_DICT_SHOWN),
            JobStatus.FINISHED,
        )
    ]
    * 2,
    *[
        (
            "retry",
            1,
            Expected("succeeded", 2, "RuntimeError: flaky", result_ref="", last_progress=(30, 60)),
            JobStatus.FINISHED,
        )
    ]
    * 3,
    ("retry", 0, Expected("failed", 1, "RuntimeError: flaky", last_progress=(30,)), JobStatus.FAILED),
    *[
        (
            "fail",
            1,
            Expected("failed", 2, "ValueError: bad rows in run 2", last_progress=(10, 10)),
            JobStatus.FAILED,
        )
    ]
    * 3,
    (
        "fail",
        0,
        Expected("failed", 1, "ValueError: bad rows in run 1", last_progress=(10,)),
        JobStatus.FAILED,
    ),
]


def _worker(name: str, space: RedisSpace, gateway_url: str) -> tuple[str, list[str], dict[str, str]]:
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
        "--name",
        f"{space.token}-{name}",
        space.token,
    ]
    return name, argv, worker_environ(gateway_url, space, space.token)


@pytest.mark.anyio
async def test_rq_jobs_end_on_the_gateway_as_rq_ended_them(tmp_path: Path, sqlite_url: str) -> None:
    async with (
        running_gateway(sqlite_url, api_key=API_KEY) as gw,
        redis_space(RQ_DB) as space,
        http_client(base_url=gw.url, headers=gateway_headers(), timeout=30) as client,
    ):
        gateway_rq.install(url=gw.url, api_key=API_KEY, timeout=5.0)
        redis = Redis.from_url(space.url)
        queue = Queue(space.token, connection=redis)
        jobs: dict[str, tuple[str, Expected, str]] = {}
        for n, (plan, retries, want, status) in enumerate(PLANS):
            job_id = f"{space.token}-{n:02d}-{plan}"
            jobs[job_id] = (plan, want.for_job(job_id, "rq"), status)

            def publish(job_id: str = job_id, plan: str = plan, retries: int = retries) -> Job:
                return gateway_rq.enqueue(
                    queue,
                    "tests.jobs.rq_jobs.work",
                    plan,
                    job_id=job_id,
                    retry=Retry(max=retries) if retries else None,
                    gateway={"heartbeatMs": LEASE_MS, "tags": ["queue:rq"]},
                )

            await anyio.to_thread.run_sync(publish)
        assert len(jobs) == 20
        by_plan = {plan: job_id for job_id, (plan, _, _) in jobs.items()}
        followed = Followed(client, gw.url.replace("http://", "ws://"))

        async with anyio.create_task_group() as tg:
            for job_id in jobs:
                await followed.follow(job_id, tg, WITHIN_S)
            async with (
                queue_workers([_worker("w1", space, gw.url), _worker("w2", space, gw.url)], tmp_path),
                anyio.create_task_group() as actions,
            ):
                actions.start_soon(_kill_horse, followed, space, redis, by_plan["kill"])
                actions.start_soon(_stop, followed, redis, by_plan["stop"])
                actions.start_soon(_cancel_on_gateway, followed, by_plan["cancel"])
                await wait_until(
                    lambda: all(s.closes[-1:] == [1000] for s in followed.subscribers.values()),
                    lambda: (
                        "every task ended: "
                        + ", ".join(
                            f"{t}: v{s.version} {s.task['state']}"
                            for t, s in followed.subscribers.items()
                            if s.closes[-1:] != [1000]
                        )
                    ),
                    WITHIN_S,
                )

                def statuses() -> dict[str, Any]:
                    return {job_id: Job.fetch(job_id, connection=redis).get_status() for job_id in jobs}

                ended = {JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED}
                seen = await eventually(
                    lambda: anyio.to_thread.run_sync(statuses),
                    lambda found: all(s in ended for s in found.values()),
                    "RQ ended every job",
                    WITHIN_S,
                )

        assert {j: seen[j] for j in jobs} == {j: status for j, (_, _, status) in jobs.items()}
        await followed.check({job_id: want for job_id, (_, want, _) in jobs.items()})
        redis.close()


async def _kill_horse(followed: Followed, space: RedisSpace, redis: Redis, job_id: str) -> None:
    """SIGKILL the work horse running the job's first run, once the gateway shows its progress."""
    await followed.until(job_id, "attempt 1 at 20", lambda t: t["attempts"] == 1 and t["progress"] == 20)
    pid = cast(bytes | None, await anyio.to_thread.run_sync(redis.get, space.key("pid", job_id)))
    assert pid is not None
    os.kill(int(pid), signal.SIGKILL)


async def _stop(followed: Followed, redis: Redis, job_id: str) -> None:
    await followed.until(job_id, "running at 10", lambda t: t["state"] == "running" and t["progress"] == 10)
    await anyio.to_thread.run_sync(lambda: send_stop_job_command(redis, job_id))


async def _cancel_on_gateway(followed: Followed, job_id: str) -> None:
    await followed.until(
        job_id, "running with progress", lambda t: t["state"] == "running" and t["progress"] > 0
    )
    await followed.cancel(job_id)
