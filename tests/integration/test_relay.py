"""The webhook relay (``GATEWAY_NOTIFY_URL``) as a receiver sees it: every terminal notification POSTed,
signed the Standard Webhooks way (each verified here with the ``standardwebhooks`` package), retried with
the same ``webhook-id`` until a 2xx, through a receiver that fails, hangs, or is killed and restarted;
independent of the drain; with two gateway processes on PostgreSQL, never sent by both at once.

Each receiver is a real HTTP server on loopback (tests/support/receiver.py), each gateway a real uvicorn
server.
"""

from __future__ import annotations

import base64
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from gateway.jobs.relay import webhook_id
from gateway.store.base import Notification
from tests.support import (
    GATEWAY_CLI,
    STEP_S,
    Running,
    create_task,
    drain_all,
    eventually,
    http_client,
    post_callback,
    postgres_database,
    running_gateway,
    wait_until,
)
from tests.support.history import History
from tests.support.processes import GatewayProcess, free_port, gateway_environ, gateway_processes
from tests.support.receiver import Receiver, Try, read_log, serving_receiver

pytestmark = pytest.mark.anyio

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
OTHER_SECRET = "whsec_" + base64.b64encode(bytes(range(1, 33))).decode()
# Quick retries, so that the tests run through several in a few seconds. Settings' keyword arguments, as
# running_gateway takes them (``**overrides: Any``). A try is given up on only past a step: the tests count
# tries, and a receiver slow to answer on a loaded machine (over a second, now and then) is answering, not
# lost (a try given up on is sent again). The tests of a receiver that hangs set their own timeout.
FAST: dict[str, Any] = {
    "notify_secret": SECRET,
    "notify_timeout_ms": int(STEP_S * 1000),
    "notify_retry_min_ms": 20,
    "notify_retry_max_ms": 300,
    "notify_poll_ms": 100,
}


async def finish(gw: Running | httpx.AsyncClient, task_id: str, outcome: str = "succeed") -> None:
    """Create a task and take it to its end: ``succeed``, ``fail`` (one attempt, so it is failed)."""
    created = await create_task(gw, task_id, max_attempts=1)
    token = created.callback_token
    await post_callback(gw, task_id, token, {"type": "start", "worker": "w"})
    event: dict[str, Any]
    if outcome == "succeed":
        event = {"type": "succeed", "resultRef": f"s3://r/{task_id}", "resultHash": "sha256:1"}
    else:
        event = {"type": "fail", "error": "boom", "retryable": False}
    await post_callback(gw, task_id, token, event)


def expected(item: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A drained notification as the relay sends it: its webhook-id and body."""
    notification = Notification(item["taskId"], item["state"], item["atMs"], item["version"])
    return webhook_id(notification), {"type": f"task.{item['state']}", **item}


def relay_metric(gw: Running, name: str, **labels: str) -> float:
    value = gw.gateway.metrics.registry.get_sample_value(name, labels)
    return float(value or 0.0)


async def relayed(gw: Running, count: int) -> None:
    """Wait until the gateway has read the 2xx of ``count`` tries: the receiver records a try before it
    answers, so the gateway counts it (and records it sent) a moment after the receiver has it. A gateway
    stopped in that moment gives the notification back, and the next one sends it again."""
    await wait_until(
        lambda: relay_metric(gw, "gateway_notifications_relayed_total") == count,
        lambda: f"{count} 2xx read by the relay ({relay_metric(gw, 'gateway_notifications_relayed_total')})",
    )


def assert_tries_are_one_notification_each(tries: list[Try]) -> None:
    """Every try verified; every try of one id carried the same body (a stable id per notification)."""
    assert tries and all(t.verified for t in tries), [t for t in tries if not t.verified][:3]
    bodies: dict[str, dict[str, Any]] = {}
    for t in tries:
        assert bodies.setdefault(t.msg_id, t.body) == t.body, (t.msg_id, bodies[t.msg_id], t.body)


async def test_each_notification_is_posted_signed_and_the_drain_still_gets_it(database_url: str) -> None:
    receiver = Receiver(SECRET)
    async with serving_receiver(receiver) as hook_url:
        async with running_gateway(database_url, notify_url=hook_url, **FAST) as gw:
            await finish(gw, "ok-1")
            await finish(gw, "bad-1", "fail")
            await receiver.until(lambda: len(receiver.delivered) == 2)
            await relayed(gw, 2)  # recorded as sent before this gateway stops: not sent again below
            drained = await drain_all(gw, 2)
        assert sorted(i["taskId"] for i in drained) == ["bad-1", "ok-1"]
        assert receiver.delivered == dict(expected(item) for item in drained)
        assert_tries_are_one_notification_each(receiver.tries)
        assert [t.status for t in receiver.tries] == [200, 200]  # marked sent: no second try
        # The signature is the receiver's proof: another secret, or a changed body, does not verify.
        first = receiver.tries[0]
        headers = {
            "webhook-id": first.msg_id,
            "webhook-timestamp": first.timestamp,
            "webhook-signature": first.signature,
        }
        raw = orjson.dumps(first.body)  # the bytes that were signed (orjson writes them the same way)
        Webhook(SECRET).verify(raw, headers)
        with pytest.raises(WebhookVerificationError):
            Webhook(OTHER_SECRET).verify(raw, headers)
        with pytest.raises(WebhookVerificationError):
            Webhook(SECRET).verify(raw.replace(b'"version":', b'"version":1'), headers)

        # A restart sends nothing again; a notification that was drained before the relay was on is
        # still relayed (independent consumers).
        async with running_gateway(database_url) as gw:
            await finish(gw, "before-relay")
            assert [i["taskId"] for i in (await gw.client.post("/v1/notifications/drain")).json()] == [
                "before-relay"
            ]
        async with running_gateway(database_url, notify_url=hook_url, **FAST) as gw:
            await finish(gw, "ok-2")
            await receiver.until(lambda: len(receiver.delivered) == 4)
            await relayed(gw, 2)
            assert [i["taskId"] for i in await drain_all(gw, 1)] == ["ok-2"]
    assert sorted(b["taskId"] for b in receiver.delivered.values()) == [
        "bad-1",
        "before-relay",
        "ok-1",
        "ok-2",
    ]
    assert len(receiver.tries) == 4


async def test_a_failing_receiver_gets_the_same_notification_until_it_answers_2xx(sqlite_url: str) -> None:
    async def fail_twice(msg_id: str, attempt: int) -> int:
        return 500 if attempt <= 2 else 204

    receiver = Receiver(SECRET, fail_twice)
    async with (
        serving_receiver(receiver) as hook_url,
        running_gateway(sqlite_url, notify_url=hook_url, **FAST) as gw,
    ):
        for i in range(10):
            await finish(gw, f"t{i}")
        await receiver.until(lambda: len(receiver.delivered) == 10)
        await relayed(gw, 10)
        assert relay_metric(gw, "gateway_notification_relay_failures_total", reason="5xx") == 20
    assert_tries_are_one_notification_each(receiver.tries)
    # Three tries of each, the last answered: once sent, never sent again.
    assert Counter(t.msg_id for t in receiver.tries) == {msg_id: 3 for msg_id in receiver.delivered}
    assert sorted(b["taskId"] for b in receiver.delivered.values()) == [f"t{i}" for i in range(10)]


async def test_a_receiver_that_hangs_is_given_up_on_and_tried_again(sqlite_url: str) -> None:
    release = anyio.Event()

    async def hang_first(msg_id: str, attempt: int) -> int:
        if attempt == 1:
            await release.wait()  # far past the relay's timeout
        return 200

    receiver = Receiver(SECRET, hang_first)
    async with serving_receiver(receiver) as hook_url:
        try:
            async with running_gateway(
                sqlite_url, notify_url=hook_url, **FAST | {"notify_timeout_ms": 300}
            ) as gw:
                for i in range(5):
                    await finish(gw, f"t{i}")
                await receiver.until(lambda: len(receiver.delivered) == 5)
                assert relay_metric(gw, "gateway_notification_relay_failures_total", reason="timeout") >= 5
        finally:
            release.set()
    assert_tries_are_one_notification_each(receiver.tries)


async def test_a_stopped_gateway_hands_back_what_it_was_sending(sqlite_url: str) -> None:
    """A graceful stop in the middle of a POST gives the notification back: the next start sends it at
    once, not after the hold (timeout + 5 s, here more than a minute) runs out."""
    release = anyio.Event()

    async def hang_first(msg_id: str, attempt: int) -> int:
        if attempt == 1:
            await release.wait()
        return 200

    receiver = Receiver(SECRET, hang_first)
    settings = FAST | {"notify_timeout_ms": 60_000}
    async with serving_receiver(receiver) as hook_url:
        try:
            async with running_gateway(sqlite_url, notify_url=hook_url, **settings) as gw:
                await finish(gw, "t1")
                await wait_until(
                    lambda: sum(receiver.active.values()) == 1, "the relay's first try held by the receiver"
                )
            async with running_gateway(sqlite_url, notify_url=hook_url, **settings):
                await receiver.until(lambda: len(receiver.delivered) == 1, within_s=20)
        finally:
            release.set()
    assert [b["taskId"] for b in receiver.delivered.values()] == ["t1"]


# --- a receiver killed and restarted ----------------------------------------------------------------------


@asynccontextmanager
async def receiver_process(port: int, log: Path, output: Path) -> AsyncIterator[GatewayProcess]:
    """tests/support/receiver.py as a process of its own on ``port``, serving when the block begins."""
    command = [
        sys.executable,
        "-m",
        "tests.support.receiver",
        "--port",
        str(port),
        "--secret",
        SECRET,
        "--log",
        str(log),
    ]
    with output.open("wb") as out:
        process = await anyio.open_process(
            command, stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2]
        )
    receiver = GatewayProcess(f"receiver:{port}", process, output)
    try:
        await receiver.serving()
        yield receiver
    finally:
        await receiver.stop()


async def test_every_notification_of_200_tasks_arrives_through_a_receiver_killed_twice(
    sqlite_url: str, tmp_path: Path
) -> None:
    """The acceptance test: 200 tasks end (succeeded, failed, expired) while the receiver is SIGKILLed
    and restarted twice; every notification arrives, each try verified by its signature, none missing.
    A try whose 2xx the kill cut off comes again (at least once): the receiver deduplicates by id."""
    port, log = free_port(), tmp_path / "received.jsonl"
    settings = FAST | {"notify_url": f"http://127.0.0.1:{port}/hooks", "notify_concurrency": 4}
    restarts = 0

    def delivered() -> set[str]:
        return {t.msg_id for t in read_log(log) if 200 <= t.status < 300} if log.exists() else set()

    async def until_delivered(count: int) -> None:
        await wait_until(
            lambda: len(delivered()) >= count,
            lambda: f"{count} notifications in the receiver's log ({len(delivered())})",
            within_s=60,
        )

    async def until_failures_grow(gw: Running, by: float) -> None:
        def failures() -> float:
            return relay_metric(gw, "gateway_notification_relay_failures_total", reason="connection")

        target = failures() + by
        await wait_until(
            lambda: failures() >= target,
            lambda: (
                f"{by:.0f} more refused tries of the relay (now {failures():.0f}, waiting for {target:.0f})"
            ),
            within_s=30,
        )

    async with running_gateway(sqlite_url, **settings) as gw:

        async def work(i: int) -> None:
            if i % 10 == 0:  # never started: the sweeper expires it
                await create_task(gw, f"task-{i:03d}", ttl_ms=500)
            else:
                await finish(gw, f"task-{i:03d}", "fail" if i % 4 == 0 else "succeed")

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_all(work, 200))
            for kill_after in (60, 130):
                async with receiver_process(port, log, tmp_path / f"receiver{restarts}.log") as process:
                    await until_delivered(kill_after)
                    await process.kill()
                restarts += 1
                # Down: the relay's tries fail (connection refused) and are retried with backoff.
                await until_failures_grow(gw, 3)
        async with receiver_process(port, log, tmp_path / "receiver-last.log"):
            await until_delivered(200)
            drained = await drain_all(gw, 200)

    tries = read_log(log)
    assert_tries_are_one_notification_each(tries)
    answered = [t for t in tries if 200 <= t.status < 300]
    by_id = {t.msg_id: t.body for t in answered}
    assert by_id == dict(expected(item) for item in drained)  # every notification, exactly its fields
    assert len(by_id) == 200 and restarts == 2
    assert Counter(b["state"] for b in by_id.values()) == {"succeeded": 140, "failed": 40, "expired": 20}
    # tests/support/history.py: at most one notification per terminal state, deduplicated by id
    seen = History()
    for t in answered:
        seen.notification(t.body, t.msg_id)
    for item in drained:
        seen.notification(item)
    seen.check()
    duplicates = len(answered) - len(by_id)
    print(f"200 notifications: {len(tries)} tries answered, {duplicates} duplicates (deduplicated by id)")


async def run_all(work: Any, count: int) -> None:
    async with anyio.create_task_group() as tg:
        limiter = anyio.CapacityLimiter(10)

        async def one(i: int) -> None:
            async with limiter:
                await work(i)

        for i in range(count):
            tg.start_soon(one, i)


# --- several processes on PostgreSQL ------------------------------------------------------------------------

RELAYED = "gateway_notifications_relayed_total "


@pytest.fixture
def postgres_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


@pytest.mark.postgres
async def test_two_processes_relay_each_notification_and_never_the_same_one_at_once(
    postgres_url: str, tmp_path: Path
) -> None:
    async def slow_and_failing_first(msg_id: str, attempt: int) -> int:
        await anyio.sleep(0.03)  # a receiver's own work, so that tries last long enough to overlap
        return 503 if attempt == 1 else 200

    receiver = Receiver(SECRET, slow_and_failing_first)
    async with serving_receiver(receiver) as hook_url:
        env = {
            "GATEWAY_NOTIFY_URL": hook_url,
            "GATEWAY_NOTIFY_SECRET": SECRET,
            "GATEWAY_NOTIFY_RETRY_MIN_MS": "20",
            "GATEWAY_NOTIFY_RETRY_MAX_MS": "200",
            "GATEWAY_NOTIFY_POLL_MS": "50",
        }
        async with gateway_processes(2, postgres_url, tmp_path, env=env) as gateways:
            clients = [http_client(base_url=gw.url, timeout=30) for gw in gateways]
            try:

                async def work(i: int) -> None:
                    await finish(clients[i % 2], f"pg-{i:03d}", "fail" if i % 3 == 0 else "succeed")

                await run_all(work, 100)
                await receiver.until(lambda: len(receiver.delivered) == 100, within_s=60)

                async def counts() -> list[float]:
                    found = []
                    for client in clients:
                        text = (await client.get("/metrics")).text
                        (line,) = [x for x in text.splitlines() if x.startswith(RELAYED)]
                        found.append(float(line.split()[-1]))
                    return found

                # The gateways count a 2xx a moment after the receiver sent it.
                relayed = await eventually(
                    counts, lambda found: sum(found) >= 100, "both gateways' relayed counts adding up to 100"
                )
                drained = await drain_all(clients[0], 100)
            finally:
                for client in clients:
                    await client.aclose()
    assert receiver.overlaps == []  # no id was POSTed by both processes (or twice by one) at once
    assert_tries_are_one_notification_each(receiver.tries)
    assert receiver.delivered == dict(expected(item) for item in drained)
    assert all(n > 0 for n in relayed), relayed  # both processes relayed


# --- configuration -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"GATEWAY_NOTIFY_URL": "http://127.0.0.1:9/hooks"}, "GATEWAY_NOTIFY_SECRET is not"),
        ({"GATEWAY_NOTIFY_URL": "http://127.0.0.1:9/", "GATEWAY_NOTIFY_SECRET": "s3cret"}, "whsec_"),
        ({"GATEWAY_NOTIFY_URL": "http://127.0.0.1:9/", "GATEWAY_NOTIFY_SECRET": "whsec_!!"}, "base64"),
        ({"GATEWAY_NOTIFY_URL": "http://127.0.0.1:9/", "GATEWAY_NOTIFY_SECRET": "whsec_AAAA"}, "24 to 64"),
        ({"GATEWAY_NOTIFY_URL": "ftp://x/", "GATEWAY_NOTIFY_SECRET": SECRET}, "GATEWAY_NOTIFY_URL"),
    ],
)
async def test_a_relay_without_a_usable_secret_is_refused_at_start_in_one_line(
    env: dict[str, str], says: str, tmp_path: Path
) -> None:
    result = await anyio.run_process(
        [*GATEWAY_CLI, "serve", "--database-url", f"sqlite:///{tmp_path / 'g.db'}"],
        env=gateway_environ(env),
        check=False,
    )
    output = result.stderr.decode()
    assert result.returncode == 2, output
    assert output.count("\n") == 1 and output.startswith("gateway: ") and says in output, output
    assert "s3cret" not in output  # a secret never prints
