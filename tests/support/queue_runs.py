"""Support for the queue integrations' acceptance tests (RQ, arq): real worker processes on this machine's
Redis, a real gateway, a subscriber per task, and the checks every queue shares.

- :func:`redis_space`: a Redis db of the helper's own (``RQ_DB``, ``ARQ_DB``), a token that names this
  test's queues, jobs and workers, and at the end the deletion of every key that carries the token (never a
  flush: another test may use the db);
- :class:`QueueWorker`: one worker process (``rq worker``, ``arq``) with its output in a file; stopped when
  its block ends, its output's tail printed when the test failed;
- :class:`Followed`: each task read at version 0 (before any worker runs it), followed by a
  :class:`~tests.support.processes.ResumingSubscriber` recording into a
  :class:`~tests.support.history.History`, and the checks of the end: each task as the queue ended it, its
  attempts, its progress entries rising within each attempt and the last one sent, its result, and the history
  checker.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import anyio.abc
import httpx
from redis.asyncio import Redis

from gateway.machine import TERMINAL
from tests.support import STEP_S, bearer, eventually, mint
from tests.support.history import History
from tests.support.processes import ResumingSubscriber, redis_or_skip

REDIS = "redis://127.0.0.1:6379"
# One db per helper (the contract of issue 19): RQ's tests and arq's tests, nobody else's.
RQ_DB = 12
ARQ_DB = 13
API_KEY = "queue-test-api-key-0123456789abcdef"
# A worker's time to import, connect and stop.
WORKER_START_S = 30.0
WORKER_STOP_S = 15.0
# The environment the job modules read (tests/jobs/rq_jobs.py, tests/jobs/arq_jobs.py).
ENV_URL = "TG_TEST_GATEWAY_URL"
ENV_KEY = "TG_TEST_GATEWAY_KEY"
ENV_TOKEN = "TG_TEST_TOKEN"
ENV_QUEUE = "TG_TEST_QUEUE"
ROOT = Path(__file__).resolve().parents[2]
# What the ``ok`` jobs of tests/jobs/ write to their task's stream ``output``, and leave in its metadata
# (``rows`` and the status line, merged at each row: the last row's).
OK_OUTPUT = "row-25 row-50 row-75 "
OK_METADATA = {"rows": 75, "message": "row-75"}


@dataclass
class RedisSpace:
    url: str
    token: str
    client: Redis

    def key(self, *parts: str) -> str:
        return ":".join((self.token, *parts))


@asynccontextmanager
async def redis_space(db: int) -> AsyncIterator[RedisSpace]:
    """This test's part of Redis db ``db``: a token to put in every queue, job and worker name, and the keys
    that carry it deleted at the end (arq's abort set: its members that do)."""
    url = f"{REDIS}/{db}"
    await redis_or_skip(url)
    token = f"tg{uuid.uuid4().hex[:12]}"
    client = Redis.from_url(url, socket_timeout=10)
    try:
        yield RedisSpace(url, token, client)
    finally:
        with anyio.CancelScope(shield=True):
            keys = [k async for k in client.scan_iter(match=f"*{token}*", count=500)]
            if keys:
                await client.delete(*keys)
            for shared in (b"arq:abort", b"rq:workers", b"rq:queues"):
                kind = await client.type(shared)
                members = (
                    await client.zrange(shared, 0, -1)
                    if kind == b"zset"
                    else await client.smembers(shared)
                    if kind == b"set"
                    else []
                )
                ours = [m for m in members if token.encode() in m]
                if ours and kind == b"zset":
                    await client.zrem(shared, *ours)
                elif ours:
                    await client.srem(shared, *ours)
            await client.aclose()


def worker_environ(gateway_url: str, space: RedisSpace, queue: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "TG_TEST_"))}
    env.update({ENV_URL: gateway_url, ENV_KEY: API_KEY, ENV_TOKEN: space.token, ENV_QUEUE: queue})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


class QueueWorker:
    """One queue worker process; its stdout and stderr in ``log``."""

    def __init__(self, name: str, process: anyio.abc.Process, log: Path) -> None:
        self.name = name
        self.process = process
        self.log = log

    @property
    def pid(self) -> int:
        return self.process.pid

    def output(self) -> str:
        return self.log.read_bytes().decode(errors="replace")

    def tail(self, lines: int = 80) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    async def wait_for(self, text: str, timeout_s: float = WORKER_START_S) -> None:
        """Until the output shows ``text``; the process must keep running."""
        with anyio.move_on_after(timeout_s):
            while text not in self.output():
                if self.process.returncode is not None:
                    raise AssertionError(f"{self.name} exited ({self.process.returncode}):\n{self.tail()}")
                await anyio.sleep(0.05)  # a child's log has nothing to wait on but reading it again
            return
        raise AssertionError(f"{self.name}: {text!r} not in its output within {timeout_s} s:\n{self.tail()}")

    async def kill(self) -> None:
        """SIGKILL, as the OOM killer would; returns once it is gone."""
        self.process.kill()
        with anyio.fail_after(WORKER_STOP_S):
            await self.process.wait()

    async def stop(self) -> None:
        """SIGTERM (a warm shutdown), SIGKILL past ``WORKER_STOP_S``; shielded."""
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                self.process.send_signal(signal.SIGTERM)
                with anyio.move_on_after(WORKER_STOP_S):
                    await self.process.wait()
            if self.process.returncode is None:
                self.process.kill()
                await self.process.wait()
            await self.process.aclose()


@asynccontextmanager
async def queue_workers(
    commands: Sequence[tuple[str, Sequence[str], dict[str, str]]], directory: Path
) -> AsyncIterator[list[QueueWorker]]:
    """Start each ``(name, argv, env)``; all stopped when the block ends, their tails printed if it
    failed. More may be started later with :func:`start_worker` and appended to the list."""
    workers: list[QueueWorker] = []
    failed = False
    try:
        for name, argv, env in commands:
            workers.append(await start_worker(name, argv, env, directory))
        yield workers
    except BaseException:
        failed = True
        raise
    finally:
        with anyio.CancelScope(shield=True):
            for worker in workers:
                await worker.stop()
        if failed:
            for worker in workers:
                print(f"\n----- {worker.name} (pid {worker.pid}): {worker.log} -----\n{worker.tail()}")


async def start_worker(name: str, argv: Sequence[str], env: dict[str, str], directory: Path) -> QueueWorker:
    log = directory / f"{name}.log"
    with log.open("wb") as out:
        process = await anyio.open_process(
            [sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT
        )
    return QueueWorker(name, process, log)


# --- what a task is expected to end as, and the checks ------------------------------------------------------


@dataclass(frozen=True)
class Expected:
    """How the queue ends a job, as its gateway task must show it: ``state``, ``attempts``, the ``error``
    (a prefix; None: none; a task that succeeded after a failed attempt keeps that attempt's error),
    ``result_ref`` and ``result_hash`` (None: not checked; :meth:`for_job` fills them in), and per attempt
    the last progress value the job reported (None: not checked); ``cancelled``: its history ends with the
    gateway's ``cancel`` entry."""

    state: str
    attempts: int
    error: str | None = None
    result_ref: str | None = None
    last_progress: tuple[int | None, ...] = ()
    cancelled: bool = False
    result_hash: str | None = None
    # The text of the task's stream ``output`` (None: not checked): what the job wrote, each write once.
    output: str | None = None
    # The task's metadata and title at its end (None: not checked).
    metadata: dict[str, Any] | None = None
    title: str | None = None

    def for_job(self, job_id: str, scheme: str) -> Expected:
        """With the result of the job ``job_id`` filled in, as the test jobs return them
        (tests/jobs/rq_jobs.py, tests/jobs/arq_jobs.py): ``result_ref=""`` stands for the string
        ``s3://results/<id>``, ``result_ref=scheme`` for the dict ``{"rows": 3, "job": <id>}``, referred to
        as ``<scheme>://<id>``; the hash is the SHA-256 of the result's canonical JSON (docs: resultHash)."""
        value: Any
        if self.result_ref == "":
            value = ref = f"s3://results/{job_id}"
        elif self.result_ref == scheme:
            value, ref = {"rows": 3, "job": job_id}, f"{scheme}://{job_id}"
        else:
            return self
        canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return replace(self, result_ref=ref, result_hash=hashlib.sha256(canonical.encode()).hexdigest())


@dataclass
class Followed:
    client: httpx.AsyncClient
    ws_base: str
    history: History = field(default_factory=History)
    subscribers: dict[str, ResumingSubscriber] = field(default_factory=dict)

    async def task(self, task_id: str) -> dict[str, Any]:
        answer = await self.client.get(f"/v1/tasks/{quote(task_id, safe='')}")
        assert answer.status_code == 200, answer.text
        task: dict[str, Any] = answer.json()
        return task

    async def follow(self, task_id: str, tg: anyio.abc.TaskGroup, within_s: float) -> None:
        """Read the task (at version 0: no worker has run it yet), and follow it to its end."""
        base = await self.task(task_id)
        assert base["version"] == 0, base
        self.history.created(base)
        subscriber = ResumingSubscriber(
            self.ws_base, task_id, mint(task_id), base, history=self.history, name=f"sub-{task_id}"
        )
        self.subscribers[task_id] = subscriber
        tg.start_soon(subscriber.run, within_s)
        with anyio.fail_after(STEP_S):
            await subscriber.ready.wait()

    async def until(self, task_id: str, what: str, accept: Any, within_s: float = 60.0) -> dict[str, Any]:
        task: dict[str, Any] = await eventually(
            lambda: self.task(task_id), accept, f"{task_id}: {what}", within_s
        )
        return task

    async def cancel(self, task_id: str) -> None:
        answer = await self.client.post(
            f"/v1/tasks/{quote(task_id, safe='')}/cancel", json={"reason": "test"}
        )
        self.history.cancel(task_id, answer.status_code, answer.json() if answer.status_code == 200 else None)
        assert answer.status_code == 200, answer.text

    async def check(self, expected: dict[str, Expected]) -> None:
        """Every task as expected, every subscriber gapless to the task's end, the history checker."""
        problems: list[str] = []
        for task_id, want in expected.items():
            task = await self.task(task_id)
            answer = await self.client.get(
                f"/v1/tasks/{quote(task_id, safe='')}/events", params={"cursor": 0}
            )
            assert answer.status_code == 200, answer.text
            self.history.final(task_id, answer.json())
            problems += _differences(task_id, task, answer.json()["events"], want)
            if want.output is not None:
                text = await self.client.get(f"/v1/tasks/{quote(task_id, safe='')}/streams/output/text")
                if text.text != want.output:
                    problems.append(f"{task_id}: output {text.text!r}, expected {want.output!r}")
            subscriber = self.subscribers.get(task_id)
            if subscriber is not None:
                try:
                    subscriber.assert_final(task)
                except AssertionError as exc:
                    problems.append(f"{task_id}: subscriber: {exc}")
        self.history.check()
        assert not problems, "\n  ".join(["tasks not as the queue ended them:", *problems])


def _differences(
    task_id: str, task: dict[str, Any], entries: list[dict[str, Any]], want: Expected
) -> list[str]:
    where = f"{task_id} ({want})"
    problems = []
    if task["state"] not in TERMINAL:
        return [f"{where}: not ended: {task}"]
    if task["state"] != want.state or task["attempts"] != want.attempts:
        problems.append(f"{where}: {task['state']} after {task['attempts']} attempts: {task}")
    error = task.get("error")
    if (error is None) != (want.error is None) or (
        want.error is not None and not str(error).startswith(want.error)
    ):
        problems.append(f"{where}: error {error!r}")
    if want.result_ref is not None and task.get("resultRef") != want.result_ref:
        problems.append(f"{where}: resultRef {task.get('resultRef')!r}")
    if want.result_hash is not None and task.get("resultHash") != want.result_hash:
        problems.append(f"{where}: resultHash {task.get('resultHash')!r}")
    if want.metadata is not None and task.get("metadata") != want.metadata:
        problems.append(f"{where}: metadata {task.get('metadata')!r}")
    if want.title is not None and task.get("title") != want.title:
        problems.append(f"{where}: title {task.get('title')!r}")
    cancels = [e for e in entries if e["event"]["type"] == "cancel"]
    if want.cancelled != bool(cancels):
        problems.append(f"{where}: cancel entries {cancels}")
    # Progress per attempt: rising, and ending at the last value the job reported.
    attempts: list[list[int]] = []
    for entry in entries:
        event = entry["event"]
        if event["type"] == "start":
            attempts.append([])
        elif event["type"] == "progress":
            if not attempts:
                problems.append(f"{where}: progress before any start: {entry}")
                continue
            attempts[-1].append(event["progress"])
    if len(attempts) != want.attempts:
        problems.append(f"{where}: {len(attempts)} start entries: {[e['event'] for e in entries]}")
    for n, values in enumerate(attempts):
        if values != sorted(set(values)):
            problems.append(f"{where}: attempt {n + 1}'s progress not rising: {values}")
        last = want.last_progress[n] if n < len(want.last_progress) else None
        if last is not None and (not values or values[-1] != last):
            problems.append(f"{where}: attempt {n + 1}'s progress {values}, expected to end at {last}")
    return problems


def gateway_headers() -> dict[str, str]:
    return bearer(API_KEY)
