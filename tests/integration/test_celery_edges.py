"""Celery's other ways to end a task, on a real prefork worker, on RabbitMQ and on Redis: a hard time limit
(the pool process is killed; Celery calls the task failed from the worker's main process, or puts its
message back in the queue), a soft time limit (an exception in the task: failed, or retried by autoretry),
``raise Ignore()`` (with and without a result the task stored itself, or reported through its run) and
``raise Reject(requeue=...)`` (dead-lettered, or run again). Each gateway task ends as Celery ended it,
instead of staying ``running`` until its lease or its deadline.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from gateway.integrations.celery import uninstall
from gateway.integrations.ticket import result_hash
from gateway.machine import TERMINAL
from tests.jobs.celery_tasks import HARD_LIMIT_S
from tests.support import bearer, eventually, http_client
from tests.support.celery_processes import (
    API_KEY,
    Broker,
    celery_worker,
    keyed_gateway,
    publishing_app,
    rabbitmq_broker,
    read_history,
    redis_broker,
)

LEASE_MS = 2000
# Every task at its end: the time limits (seconds) and a loaded machine's slack.
ENDED_S = 90.0


async def _histories(client: httpx.AsyncClient, ids: dict[str, str]) -> dict[str, dict[str, Any]]:
    return {name: await read_history(client, task_id) for name, task_id in ids.items()}


def _all_ended(histories: dict[str, dict[str, Any]]) -> bool:
    return all(h["task"]["state"] in TERMINAL for h in histories.values())


def _runs(history: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The events of each attempt (cut at each ``start``)."""
    runs: list[list[dict[str, Any]]] = []
    for entry in history["events"]:
        if entry["event"]["type"] == "start":
            runs.append([])
        if runs:
            runs[-1].append(entry["event"])
    return runs


def _shape(history: dict[str, Any]) -> list[list[str]]:
    return [[e["type"] for e in run] for run in _runs(history)]


@pytest.fixture(params=["rabbitmq", "redis"])
def broker(request: pytest.FixtureRequest) -> Iterator[Broker]:
    with rabbitmq_broker() if request.param == "rabbitmq" else redis_broker() as made:
        yield made


@pytest.mark.anyio
async def test_time_limits_ignore_and_reject_end_the_gateway_task_as_celery_ends_it(
    broker: Broker, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    async with (
        keyed_gateway(tmp_path) as gw,
        http_client(base_url=gw.url, headers=bearer(API_KEY), timeout=30) as client,
        celery_worker(broker, gw.url, shared),
    ):
        app = publishing_app(broker, gw.url, shared)

        def publish() -> dict[str, str]:
            sent = {
                "hard": app.signature("tg.hard_limit").apply_async((10,)),
                "hard_requeued": app.signature("tg.hard_limit_requeued").apply_async(
                    (15,), headers={"gateway": {"heartbeatMs": LEASE_MS}}
                ),
                "soft": app.signature("tg.soft_limit").apply_async((20,)),
                "soft_retried": app.signature("tg.soft_limit_retried").apply_async((30,)),
                "ignored": app.signature("tg.ignored").apply_async((40, None)),
                "ignored_stored": app.signature("tg.ignored").apply_async((50, {"rows": 3})),
                "ignored_reported": app.signature("tg.ignored").apply_async(
                    (55, None, "s3://reported/itself")
                ),
                "dead": app.signature("tg.rejected").apply_async((60, False)),
                "requeued": app.signature("tg.rejected").apply_async((70, True)),
            }
            return {name: str(result.id) for name, result in sent.items()}

        try:
            ids = await anyio.to_thread.run_sync(publish)
            ended = await eventually(
                partial(_histories, client, ids), _all_ended, "every task at its end", ENDED_S
            )
        finally:
            uninstall(app)
            app.close()

    def task(name: str) -> dict[str, Any]:
        return dict(ended[name]["task"])

    # A hard time limit: the pool process is killed, the worker's main process calls the task failed.
    hard = task("hard")
    assert (hard["state"], hard["attempts"]) == ("failed", 1), hard
    assert hard["error"] == f"TimeLimitExceeded: hard time limit ({HARD_LIMIT_S} s) exceeded", hard
    assert _shape(ended["hard"]) == [["start", "progress", "fail"]], ended["hard"]["events"]
    # Unless Celery puts the message back in the queue (and sends no task_failure): the lease requeues the
    # attempt, the second run is the next attempt.
    again = ended["hard_requeued"]
    assert (again["task"]["state"], again["task"]["attempts"]) == ("succeeded", 2), again["task"]
    assert _shape(again) == [["start", "progress", "fail"], ["start", "progress", "succeed"]], again
    first = _runs(again)[0][-1]
    assert (first["error"], first["retryable"]) == ("heartbeat-timeout", True), first
    # A soft one: the exception it raises in the task, failed for good, or retried by autoretry.
    soft = task("soft")
    assert (soft["state"], soft["attempts"]) == ("failed", 1), soft
    assert soft["error"] == "SoftTimeLimitExceeded: soft time limit exceeded", soft
    retried = task("soft_retried")
    assert (retried["state"], retried["attempts"]) == ("succeeded", 2), retried
    first = _runs(ended["soft_retried"])[0][-1]
    assert (first["type"], first["retryable"]) == ("fail", True), first
    assert first["error"] == "SoftTimeLimitExceeded: soft time limit exceeded", first
    # Ignore: Celery records nothing and runs it no more. What the task stored itself is its end, else the
    # task is cancelled ("ignored").
    ignored = ended["ignored"]
    assert (ignored["task"]["state"], ignored["task"]["error"]) == ("failed", "cancelled"), ignored["task"]
    assert _shape(ignored) == [["start", "progress", "cancel"]], ignored["events"]
    assert ignored["events"][-1]["event"].get("reason") == "ignored", ignored["events"][-1]
    stored = task("ignored_stored")
    assert stored["state"] == "succeeded", stored
    assert (stored["resultRef"], stored["resultHash"]) == (
        f"celery://{ids['ignored_stored']}",
        result_hash({"rows": 3}),
    )
    reported = task("ignored_reported")
    assert (reported["state"], reported["resultRef"]) == ("succeeded", "s3://reported/itself"), reported
    # Reject: dead-lettered, a final fail; put back in the queue, a retryable fail and a second run.
    dead = task("dead")
    assert (dead["state"], dead["attempts"]) == ("failed", 1), dead
    assert dead["error"] == f"Reject: rejected {ids['dead']}", dead
    requeued = task("requeued")
    assert (requeued["state"], requeued["attempts"]) == ("succeeded", 2), requeued
    assert requeued["resultRef"] == f"s3://requeued/{ids['requeued']}", requeued
    assert _shape(ended["requeued"]) == [["start", "progress", "fail"], ["start", "progress", "succeed"]]
    first = _runs(ended["requeued"])[0][-1]
    assert (first["error"], first["retryable"]) == (f"Reject: rejected {ids['requeued']}", True), first
