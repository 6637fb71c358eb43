"""Workers that vanish, against a real server on the real clock (issue 17's acceptance): a worker process
SIGKILLed mid-task loses its attempt within a lease and a second worker finishes the task; the Python
``Worker`` holds its task by its own heartbeats for as long as it lives, raises in its job when the gateway
says the attempt is over, and loses the task once its process is stopped (SIGSTOP).

Time is asserted on what the gateway stamped (the ``fail`` entry's ``atMs`` is the lease's end) against
the moment the test killed the process, never on how long the test took nor on how late the sweeper
committed. The bounds a loaded machine can miss are bench checks (``python -m bench checks``): leases end
within 1 s of their end under load (``lease-load``), a worker holds a 1 s lease for 30 s and loses it
within 2 s of a SIGSTOP (``worker-heartbeats``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import pytest
from anyio.streams.text import TextReceiveStream
from websockets.asyncio.client import connect

from gateway.client import AttemptOver, Worker
from tests.support import STEP_S, Running, bearer, eventually, post_callback, running_gateway
from tests.support.history import History

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = {"type": "fail", "error": "heartbeat-timeout", "retryable": True}


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class Subscriber:
    """One real WebSocket on a task from version 0: every frame, as it arrives."""

    def __init__(self, gw: Running, task_id: str, history: History) -> None:
        self.url = f"{gw.url.replace('http', 'ws', 1)}/v1/tasks/{task_id}/ws?cursor=0"
        self.task_id = task_id
        self.history = history
        self.frames: list[dict[str, Any]] = []
        self._changed = anyio.Event()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with connect(self.url) as ws:
            async for raw in ws:
                frame = json.loads(raw)
                self.frames.append(frame)
                self.history.frame("ws", frame, self.task_id)
                if len(self.frames) == 1:
                    task_status.started()
                self._changed.set()
                self._changed = anyio.Event()

    def events(self) -> list[dict[str, Any]]:
        return [f["event"] for f in self.frames if f["type"] == "event"]

    async def wait_for(self, what: str, condition: Any, within_s: float = STEP_S) -> dict[str, Any]:
        """The first ``event`` frame for which ``condition(frame)`` holds, waited for."""
        with anyio.fail_after(within_s):
            while True:
                for frame in self.frames:
                    if frame["type"] == "event" and condition(frame):
                        return frame
                await self._changed.wait()
        raise AssertionError(f"not seen: {what}")  # pragma: no cover (fail_after raises first)


class WorkerProcess:
    """``tests/support/lease_worker.py`` in a process of its own, its output read line by line."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        self.lines: list[str] = []
        self._buffer = ""

    async def line(self, prefix: str, within_s: float = STEP_S) -> str:
        """The next line of its output that starts with ``prefix``."""
        assert self.process.stdout is not None
        with anyio.fail_after(within_s):
            while True:
                while "\n" in self._buffer:
                    line, self._buffer = self._buffer.split("\n", 1)
                    self.lines.append(line)
                    if line.startswith(prefix):
                        return line
                self._buffer += await TextReceiveStream(self.process.stdout).receive()


@asynccontextmanager
async def worker_process(
    gw: Running, created: dict[str, Any], name: str, mode: str
) -> AsyncIterator[WorkerProcess]:
    command = [
        sys.executable,
        "-m",
        "tests.support.lease_worker",
        gw.url,
        created["task"]["id"],
        created["callbackToken"],
    ]
    process = await anyio.open_process([*command, name, mode], stdout=subprocess.PIPE, cwd=ROOT)
    async with process:
        try:
            yield WorkerProcess(process)
        finally:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.send_signal(signal.SIGCONT)  # were it stopped, a kill would wait for it
                    process.kill()
                    await process.wait()


async def create(gw: Running, task_id: str, heartbeat_ms: int, max_attempts: int) -> dict[str, Any]:
    body = {"id": task_id, "ttlMs": 600_000, "maxAttempts": max_attempts, "heartbeatMs": heartbeat_ms}
    answer = await gw.client.post("/v1/tasks", json=body)
    assert answer.status_code == 201, answer.text
    made: dict[str, Any] = answer.json()
    return made


async def heartbeats(gw: Running) -> float:
    text = (await gw.client.get("/metrics")).text
    (line,) = [line for line in text.splitlines() if line.startswith("gateway_heartbeats_total ")]
    return float(line.rpartition(" ")[2])


async def test_a_worker_killed_mid_task_is_requeued_within_its_lease_and_a_second_worker_finishes(
    database_url: str,
) -> None:
    history = History()
    async with running_gateway(database_url) as gw, anyio.create_task_group() as tg:
        created = await create(gw, "killed-1", heartbeat_ms=2_000, max_attempts=3)
        history.created(created["task"])
        watcher = Subscriber(gw, "killed-1", history)
        await tg.start(watcher.run)
        async with worker_process(gw, created, "w1", "progress") as first:
            assert (await first.line("started")).split()[1] == "1"
            await watcher.wait_for("the first worker's progress", lambda f: f["version"] >= 3)  # mid-task
            killed_at = wall_ms()
            first.process.kill()  # SIGKILL: nothing more comes from it, not even a FIN's worth of goodbye
            await first.process.wait()
        failed = await watcher.wait_for("the lease's end", lambda f: f["event"]["type"] == "fail")
        assert {k: v for k, v in failed["event"].items() if k != "atMs"} == TIMEOUT
        assert (failed["task"]["state"], failed["task"]["attempts"]) == ("queued", 1)
        # Requeued within 3 s of the kill: stamped at the lease's end.
        assert 0 < failed["event"]["atMs"] - killed_at <= 3_000, (failed, killed_at)

        # A second worker takes the next attempt and finishes the task.
        async with Worker(gw.url, "killed-1", created["callbackToken"]) as second:
            await second.start("w2")
            assert second.attempt == 2
            # The first worker's late callback is fenced.
            late = {"type": "progress", "progress": 99, "cursor": "late"}
            answer = await post_callback(
                gw, "killed-1", created["callbackToken"], late, attempt=1, expect=None
            )
            assert answer.status_code == 409 and answer.json()["error"]["code"] == "stale-attempt", (
                answer.text
            )
            late_beat = await gw.client.post(
                "/v1/tasks/killed-1/heartbeat", json={"attempt": 1}, headers=bearer(created["callbackToken"])
            )
            assert late_beat.status_code == 409 and late_beat.json()["error"]["code"] == "stale-attempt"
            await second.succeed("s3://r/killed-1", "sha256:1")
        done = await watcher.wait_for("the task's end", lambda f: f["task"]["state"] == "succeeded")
        assert done["task"]["attempts"] == 2
        events = (await gw.client.get("/v1/tasks/killed-1/events", params={"cursor": 0})).json()
        tg.cancel_scope.cancel()
    history.final("killed-1", events)
    history.check()  # a gateway-made fail is an entry like any other: no gap, one terminal state
    kinds = [e["event"]["type"] for e in events["events"]]
    assert kinds[kinds.index("fail") :] == ["fail", "start", "succeed"]


async def test_the_worker_raises_in_its_job_when_the_gateway_says_its_attempt_is_over(
    sqlite_url: str,
) -> None:
    async with running_gateway(sqlite_url) as gw:
        created = await create(gw, "over-1", heartbeat_ms=1_000, max_attempts=2)
        token = created["callbackToken"]
        job_cancelled = anyio.Event()
        with anyio.fail_after(STEP_S), pytest.raises(AttemptOver) as over:
            async with Worker(gw.url, "over-1", token) as worker:
                answer = await worker.start("w1")
                assert answer["heartbeatMs"] == 1_000 and worker.heartbeating
                # Someone else ends the attempt (a retryable fail with its attempt): the task is requeued.
                requeue = {"type": "fail", "error": "operator", "retryable": True}
                await post_callback(gw, "over-1", token, requeue, attempt=1)
                try:
                    await anyio.sleep_forever()  # the job, which the next heartbeat's answer cancels
                finally:
                    job_cancelled.set()
        assert job_cancelled.is_set()
        assert (over.value.status, over.value.code) == (409, "not-running")
        assert "requeued" in str(over.value)


async def test_the_worker_stops_heartbeating_when_its_attempt_ends(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        created = await create(gw, "ends-1", heartbeat_ms=1_000, max_attempts=1)
        async with Worker(gw.url, "ends-1", created["callbackToken"]) as worker:
            await worker.start("w1")
            assert worker.heartbeating
            before = await heartbeats(gw)
            await eventually(lambda: heartbeats(gw), lambda n: n >= before + 3, "three heartbeats")
            task = (await gw.client.get("/v1/tasks/ends-1")).json()
            assert (task["state"], task["version"]) == ("running", 1)  # held by heartbeats alone
            await worker.succeed("s3://r/ends-1", "sha256:1")
            assert not worker.heartbeating  # stopped with the attempt's last callback


async def test_the_python_worker_keeps_its_task_by_its_heartbeats_and_loses_it_once_stopped(
    sqlite_url: str,
) -> None:
    """A worker process that sends nothing but its heartbeats keeps its task past its first lease's end
    (four heartbeats, a third of a lease apart), with no entry but its start; SIGSTOPped, it loses the
    attempt (a ``fail``, ``heartbeat-timeout``: its last, so the task fails); woken, it is told so in its
    job. How long it holds a 1 s lease (30 s) and how soon a stop loses it (within 2 s) is no test, a loaded
    machine can miss it: it is the bench check ``worker-heartbeats`` (bench/checks/heartbeats.py)."""
    history = History()
    async with running_gateway(sqlite_url) as gw, anyio.create_task_group() as tg:
        # One attempt: its lease's end fails the task, so the worker, woken, is told its attempt is over
        # (with attempts left it would take the task back: tests/integration/test_lease_outlived.py).
        created = await create(gw, "stopped-1", heartbeat_ms=2_000, max_attempts=1)
        history.created(created["task"])
        watcher = Subscriber(gw, "stopped-1", history)
        await tg.start(watcher.run)
        async with worker_process(gw, created, "w1", "idle") as worker:
            first_lease_until = int((await worker.line("started")).split()[2])
            beats = await heartbeats(gw)
            await eventually(lambda: heartbeats(gw), lambda n: n >= beats + 4, "four heartbeats")
            assert wall_ms() > first_lease_until  # a heartbeat goes no sooner than a third of the lease
            task = (await gw.client.get("/v1/tasks/stopped-1")).json()
            assert (task["state"], task["attempts"], task["version"]) == ("running", 1, 1), task
            assert [e["type"] for e in watcher.events()] == ["start"]

            stopped_at = wall_ms()
            os.kill(worker.process.pid, signal.SIGSTOP)
            failed = await watcher.wait_for("the lease's end", lambda f: f["event"]["type"] == "fail")
            assert {k: v for k, v in failed["event"].items() if k != "atMs"} == TIMEOUT
            assert failed["event"]["atMs"] > first_lease_until and failed["version"] == 2, (
                failed,
                stopped_at,
            )
            assert (failed["task"]["state"], failed["task"]["attempts"]) == ("failed", 1)

            # Woken up, the worker is told its attempt is over, in its job.
            os.kill(worker.process.pid, signal.SIGCONT)
            assert await worker.line("attempt over") == "attempt over not-running"
            with anyio.fail_after(STEP_S):
                assert await worker.process.wait() == 3
        events = (await gw.client.get("/v1/tasks/stopped-1/events", params={"cursor": 0})).json()
        tg.cancel_scope.cancel()
    history.final("stopped-1", events)
    history.check()
    assert [e["event"]["type"] for e in events["events"]] == ["start", "fail"]


async def test_a_jobs_own_error_leaves_the_block_as_it_was_raised_while_the_worker_heartbeats(
    sqlite_url: str,
) -> None:
    """The background heartbeat wraps nothing: the job's exception is the one the block raises (not an
    exception group), and a worker that ends that way stops heartbeating."""
    async with running_gateway(sqlite_url) as gw:
        created = await create(gw, "raises-1", heartbeat_ms=1_000, max_attempts=1)
        with anyio.fail_after(STEP_S), pytest.raises(KeyError, match="the job's own"):
            async with Worker(gw.url, "raises-1", created["callbackToken"]) as worker:
                await worker.start("w1")
                assert worker.heartbeating
                raise KeyError("the job's own")
        assert not worker.heartbeating
