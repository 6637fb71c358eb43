"""The Dramatiq actors of tests/integration/test_dramatiq.py, run by real ``dramatiq`` worker processes.
The broker lives in Redis db 12 under a namespace of the test's own (its token), and is installed with the
integration for the gateway the test started (its URL and key in the environment:
tests/support/queue_runs.py). The test process imports this module too, as the producer.

``work(plan)`` does what ``plan`` says, counting its runs in Redis (``<token>:runs:<message id>``):
``ok``, ``ok-dict``, ``retry``, ``fail``, ``kill`` (its pid in ``<token>:pid:<message id>``), ``slow`` and
``cancel``, as in tests/jobs/rq_jobs.py.
"""

from __future__ import annotations

import os
import time
from typing import Any, cast

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import CurrentMessage
from redis import Redis

from gateway.client.errors import TaskCancelled
from gateway.integrations import dramatiq as gateway_dramatiq
from gateway.integrations.dramatiq import metadata, progress, write

WAIT_S = 60.0
POLL_S = 0.05
URL = "redis://127.0.0.1:6379/12"
TOKEN = os.environ.get("TG_TEST_TOKEN", "tg-none")
# A broker whose heartbeat is this old is taken for dead (its messages requeued) at the next maintenance,
# which every command does here.
HEARTBEAT_TIMEOUT_MS = 3_000

broker = RedisBroker(  # type: ignore[no-untyped-call]  # dramatiq's RedisBroker.__init__ has no annotations
    url=URL,
    namespace=f"dramatiq-{TOKEN}",
    heartbeat_timeout=HEARTBEAT_TIMEOUT_MS,
    maintenance_chance=1_000_000,
)
broker.add_middleware(CurrentMessage())
dramatiq.set_broker(broker)
if os.environ.get("TG_TEST_GATEWAY_URL"):
    gateway_dramatiq.install(
        broker,
        url=os.environ["TG_TEST_GATEWAY_URL"],
        api_key=os.environ["TG_TEST_GATEWAY_KEY"],
        min_interval=0.05,
        timeout=5.0,
    )
redis = Redis.from_url(URL)


def _waiting(what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        time.sleep(POLL_S)  # the actor stands in for one that works until something outside ends it
    raise TimeoutError(f"not {what} within {WAIT_S} s")


@dramatiq.actor(queue_name=TOKEN, max_retries=0, min_backoff=10, max_backoff=100, throws=(TaskCancelled,))
def work(plan: str) -> Any:
    message = CurrentMessage.get_current_message()
    assert message is not None
    message_id = message.message_id
    run = int(cast(int, redis.incr(f"{TOKEN}:runs:{message_id}")))
    if plan in ("ok", "ok-dict"):
        for value in (25, 50, 75):
            progress(value, cursor=f"row-{value}")
            metadata({"rows": value})
            gateway_dramatiq.message(f"row-{value}")  # the status line
            write("output", f"row-{value} ")
        return f"s3://results/{message_id}" if plan == "ok" else {"rows": 3, "job": message_id}
    if plan == "retry":
        if run == 1:
            progress(30)
            raise RuntimeError("flaky: the first run fails")
        progress(60)
        return f"s3://results/{message_id}"
    if plan == "fail":
        progress(10)
        raise ValueError(f"bad rows in run {run}")
    if plan == "kill":
        if run == 1:
            redis.set(f"{TOKEN}:pid:{message_id}", os.getpid())
            progress(20)
            _waiting("killed")
        progress(80)
        return f"s3://results/{message_id}"
    if plan == "slow":
        progress(10)
        _waiting("timed out")
    if plan == "cancel":
        deadline = time.monotonic() + WAIT_S
        value = 0
        while time.monotonic() < deadline:
            value = min(value + 1, 99)
            progress(value)  # raises TaskCancelled once the gateway said so
            time.sleep(POLL_S)
        raise TimeoutError("not cancelled")
    raise ValueError(f"unknown plan {plan!r}")
