"""The RQ jobs of tests/integration/test_rq.py, run by real ``rq worker`` processes. Importing it in a
worker installs the integration with the gateway the test started (its URL and key in the environment:
tests/support/queue_runs.py); the test process enqueues the jobs by name and never imports it.

``work(plan)`` does what ``plan`` says, counting its runs in Redis (``<token>:runs:<job id>``) so that a
job can behave differently on its second run:

- ``ok``: progress 25, 50, 75 (each with its row in ``job.meta``, saved: the task's metadata), then returns
  ``s3://results/<id>``; ``ok-dict`` returns a dict instead;
- ``retry``: first run progress 30, then raises; the second progress 60 and returns;
- ``again``: first run progress 30 and returns ``Retry(max=1)`` (RQ's asking to be run again); the second
  progress 60 and returns;
- ``fail``: progress 10 and raises ``ValueError``, every run;
- ``kill``: first run writes its pid (``<token>:pid:<job id>``), progress 20 and waits to be killed; the
  second progress 80 and returns;
- ``stop``: progress 10, then waits to be stopped (``send_stop_job_command``); ``slow``: the same, for
  the job's time limit;
- ``cancel``: progress that rises until the gateway's cancel makes ``progress()`` raise.

A waiting job gives up after ``WAIT_S`` (it fails, and so does its test).
"""

from __future__ import annotations

import os
import time
from typing import Any, cast

from redis import Redis
from rq import Retry, get_current_job

from gateway.integrations import rq as gateway_rq
from gateway.integrations.rq import progress, write

WAIT_S = 60.0
POLL_S = 0.05

if os.environ.get("TG_TEST_GATEWAY_URL"):
    gateway_rq.install(
        url=os.environ["TG_TEST_GATEWAY_URL"],
        api_key=os.environ["TG_TEST_GATEWAY_KEY"],
        min_interval=0.05,
        timeout=5.0,
    )


def _waiting(what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        time.sleep(POLL_S)  # the job stands in for one that works until something outside ends it
    raise TimeoutError(f"not {what} within {WAIT_S} s")


def work(plan: str) -> Any:
    job = get_current_job()
    assert job is not None
    redis: Redis = job.connection
    token = os.environ["TG_TEST_TOKEN"]
    run = int(cast(int, redis.incr(f"{token}:runs:{job.id}")))  # a sync client: an int
    if plan in ("ok", "ok-dict"):
        for value in (25, 50, 75):
            progress(value, cursor=f"row-{value}")
            job.meta.update({"rows": value, "message": f"row-{value}"})
            job.save_meta()  # type: ignore[no-untyped-call]  # merged into the task's metadata (GatewayJob)
            write("output", f"row-{value} ")
        return f"s3://results/{job.id}" if plan == "ok" else {"rows": 3, "job": job.id}
    if plan == "retry":
        if run == 1:
            progress(30)
            raise RuntimeError("flaky: the first run fails")
        progress(60)
        return f"s3://results/{job.id}"
    if plan == "again":
        if run == 1:
            progress(30)
            return Retry(max=1)
        progress(60)
        return f"s3://results/{job.id}"
    if plan == "fail":
        progress(10)
        raise ValueError(f"bad rows in run {run}")
    if plan == "kill":
        if run == 1:
            redis.set(f"{token}:pid:{job.id}", os.getpid())
            progress(20)
            _waiting("killed")
        progress(80)
        return f"s3://results/{job.id}"
    if plan in ("stop", "slow"):
        progress(10)
        _waiting("stopped" if plan == "stop" else "timed out")
    if plan == "cancel":
        deadline = time.monotonic() + WAIT_S
        value = 0
        while time.monotonic() < deadline:
            value = min(value + 1, 99)
            progress(value)  # raises TaskCancelled once the gateway said so
            time.sleep(POLL_S)
        raise TimeoutError("not cancelled")
    raise ValueError(f"unknown plan {plan!r}")
