"""arq jobs on the gateway (gateway.integrations.arq), end to end: real ``arq`` worker processes on this
machine's Redis (db 13, queue and job names of this test's own), a real gateway, 20 jobs among which some
retry (``raise Retry``), some fail for good, one is aborted (``Job.abort()``), one cancelled on the gateway
and one whose worker is SIGKILLed mid-job (a 2 s lease): every gateway task ends as arq ended its job, with
its attempts, its progress entries rising and its result; the killed one is finished by a second try, in a
worker started after the kill, once arq's in-progress key has expired, as a new attempt; a subscriber of
each saw it without a gap; the history checker passes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from arq.connections import ArqRedis, RedisSettings, create_pool
from arq.jobs import Job

from gateway.integrations import arq as gateway_arq
from tests.support import eventually, http_client, running_gateway, wait_until
from tests.support.queue_runs import (
    API_KEY,
    ARQ_DB,
    OK_METADATA,
    OK_OUTPUT,
    Expected,
    Followed,
    QueueWorker,
    RedisSpace,
    gateway_headers,
    queue_workers,
    redis_space,
    start_worker,
    worker_environ,
)

LEASE_MS = 2_000
MAX_TRIES = 2  # tests/jobs/arq_jobs.py's WorkerSettings.max_tries
# The killed job's queue: its workers' time limit, so that arq's in-progress key (the limit + 10 s) lets
# the job run again within the test.
KILL_QUEUE_TIMEOUT_S = 10
WITHIN_S = 120.0

# (plan, what the gateway task ends as, whether arq ends the job as a success); the job id is
# ``<token>-<n>-<plan>``, and the results' references are filled in per job.
# What an ``ok`` job leaves: its title (its name and argument) and its metadata.
OK_SHOWN: dict[str, Any] = {"output": OK_OUTPUT, "metadata": OK_METADATA, "title": "work('ok')"}
OK_DICT_SHOWN: dict[str, Any] = {**OK_SHOWN, "title": "work('ok-dict')"}

PLANS: list[tuple[str, Expected, bool]] = [
    ("kill", Expected("succeeded", 2, "heartbeat-timeout", result_ref="", last_progress=(20, 80)), True),
    ("abort", Expected("failed", 1, "cancelled", last_progress=(10,), cancelled=True), False),
    ("cancel", Expected("failed", 1, "cancelled", cancelled=True), False),
    *[("ok", Expected("succeeded", 1, result_ref="", last_progress=(75,), **OK_SHOWN), True)] * 8,
    *[("ok-dict", Expected("succeeded", 1, result_ref="arq", last_progress=(75,), **OK_DICT_SHOWN), True)]
    * 2,
    *[("retry", Expected("succeeded", 2, "Retry", result_ref="", last_progress=(30, 60)), True)] * 3,
    (
        "retry-fail",
        Expected("failed", 2, "ValueError: bad rows in the second try", last_progress=(30, 10)),
        False,
    ),
    ("exhaust", Expected("failed", 2, "Retry", last_progress=(10, 10)), False),
    *[("fail", Expected("failed", 1, "ValueError: bad rows in try 1", last_progress=(10,)), False)] * 2,
]


def _worker(
    name: str, space: RedisSpace, gateway_url: str, queue: str, **env: str
) -> tuple[str, list[str], dict[str, str]]:
    environ = worker_environ(gateway_url, space, queue)
    environ.update(env)
    return name, ["-m", "arq", "tests.jobs.arq_jobs.WorkerSettings"], environ


@pytest.mark.anyio
async def test_arq_jobs_end_on_the_gateway_as_arq_ended_them(tmp_path: Path, sqlite_url: str) -> None:
    async with (
        running_gateway(sqlite_url, api_key=API_KEY) as gw,
        redis_space(ARQ_DB) as space,
        http_client(base_url=gw.url, headers=gateway_headers(), timeout=30) as client,
    ):
        gateway_arq.configure(url=gw.url, api_key=API_KEY, timeout=5.0)
        redis = await create_pool(RedisSettings(host="127.0.0.1", port=6379, database=ARQ_DB))
        try:
            await _run_jobs(tmp_path, gw.url, client, space, redis)
        finally:
            await redis.aclose()


async def _run_jobs(
    tmp_path: Path, gateway_url: str, client: httpx.AsyncClient, space: RedisSpace, redis: ArqRedis
) -> None:
    queue, kill_queue = space.key("queue"), space.key("kill")
    jobs: dict[str, tuple[str, Expected, bool]] = {}
    for n, (plan, want, success) in enumerate(PLANS):
        job_id = f"{space.token}-{n:02d}-{plan}"
        jobs[job_id] = (plan, want.for_job(job_id, "arq"), success)
        job = await gateway_arq.enqueue_job(
            redis,
            "work",
            plan,
            _job_id=job_id,
            _queue_name=kill_queue if plan == "kill" else queue,
            _gateway={"maxAttempts": MAX_TRIES, "heartbeatMs": LEASE_MS, "tags": ["queue:arq"]},
        )
        assert job is not None
    assert len(jobs) == 20
    by_plan = {plan: job_id for job_id, (plan, _, _) in jobs.items()}
    followed = Followed(client, gateway_url.replace("http://", "ws://"))
    kill_env = {"TG_TEST_JOB_TIMEOUT_S": str(KILL_QUEUE_TIMEOUT_S)}

    async with anyio.create_task_group() as tg:
        for job_id in jobs:
            await followed.follow(job_id, tg, WITHIN_S)
        async with (
            queue_workers(
                [
                    _worker("arq-kill-1", space, gateway_url, kill_queue, **kill_env),
                    _worker("arq-main", space, gateway_url, queue),
                ],
                tmp_path,
            ) as workers,
            anyio.create_task_group() as actions,
        ):
            killed = _worker("arq-kill-2", space, gateway_url, kill_queue, **kill_env)
            actions.start_soon(_kill_worker, followed, workers, by_plan["kill"], killed, tmp_path)
            actions.start_soon(_abort, followed, redis, by_plan["abort"], queue)
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

            async def results() -> dict[str, Any]:
                found = {}
                for job_id in jobs:
                    info = await Job(job_id, redis).result_info()
                    found[job_id] = None if info is None else info.success
                return found

            # The exhausted job ends at arq's next pick of it: max tries exceeded.
            seen = await eventually(
                results, lambda found: None not in found.values(), "arq ended every job", WITHIN_S
            )

    assert seen == {job_id: success for job_id, (_, _, success) in jobs.items()}
    await followed.check({job_id: want for job_id, (_, want, _) in jobs.items()})


async def _kill_worker(
    followed: Followed,
    workers: list[QueueWorker],
    job_id: str,
    again: tuple[str, list[str], dict[str, str]],
    directory: Path,
) -> None:
    """SIGKILL the worker running the job's first try once the gateway shows its progress, then start
    another on its queue (it runs the job once arq's in-progress key has expired)."""
    await followed.until(job_id, "attempt 1 at 20", lambda t: t["attempts"] == 1 and t["progress"] == 20)
    await workers[0].kill()
    workers.append(await start_worker(*again, directory))


async def _abort(followed: Followed, redis: ArqRedis, job_id: str, queue: str) -> None:
    await followed.until(job_id, "running at 10", lambda t: t["state"] == "running" and t["progress"] == 10)
    assert await Job(job_id, redis, _queue_name=queue).abort(timeout=30, poll_delay=0.1)


async def _cancel_on_gateway(followed: Followed, job_id: str) -> None:
    await followed.until(
        job_id, "running with progress", lambda t: t["state"] == "running" and t["progress"] > 0
    )
    await followed.cancel(job_id)
