"""The arq jobs of tests/integration/test_arq.py, run by real ``arq`` worker processes
(``arq tests.jobs.arq_jobs.WorkerSettings``). The settings read this test's queue name and gateway from the
environment (tests/support/queue_runs.py) and are installed with the integration at import.

``work(plan)`` does what ``plan`` says, counting its tries in Redis (``<token>:runs:<job id>``):

- ``ok``: progress 25, 50, 75 (each with its row in the task's metadata and status line), then returns
  ``s3://results/<id>``; ``ok-dict`` returns a dict instead;
- ``retry``: first try progress 30 and ``raise Retry``; the second progress 60 and returns;
- ``retry-fail``: first try progress 30 and ``raise Retry``; the second progress 10 and raises;
- ``exhaust``: progress 10 and ``raise Retry``, every try (arq gives up after ``max_tries``);
- ``fail``: progress 10 and raises ``ValueError``;
- ``kill``: first try progress 20 and waits for its worker to be killed; the second progress 80 and
  returns;
- ``abort``: progress 10, then waits for ``Job.abort()``; ``slow``: the same, for arq's time limit;
- ``cancel``: progress that rises until the gateway's cancel makes ``progress()`` raise;
- ``outlive``: progress 10 to 50, then waits for the test's go (the test stops the worker past the lease
  meanwhile), then progress 60 to 100 and returns.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, ClassVar

from arq import Retry
from arq.connections import RedisSettings

from gateway.integrations import arq as gateway_arq
from gateway.integrations.arq import message, metadata, progress, write

WAIT_S = 60.0
POLL_S = 0.05
MAX_TRIES = 2
# A try's time limit, and so (plus arq's 10 s) how long a killed worker's job waits for its next try: the
# test gives the workers of the killed job's queue a short one.
JOB_TIMEOUT_S = int(os.environ.get("TG_TEST_JOB_TIMEOUT_S", "60"))


async def _waiting(what: str) -> None:
    await asyncio.sleep(WAIT_S)  # the job stands in for one that works until something outside ends it
    raise TimeoutError(f"not {what} within {WAIT_S} s")


async def work(ctx: dict[str, Any], plan: str) -> Any:
    job_id = ctx["job_id"]
    token = os.environ["TG_TEST_TOKEN"]
    run = int(await ctx["redis"].incr(f"{token}:runs:{job_id}"))
    if plan in ("ok", "ok-dict"):
        for value in (25, 50, 75):
            await progress(value, cursor=f"row-{value}")
            await metadata({"rows": value})
            await message(f"row-{value}")
            await write("output", f"row-{value} ")
        return f"s3://results/{job_id}" if plan == "ok" else {"rows": 3, "job": job_id}
    if plan in ("retry", "retry-fail"):
        if run == 1:
            await progress(30)
            raise Retry(defer=0)
        if plan == "retry-fail":
            await progress(10)
            raise ValueError("bad rows in the second try")
        await progress(60)
        return f"s3://results/{job_id}"
    if plan == "exhaust":
        await progress(10)
        raise Retry(defer=0)
    if plan == "fail":
        await progress(10)
        raise ValueError(f"bad rows in try {run}")
    if plan == "kill":
        if run == 1:
            await progress(20)
            await _waiting("killed")
        await progress(80)
        return f"s3://results/{job_id}"
    if plan == "outlive":
        # Says where it is (its pid under <token>:at:<job id>) and waits for the test's go (<token>:go:<job
        # id>: the test stops this process meanwhile, past the task's lease).
        for value in (10, 20, 30, 40, 50):
            await progress(value, cursor=f"row-{value}")
        await ctx["redis"].set(f"{token}:at:{job_id}", os.getpid())
        for _ in range(int(WAIT_S / POLL_S)):
            if await ctx["redis"].exists(f"{token}:go:{job_id}"):
                break
            await asyncio.sleep(POLL_S)
        for value in (60, 70, 80, 90, 100):
            await progress(value, cursor=f"row-{value}")
        return f"s3://results/{job_id}"
    if plan in ("abort", "slow"):
        await progress(10)
        await _waiting("aborted" if plan == "abort" else "timed out")
    if plan == "cancel":
        value = 0
        for _ in range(int(WAIT_S / POLL_S)):
            value = min(value + 1, 99)
            await progress(value)  # raises TaskCancelled once the gateway said so
            await asyncio.sleep(POLL_S)
        raise TimeoutError("not cancelled")
    raise ValueError(f"unknown plan {plan!r}")


class WorkerSettings:
    functions: ClassVar[list[Any]] = [work]
    queue_name = os.environ.get("TG_TEST_QUEUE", "arq:queue")
    redis_settings = RedisSettings(host="127.0.0.1", port=6379, database=13)
    max_tries = MAX_TRIES
    job_timeout = JOB_TIMEOUT_S
    allow_abort_jobs = True
    max_jobs = 4
    poll_delay = 0.1
    keep_result = 60


if os.environ.get("TG_TEST_GATEWAY_URL"):
    gateway_arq.install(
        WorkerSettings,
        url=os.environ["TG_TEST_GATEWAY_URL"],
        api_key=os.environ["TG_TEST_GATEWAY_KEY"],
        min_interval=0.05,
        timeout=5.0,
    )
