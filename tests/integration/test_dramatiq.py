"""Dramatiq messages on the gateway (gateway.integrations.dramatiq), end to end: two real ``dramatiq``
worker processes on this machine's Redis (db 12, a broker namespace and queue of this test's own), a real
gateway, 20 messages among which some are retried, some fail for good, one hits its time limit, one is
cancelled on the gateway and one whose worker process is SIGKILLed mid-run (a 2 s lease): every gateway task
ends as Dramatiq ended its message (done, or dead-lettered), with its attempts, its progress entries rising
and its result; the killed one is run again, once the broker took its worker for dead, as a new attempt; a
subscriber of each saw it without a gap; the history checker passes.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, cast

import anyio
import dramatiq
import pytest
from dramatiq.brokers.redis import RedisBroker
from redis import Redis

from gateway.integrations import dramatiq as gateway_dramatiq
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

# (plan, the message's max_retries, what the gateway task ends as, whether Dramatiq dead-letters it)
# What an ``ok`` job leaves: its title (its name and argument) and its metadata.
OK_SHOWN: dict[str, Any] = {"output": OK_OUTPUT, "metadata": OK_METADATA, "title": "work('ok')"}
OK_DICT_SHOWN: dict[str, Any] = {**OK_SHOWN, "title": "work('ok-dict')"}

PLANS: list[tuple[str, int, Expected, bool]] = [
    ("kill", 1, Expected("succeeded", 2, "heartbeat-timeout", result_ref="", last_progress=(20, 80)), False),
    ("cancel", 1, Expected("failed", 1, "cancelled", cancelled=True), True),
    ("slow", 0, Expected("failed", 1, "TimeLimitExceeded", last_progress=(10,)), True),
    *[
        (
            "ok",
            n % 2,
            Expected("succeeded", 1, result_ref="", last_progress=(75,), **OK_SHOWN),
            False,
        )
        for n in range(7)
    ],
    *[
        (
            "ok-dict",
            1,
            Expected("succeeded", 1, result_ref="dramatiq", last_progress=(75,), **OK_DICT_SHOWN),
            False,
        )
    ]
    * 2,
    *[
        (
            "retry",
            1,
            Expected("succeeded", 2, "RuntimeError: flaky", result_ref="", last_progress=(30, 60)),
            False,
        )
    ]
    * 3,
    ("retry", 0, Expected("failed", 1, "RuntimeError: flaky", last_progress=(30,)), True),
    *[("fail", 1, Expected("failed", 2, "ValueError: bad rows in run 2", last_progress=(10, 10)), True)] * 3,
    ("fail", 0, Expected("failed", 1, "ValueError: bad rows in run 1", last_progress=(10,)), True),
]


def _work(plan: str) -> None:
    """The producer's declaration of the workers' actor (tests/jobs/dramatiq_actors.py): its name and
    queue."""


def _worker(name: str, space: RedisSpace, gateway_url: str) -> tuple[str, list[str], dict[str, str]]:
    argv = ["-m", "dramatiq", "tests.jobs.dramatiq_actors", "--processes", "1", "--threads", "2"]
    return name, argv, worker_environ(gateway_url, space, space.token)


def _dead_lettered(redis: Redis, space: RedisSpace) -> set[str]:
    """The ids of the messages Dramatiq dead-lettered (failed for good)."""
    key = f"dramatiq-{space.token}:{space.token}.XQ.msgs"
    encoded = cast(dict[bytes, bytes], redis.hgetall(key))
    return {json.loads(m)["message_id"] for m in encoded.values()}


@pytest.mark.anyio
async def test_dramatiq_messages_end_on_the_gateway_as_dramatiq_ended_them(
    tmp_path: Path, sqlite_url: str
) -> None:
    async with (
        running_gateway(sqlite_url, api_key=API_KEY) as gw,
        redis_space(RQ_DB) as space,
        http_client(base_url=gw.url, headers=gateway_headers(), timeout=30) as client,
    ):
        redis = Redis.from_url(space.url)
        # The producer's broker: the workers' namespace and queue, the actor declared by name only.
        broker = RedisBroker(url=space.url, namespace=f"dramatiq-{space.token}")  # type: ignore[no-untyped-call]
        gateway_dramatiq.install(broker, url=gw.url, api_key=API_KEY, timeout=5.0)
        actor = dramatiq.actor(actor_name="work", queue_name=space.token, broker=broker)(_work)
        messages: dict[str, tuple[str, Expected, bool]] = {}
        for plan, retries, want, dead in PLANS:
            # The slow one's time limit (ms); None: Dramatiq's (10 minutes).
            limit = 1_000 if plan == "slow" else None

            def publish(plan: str = plan, retries: int = retries, limit: int | None = limit) -> Any:
                return actor.send_with_options(
                    args=(plan,),
                    max_retries=retries,
                    time_limit=limit,
                    gateway={"heartbeatMs": LEASE_MS, "tags": ["queue:dramatiq"]},
                )

            message = await anyio.to_thread.run_sync(publish)
            messages[message.message_id] = (plan, want.for_job(message.message_id, "dramatiq"), dead)
        assert len(messages) == 20
        by_plan = {plan: message_id for message_id, (plan, _, _) in messages.items()}
        followed = Followed(client, gw.url.replace("http://", "ws://"))

        async with anyio.create_task_group() as tg:
            for message_id in messages:
                await followed.follow(message_id, tg, WITHIN_S)
            async with (
                queue_workers([_worker("dq1", space, gw.url), _worker("dq2", space, gw.url)], tmp_path),
                anyio.create_task_group() as actions,
            ):
                actions.start_soon(_kill_worker_process, followed, space, redis, by_plan["kill"])
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
                failed = {message_id for message_id, (_, _, dead) in messages.items() if dead}
                dead_lettered = await eventually(
                    lambda: anyio.to_thread.run_sync(_dead_lettered, redis, space),
                    lambda found: found == failed,
                    "Dramatiq dead-lettered the failed messages",
                    WITHIN_S,
                )

        assert dead_lettered == failed
        await followed.check({message_id: want for message_id, (_, want, _) in messages.items()})
        broker.close()
        redis.close()


async def _kill_worker_process(followed: Followed, space: RedisSpace, redis: Redis, message_id: str) -> None:
    """SIGKILL the worker process running the message's first run, once the gateway shows its progress."""
    await followed.until(message_id, "attempt 1 at 20", lambda t: t["attempts"] == 1 and t["progress"] == 20)
    pid = cast(bytes | None, await anyio.to_thread.run_sync(redis.get, space.key("pid", message_id)))
    assert pid is not None
    os.kill(int(pid), signal.SIGKILL)


async def _cancel_on_gateway(followed: Followed, message_id: str) -> None:
    await followed.until(
        message_id, "running with progress", lambda t: t["state"] == "running" and t["progress"] > 0
    )
    await followed.cancel(message_id)
