"""Celery on the gateway, on RabbitMQ and on Redis, with a real prefork worker of 2 (issue 19's acceptance).

50 tasks: 31 that succeed, 10 that retry once (5 by ``self.retry()``, 5 by autoretry), 5 that fail for good,
3 revoked while running, and one whose pool process is SIGKILLed mid-task (``acks_late``,
``task_reject_on_worker_lost``, a 2 s lease). Every gateway task ends as Celery ended it (its result
backend's state), with its attempts, its progress entries in order and its result; the killed one is
finished by a second run as a new attempt, after its lease requeued the task; a subscriber of each (over
its own socket, from version 0, with a tag token) saw it gapless; the history checker passes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import anyio
import httpx
import pytest
from celery import Celery
from redis import Redis

from gateway.integrations.celery import uninstall
from gateway.integrations.ticket import result_hash
from gateway.machine import TERMINAL
from tests.jobs.celery_tasks import make_app
from tests.support import bearer, eventually, http_client, mint_tag
from tests.support.celery_processes import (
    API_KEY,
    Broker,
    celery_worker,
    keyed_gateway,
    publishing_app,
    rabbitmq_broker,
    read_history,
    read_task,
    redis_broker,
)
from tests.support.history import History
from tests.support.processes import SECRET, ResumingSubscriber, free_port

# The whole scenario's bound: every task at its end (a loaded machine included).
SCENARIO_S = 240.0
LEASE_MS = 2000
# How long Celery may take to store a result the gateway already has.
STORED_S = 10.0
CELERY_STATE = {"succeeded": "SUCCESS", "failed": "FAILURE", "cancelled": "REVOKED"}


@dataclass
class Expected:
    """What a task must end as: its state (``cancelled`` for a revoked one), and each attempt's events in
    order, as ``(type, last progress reported in the attempt, outcome fields)``."""

    kind: str
    state: str
    attempts: list[tuple[int | None, dict[str, Any]]]
    result: Any = None
    task_id: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(params=["rabbitmq", "redis"])
def broker(request: pytest.FixtureRequest) -> Iterator[Broker]:
    with rabbitmq_broker() if request.param == "rabbitmq" else redis_broker() as made:
        yield made


def _publish(app: Celery) -> dict[str, Expected]:
    """Publish the 50 tasks (those that hold a pool process first, so the test acts on them early)."""
    plan: dict[str, Expected] = {}

    def sent(result: Any, expected: Expected) -> None:
        expected.task_id = str(result.id)
        plan[expected.task_id] = expected

    for _ in range(3):
        sent(app.signature("tg.hold").apply_async((10,)), Expected("hold", "cancelled", [(10, {})]))
    victim = app.signature("tg.victim").apply_async(
        ([10, 20], [30, 60]), headers={"gateway": {"heartbeatMs": LEASE_MS}}
    )
    killed = {"type": "fail", "error": "heartbeat-timeout", "retryable": True}
    sent(victim, Expected("victim", "succeeded", [(20, killed), (60, {"type": "succeed"})]))
    for _ in range(5):
        r = app.signature("tg.retry_once").apply_async(([20, 40],))
        first = {"type": "fail", "error": "ValueError: flaky first run", "retryable": True}
        sent(r, Expected("retry", "succeeded", [(40, first), (40, {"type": "succeed"})]))
    for _ in range(5):
        r = app.signature("tg.autoretry_once").apply_async(([25, 50],))
        first = {"type": "fail", "error": "Flaky: first run", "retryable": True}
        sent(r, Expected("autoretry", "succeeded", [(50, first), (50, {"type": "succeed"})]))
    for _ in range(5):
        r = app.signature("tg.doomed").apply_async(([15, 30],))
        sent(r, Expected("doomed", "failed", [(30, {"type": "fail", "retryable": False})]))
    for i in range(31):
        value: Any = f"s3://reports/{i}.pdf" if i % 2 == 0 else {"rows": i, "name": f"r{i}"}
        r = app.signature("tg.steps").apply_async(([10, 30, 50, 70, 90], value))
        sent(r, Expected("steps", "succeeded", [(90, {"type": "succeed"})], result=value))
    return plan


def _attempts(entries: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The history's events cut at each ``start``."""
    runs: list[list[dict[str, Any]]] = []
    for entry in entries:
        event = entry["event"]
        if event["type"] == "start":
            runs.append([])
        if runs:
            runs[-1].append(event)
    return runs


def _check_task(expected: Expected, task: dict[str, Any], entries: list[dict[str, Any]]) -> list[str]:
    """What differs between the task's end and history and what Celery did with it."""
    problems: list[str] = []
    where = f"{expected.kind} {expected.task_id}"
    if expected.state == "cancelled":
        if (task["state"], task.get("error")) != ("failed", "cancelled") or entries[-1]["event"][
            "type"
        ] != "cancel":
            problems.append(f"{where}: not cancelled: {task}")
    elif task["state"] != expected.state:
        problems.append(f"{where}: {task['state']}, expected {expected.state}: {task}")
    runs = _attempts(entries)
    if len(runs) != len(expected.attempts) or task["attempts"] != len(expected.attempts):
        problems.append(
            f"{where}: {task['attempts']} attempts, {len(runs)} starts; expected {len(expected.attempts)}"
        )
        return problems
    for n, (run, (last, outcome)) in enumerate(zip(runs, expected.attempts, strict=True), 1):
        values = [e["progress"] for e in run if e["type"] == "progress"]
        if values != sorted(set(values)) or (last is not None and (not values or values[-1] != last)):
            problems.append(f"{where}: attempt {n} progress {values}, expected rising to {last}")
        if not run[0]["worker"].startswith("w1@"):
            problems.append(f"{where}: attempt {n} started by {run[0]['worker']!r}")
        if outcome:
            ended = run[-1]
            if any(ended.get(k) != v for k, v in outcome.items()):
                problems.append(f"{where}: attempt {n} ended with {ended}, expected {outcome}")
    if expected.kind == "doomed" and task.get("error") != f"RuntimeError: doomed {expected.task_id}":
        problems.append(f"{where}: error {task.get('error')!r}")
    if expected.kind == "steps":
        value = expected.result
        ref = value if isinstance(value, str) else f"celery://{expected.task_id}"
        if (task.get("resultRef"), task.get("resultHash")) != (ref, result_hash(value)):
            problems.append(
                f"{where}: result {task.get('resultRef')} {task.get('resultHash')}, expected {ref}"
            )
    if expected.kind in ("retry", "autoretry", "victim") and not str(task.get("resultRef")).endswith(
        expected.task_id
    ):
        problems.append(f"{where}: result {task.get('resultRef')}")
    return problems


@pytest.mark.anyio
async def test_celery_tasks_end_on_the_gateway_as_celery_ended_them(broker: Broker, tmp_path: Path) -> None:
    tag = f"run:{uuid.uuid4().hex[:12]}"
    shared = tmp_path / "shared"
    shared.mkdir()
    history = History()
    async with (
        keyed_gateway(tmp_path) as gw,
        http_client(base_url=gw.url, headers=bearer(API_KEY), timeout=30) as client,
    ):
        app = publishing_app(broker, gw.url, shared, tags=(tag,))
        try:
            plan = await anyio.to_thread.run_sync(_publish, app)
            assert len(plan) == 50
            # Published, so created (version 0, queued) before any worker runs: each subscriber from there.
            subscribers: list[ResumingSubscriber] = []
            token = mint_tag(tag, secret=SECRET)
            for task_id in plan:
                answer = await client.get(f"/v1/tasks/{task_id}")
                assert answer.status_code == 200, answer.text
                base = answer.json()
                assert (base["version"], base["state"], base["tags"]) == (0, "queued", [tag]), base
                history.created(base)
                subscribers.append(
                    ResumingSubscriber(
                        gw.ws_url, task_id, token, base, history=history, name=f"sub-{task_id}"
                    )
                )
            async with anyio.create_task_group() as tg:
                for sub in subscribers:
                    tg.start_soon(sub.run, SCENARIO_S + 30)
                with anyio.fail_after(30):
                    for sub in subscribers:
                        await sub.ready.wait()
                async with celery_worker(broker, gw.url, shared, tags=(tag,)):
                    await _drive(app, client, plan, shared)
            for sub in subscribers:
                final = await read_history(client, sub.task_id)
                history.final(sub.task_id, final)
                sub.assert_final(final["task"])
            history.check()
            problems: list[str] = []
            for task_id, expected in plan.items():
                final = await read_history(client, task_id)
                problems += _check_task(expected, final["task"], final["events"])
                if expected.kind == "steps":  # what the task wrote, each write once, before its succeed
                    text = (await client.get(f"/v1/tasks/{task_id}/streams/output/text")).text
                    if text != "at-10 at-30 at-50 at-70 at-90 ":
                        problems.append(f"steps {task_id}: output {text!r}")
            problems += await anyio.to_thread.run_sync(_celery_states, broker, plan)
            assert not problems, "\n".join(problems[:40])
        finally:
            uninstall(app)
            app.close()


async def _drive(app: Celery, client: httpx.AsyncClient, plan: dict[str, Expected], shared: Path) -> None:
    """Revoke each holding task once the gateway shows it running; SIGKILL the victim's pool process once
    the gateway shows its first run's last progress; until every task is at its end."""
    holds = {t for t, e in plan.items() if e.kind == "hold"}
    victim = next(t for t, e in plan.items() if e.kind == "victim")
    revoked: set[str] = set()
    killed = False
    tasks: dict[str, dict[str, Any]] = {}
    with anyio.move_on_after(SCENARIO_S):
        while True:
            tasks = {}
            cursor: str | None = None
            while True:
                params: dict[str, Any] = {"limit": 500, **({"cursor": cursor} if cursor else {})}
                page = (await client.get("/v1/tasks", params=params)).json()
                tasks.update({t["id"]: t for t in page["tasks"]})
                if not (cursor := page["nextCursor"]):
                    break
            for task_id in holds - revoked:
                task = tasks[task_id]
                if (
                    task["state"] == "running"
                    and task["progress"] == 10
                    and (shared / f"{task_id}.pid").exists()
                ):
                    await anyio.to_thread.run_sync(partial(app.control.revoke, task_id, terminate=True))
                    revoked.add(task_id)
            task = tasks[victim]
            pid_file = shared / f"{victim}.pid"
            if not killed and task["state"] == "running" and task["progress"] == 20 and pid_file.exists():
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
                killed = True
            if all(tasks[t]["state"] in TERMINAL for t in plan):
                return
            await anyio.sleep(0.1)  # the next look at the gateway's list (nothing to wait on but it)
    left = {
        t: (plan[t].kind, tasks[t]["state"], tasks[t]["attempts"])
        for t in plan
        if tasks[t]["state"] not in TERMINAL
    }
    raise AssertionError(
        f"not at their end within {SCENARIO_S}s (revoked {len(revoked)}, killed {killed}): {left}"
    )


def _celery_states(broker: Broker, plan: dict[str, Expected]) -> list[str]:
    """Where Celery's own state of a task (what its worker stored in the result backend) is not the
    gateway's end of it, once stored (a result may be stored just after the gateway was told). Read from
    Redis directly: the test's app publishes without a result backend (Celery's Redis result consumer,
    subscribed by each publish, can deadlock in ``AsyncResult.__del__``)."""
    problems: list[str] = []
    deadline = time.monotonic() + STORED_S
    client = Redis.from_url(broker.backend)
    try:
        for task_id, expected in plan.items():
            want = CELERY_STATE[expected.state]
            while (state := _stored_state(client, broker, task_id)) != want and time.monotonic() < deadline:
                time.sleep(0.05)  # the next look at the result backend (nothing to wait on but it)
            if state != want:
                problems.append(f"{expected.kind} {task_id}: Celery says {state}, expected {want}")
    finally:
        client.close()
    return problems


def _in_state(state: str, task: dict[str, Any]) -> bool:
    return bool(task["state"] == state)


def _stored_state(client: Redis, broker: Broker, task_id: str) -> str | None:
    raw = cast(bytes | None, client.get(f"{broker.prefix}celery-task-meta-{task_id}"))
    return None if raw is None else str(json.loads(raw)["status"])


@pytest.mark.anyio
async def test_a_task_cancelled_on_the_gateway_stops_and_a_producer_without_gateway_still_publishes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On Redis: a producer that cannot reach the gateway says which task it could not create and publishes
    it anyway (the worker creates the task when it runs it, with ``maxAttempts`` from the producer); a
    cancel on the gateway makes the running task's next ``progress()`` raise ``TaskCancelled`` (Celery:
    ``FAILURE``)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    with redis_broker() as broker:
        async with (
            keyed_gateway(tmp_path) as gw,
            http_client(base_url=gw.url, headers=bearer(API_KEY), timeout=30) as client,
            celery_worker(broker, gw.url, shared),
        ):
            settings: dict[str, Any] = {
                "broker": broker.url,
                "backend": "disabled://",
                "queue": broker.queue,
                "prefix": broker.prefix,
                "api_key": API_KEY,
                "shared": shared,
            }
            away = make_app(gateway=f"http://127.0.0.1:{free_port()}", timeout=0.5, **settings)
            try:
                with caplog.at_level(logging.WARNING, logger="gateway.integrations"):
                    sent = await anyio.to_thread.run_sync(
                        lambda: away.signature("tg.steps").apply_async(([20, 60], "s3://made-by-the-worker"))
                    )
            finally:
                uninstall(away)
                away.close()
            unmade = str(sent.id)
            warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert any(f"could not create task {unmade}" in w for w in warnings), warnings
            app = make_app(gateway=gw.url, **settings)
            try:
                held = str(
                    (await anyio.to_thread.run_sync(lambda: app.signature("tg.hold").apply_async((10,)))).id
                )
                await eventually(
                    lambda: read_task(client, held),
                    lambda t: t["state"] == "running" and t["progress"] == 10,
                    f"{held} running",
                )
                answer = await client.post(f"/v1/tasks/{held}/cancel", json={"reason": "not wanted"})
                assert answer.json()["reason"] == "cancelled", answer.text
                # A lost run, which Celery calls failed: its pool process killed (no acks_late). The worker's
                # main process reports it.
                killed = str(
                    (await anyio.to_thread.run_sync(lambda: app.signature("tg.hold").apply_async((30,)))).id
                )
                await eventually(
                    lambda: read_task(client, killed),
                    lambda t: (
                        t["state"] == "running"
                        and t["progress"] == 30
                        and (shared / f"{killed}.pid").exists()
                    ),
                    f"{killed} running",
                )
                os.kill(int((shared / f"{killed}.pid").read_text()), signal.SIGKILL)
                for task_id, state in (
                    (unmade, "succeeded"),
                    (held, "failed"),
                    (killed, "failed"),
                ):
                    await eventually(
                        partial(read_task, client, task_id),
                        partial(_in_state, state),
                        f"{task_id} {state}",
                        within_s=60,
                    )
                problems = await anyio.to_thread.run_sync(
                    _celery_states,
                    broker,
                    {
                        unmade: Expected("steps", "succeeded", [], task_id=unmade),
                        held: Expected("hold", "failed", [], task_id=held),
                        killed: Expected("hold", "failed", [], task_id=killed),
                    },
                )
                assert not problems, problems
            finally:
                uninstall(app)
                app.close()
            made = await read_history(client, unmade)
            assert made["task"]["maxAttempts"] == 1 + 3  # Celery's default max_retries, told by the producer
            assert made["task"]["resultRef"] == "s3://made-by-the-worker"
            events = [e["event"] for e in made["events"]]
            assert [events[0]["type"], events[-2].get("progress"), events[-1]["type"]] == [
                "start",
                60,
                "succeed",
            ]
            lost = await read_history(client, killed)
            assert lost["task"]["error"].startswith("WorkerLostError: "), lost["task"]
            assert [e["event"]["type"] for e in lost["events"]] == ["start", "progress", "fail"]
            cancelled = await read_history(client, held)
            assert cancelled["task"]["error"] == "cancelled"
            assert [e["event"]["type"] for e in cancelled["events"]] == ["start", "progress", "cancel"]
