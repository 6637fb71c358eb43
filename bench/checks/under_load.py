"""Expiry and leases on time under load (protocol.md, "Time and expiry" and "Heartbeat leases": within 1 s of
the deadline, of the lease's end), against ``gateway serve`` on SQLite and on PostgreSQL.

Each run starts a gateway process and 20 busy workers (tests/support/busy_workers.py, a process of their
own) that post callbacks as fast as the gateway answers them and follow their tasks on one socket; then
300 tasks, from 10 creators at once, each followed by a subscriber of its own from before its deadline:

- **expiry-load**: tasks with 2 s TTLs; each must be seen expired within 1 s of its ``expiresAtMs``:
  *committed* (a poller lists ``GET /v1/tasks?state=expired`` every 50 ms; a task's time is the start of
  the first listing that holds it), *pushed* (the arrival of the frame that shows it expired) and by the
  gateway's own ``gateway_expiry_lateness_seconds`` histogram (deadline to commit);
- **lease-load**: tasks with 2 s leases (an hour to live) started by a worker that then vanishes; each
  lease must be seen ended within 1 s of its end (the start's ``leaseUntilMs``): *pushed* (the arrival of
  the ``fail`` entry, ``heartbeat-timeout``) and by ``gateway_lease_lateness_seconds``.

Times are this machine's wall clock. :func:`expiries` and :func:`leases` also check what must hold
whatever the load (every task's frames: the ``expire`` entry at the deadline, the ``fail`` at the lease's
end, each subscriber in place before its deadline), raising :class:`AssertionError`; the test suite runs
them small, without the bounds (tests/integration/test_expiry_load.py, test_lease_load.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.abc
import httpx
from websockets.asyncio.client import connect

from bench.lib import harness
from bench.lib.verdict import Figure

BOUND_MS = 1_000
POLL_S = 0.05


@dataclass(frozen=True)
class Sizes:
    tasks: int = 300
    workers: int = 20  # busy workers
    creators: int = 10  # tasks created (and started) this many at a time
    ttl_ms: int = 2_000  # expiry: each task's TTL; leases: each lease
    cursor_bytes: int = 4096  # each busy progress callback's cursor
    warm: int = 200  # the busy workers' callbacks answered before the tasks come


FULL = Sizes()


@dataclass
class Lateness:
    """A run's figures: how long after its deadline (or lease's end) each task was seen ended, in ms."""

    backend: str
    pushed: dict[str, int]
    committed: dict[str, int]  # expiry only: seen listed by the poller
    buckets: dict[str, float]  # the gateway's own histogram, cumulative by ``le``
    load: tuple[float, float]  # the load average at the start and at the end
    workers: str = ""  # the busy workers' last line: how many callbacks they had answered
    notes: list[str] = field(default_factory=list)

    def over(self) -> float:
        """Ends the gateway itself committed more than 1 s late (its histogram)."""
        return self.buckets.get("+Inf", 0) - self.buckets.get("1.0", 0)

    def summary(self) -> str:
        parts = [f"pushed {spread(self.pushed)}"]
        if self.committed:
            parts.insert(0, f"committed {spread(self.committed)}")
        parts.append(
            f"the gateway's histogram: {self.over():.0f} of {self.buckets.get('+Inf', 0):.0f} over 1 s"
        )
        parts.append(
            f"load average {self.load[0]:.1f} at the start, {self.load[1]:.1f} at the end, "
            f"{os.cpu_count()} CPUs; busy workers: {self.workers}"
        )
        return "; ".join(parts + self.notes)


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def spread(lateness: dict[str, int]) -> str:
    values = sorted(lateness.values())
    if not values:
        return "none"
    late = sum(1 for v in values if v > BOUND_MS)
    return (
        f"p50 {statistics.median(values):.0f} ms, p90 {values[int(len(values) * 0.9)]} ms, "
        f"p99 {values[int(len(values) * 0.99)]} ms, max {values[-1]} ms, {late} of {len(values)} over "
        f"{BOUND_MS} ms"
    )


T = TypeVar("T")


async def until(read: Callable[[], Awaitable[T]], done: Callable[[T], bool], what: str, within_s: float) -> T:
    """``read()`` again every 50 ms until ``done`` holds of its value (a gateway's /metrics: nothing to wait
    on but asking); TimeoutError naming ``what`` after ``within_s``."""
    with anyio.fail_after(within_s):
        while not done(value := await read()):  # noqa: ASYNC110  (asking the server is the only way)
            await anyio.sleep(POLL_S)
    return value


async def histogram(client: httpx.AsyncClient, metric: str, count: int) -> dict[str, float]:
    """The gateway's histogram ``metric``, each bucket by ``le``, once it holds ``count`` observations (the
    sweeper observes a batch after its commit, so a task can be listed a moment before it is counted)."""

    async def buckets() -> dict[str, float]:
        answer = await client.get("/metrics")
        answer.raise_for_status()
        prefix = f'{metric}_bucket{{le="'
        return {
            line[len(prefix) :].split('"')[0]: float(line.rpartition(" ")[2])
            for line in answer.text.splitlines()
            if line.startswith(prefix)
        }

    return await until(buckets, lambda found: found.get("+Inf", 0) >= count, f"{count} in {metric}", 30)


@contextlib.asynccontextmanager
async def busy_workers(url: str, sizes: Sizes) -> AsyncIterator[list[str]]:
    """tests/support/busy_workers.py against ``url``, at full speed when the block begins; stopped at its
    end, when the list yielded gets its last line (how many callbacks they had answered). None with
    ``sizes.workers`` 0."""
    if not sizes.workers:
        yield ["no busy workers"]
        return
    command = [sys.executable, "-m", "tests.support.busy_workers", url, str(sizes.workers)]
    command += [str(sizes.cursor_bytes), str(sizes.warm)]
    process = await harness.spawn(command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    said: list[str] = []
    try:
        assert process.stdin is not None and process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        if line.strip() != b"ready":
            raise RuntimeError(f"the busy workers did not start: {line!r}")
        yield said
        process.stdin.close()
        out = await asyncio.wait_for(process.stdout.read(), 10)
        said.extend(out.decode().strip().splitlines()[-1:])
    finally:
        await harness.stop(process, 5)


@contextlib.asynccontextmanager
async def database(backend: str) -> AsyncIterator[str | None]:
    """A PostgreSQL database of the check's own (``postgresql``), or None: the gateway's SQLite file."""
    if backend == "sqlite":
        yield None
        return
    async with harness.pg_database(harness.PG_ADMIN, "gw_bench_check") as url:
        yield url


@contextlib.asynccontextmanager
async def loaded(database_url: str | None, sizes: Sizes) -> AsyncIterator[tuple[harness.Server, list[str]]]:
    """A gateway process on ``database_url`` (None: a SQLite file of its own) under the busy workers."""
    async with harness.gateway(database_url) as gw, busy_workers(gw.http, sizes) as said:
        yield gw, said


async def expiries(database_url: str | None, sizes: Sizes = FULL) -> Lateness:
    """``sizes.tasks`` tasks expiring under the busy workers; every one committed, pushed and counted."""
    ids = [f"exp-{i:04d}" for i in range(sizes.tasks)]
    deadlines: dict[str, int] = {}
    committed: dict[str, int] = {}
    pushed: dict[str, int] = {}
    resumed: dict[str, int] = {}
    frames: dict[str, dict[str, Any]] = {}  # the expiring event, when the subscriber saw one

    async with (
        loaded(database_url, sizes) as (gw, said),
        httpx.AsyncClient(base_url=gw.http, timeout=30) as client,
    ):
        all_committed = anyio.Event()

        async def follow(task_id: str) -> None:
            async with connect(f"{gw.ws}/v1/tasks/{task_id}/ws?cursor=0") as ws:
                async for raw in ws:
                    seen = wall_ms()
                    frame = json.loads(raw)
                    assert frame["type"] != "error", frame
                    resumed.setdefault(task_id, seen)
                    if frame["task"]["state"] == "expired":
                        pushed[task_id] = seen
                        if frame["type"] == "event":
                            frames[task_id] = frame["event"]

        async def create(task_ids: Sequence[str], followers: anyio.abc.TaskGroup) -> None:
            for task_id in task_ids:
                body = {"id": task_id, "ttlMs": sizes.ttl_ms, "maxAttempts": 1}
                answer = await client.post("/v1/tasks", json=body)
                assert answer.status_code == 201, answer.text
                deadlines[task_id] = answer.json()["task"]["expiresAtMs"]
                followers.start_soon(follow, task_id)

        async def poll() -> None:
            while True:
                answer = await client.get("/v1/tasks", params={"state": "expired", "limit": 500})
                # When the answer came, not when it was asked: a list asked just before a deadline may be
                # made after the expiry committed (read before the answer, a task listed 3 ms "early").
                listed = wall_ms()
                assert answer.status_code == 200, answer.text
                for task in answer.json()["tasks"]:
                    committed.setdefault(task["id"], listed)
                if len(committed) == len(ids):
                    all_committed.set()
                    return
                await anyio.sleep(POLL_S)

        load_at_start = os.getloadavg()[0]
        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(poll)
                async with anyio.create_task_group() as creators:
                    for c in range(sizes.creators):
                        creators.start_soon(create, ids[c :: sizes.creators], tg)
                await all_committed.wait()
        buckets = await histogram(client, "gateway_expiry_lateness_seconds", len(ids))
        load = (load_at_start, os.getloadavg()[0])
    assert sorted(committed) == ids and sorted(pushed) == ids
    # The expire entry is pinned at the deadline; each subscriber was in place before its task's deadline,
    # so what it saw was the push of the expiry.
    for task_id, event in frames.items():
        assert event == {"type": "expire", "atMs": deadlines[task_id]}, (task_id, event)
    assert all(resumed[i] < deadlines[i] for i in ids), "a subscription started after its task's deadline"
    assert buckets["+Inf"] == len(ids), buckets
    return Lateness(
        "PostgreSQL" if database_url else "SQLite",
        {i: pushed[i] - deadlines[i] for i in ids},
        {i: committed[i] - deadlines[i] for i in ids},
        buckets,
        load,
        "".join(said),
    )


async def leases(
    database_url: str | None, sizes: Sizes = FULL, *, read_starts_late: bool = False
) -> Lateness:
    """``sizes.tasks`` leases running out under the busy workers; every one pushed as its attempt's fail
    (``heartbeat-timeout`` at the lease's end) and counted. ``read_starts_late``: each start's answer is
    taken only once its task's fail frame has arrived, as a loaded machine may take it."""
    ids = [f"lease-{i:04d}" for i in range(sizes.tasks)]
    ends: dict[str, int] = {}  # each lease's end, as the start's answer gave it
    pushed: dict[str, int] = {}
    subscribed: dict[str, int] = {}
    failed: dict[str, dict[str, Any]] = {}  # the fail frame each subscriber saw
    fail_seen = {task_id: anyio.Event() for task_id in ids}

    async with (
        loaded(database_url, sizes) as (gw, said),
        httpx.AsyncClient(base_url=gw.http, timeout=30) as client,
    ):

        async def follow(task_id: str, *, task_status: anyio.abc.TaskStatus[None]) -> None:
            """One subscriber of the task, from before its start to its end. The fail frame can come before
            the start's answer reaches :func:`run` (a loaded machine): it is kept, and checked against the
            lease's end once both are known."""
            async with connect(f"{gw.ws}/v1/tasks/{task_id}/ws?cursor=0") as ws:
                async for raw in ws:
                    seen = wall_ms()
                    frame = json.loads(raw)
                    assert frame["type"] != "error", frame
                    if task_id not in subscribed:
                        subscribed[task_id] = seen
                        task_status.started()
                    if frame["type"] == "event" and frame["event"]["type"] == "fail":
                        pushed[task_id] = seen
                        failed[task_id] = frame
                        fail_seen[task_id].set()

        async def run(task_ids: Sequence[str], followers: anyio.abc.TaskGroup) -> None:
            for task_id in task_ids:
                body = {"id": task_id, "ttlMs": 3_600_000, "maxAttempts": 1, "heartbeatMs": sizes.ttl_ms}
                made = await client.post("/v1/tasks", json=body)
                assert made.status_code == 201, made.text
                await followers.start(follow, task_id)
                started = await client.post(
                    f"/v1/tasks/{task_id}/callbacks",
                    json={"event": {"type": "start", "worker": "vanishing"}},
                    headers={"Authorization": f"Bearer {made.json()['callbackToken']}"},
                )
                assert started.status_code == 200 and started.json()["reason"] == "started", started.text
                if read_starts_late:
                    await fail_seen[task_id].wait()
                ends[task_id] = started.json()["leaseUntilMs"]  # then the worker is gone

        load_at_start = os.getloadavg()[0]
        with anyio.fail_after(120):
            async with anyio.create_task_group() as followers, anyio.create_task_group() as starters:
                for c in range(sizes.creators):
                    starters.start_soon(run, ids[c :: sizes.creators], followers)
        buckets = await histogram(client, "gateway_lease_lateness_seconds", len(ids))
        load = (load_at_start, os.getloadavg()[0])
    assert sorted(pushed) == ids
    for task_id, frame in failed.items():
        fail = {"type": "fail", "atMs": ends[task_id], "error": "heartbeat-timeout", "retryable": True}
        assert frame["event"] == fail, (task_id, frame)
        assert frame["task"]["state"] == "failed", (task_id, frame)
    # Each subscriber was in place before its lease began, so what it saw was the push of the fail.
    assert all(subscribed[i] < ends[i] for i in ids), "a subscription came after its lease ended"
    assert buckets["+Inf"] == len(ids), buckets
    return Lateness(
        "PostgreSQL" if database_url else "SQLite",
        {i: pushed[i] - ends[i] for i in ids},
        {},
        buckets,
        load,
        "".join(said),
    )


def figures(name: str, result: Lateness) -> list[Figure]:
    check = f"{name} ({result.backend})"
    figures = [
        Figure(check, "ends the gateway committed over 1 s late (its histogram)", result.over(), "", 0),
        Figure(check, "pushed after the end, max", max(result.pushed.values()), "ms", BOUND_MS),
    ]
    if result.committed:
        figures.append(
            Figure(check, "listed after the end, max", max(result.committed.values()), "ms", BOUND_MS)
        )
    figures[-1] = Figure(**{**figures[-1].__dict__, "detail": result.summary()})
    return figures


async def on_both(name: str, run: Callable[[str | None], Awaitable[Lateness]]) -> list[Figure]:
    """``run`` on a SQLite file, then on a PostgreSQL database of its own: their figures."""
    found = []
    for backend in ("sqlite", "postgresql"):
        async with database(backend) as url:
            found += figures(name, await run(url))
    return found


async def expiry_load() -> list[Figure]:
    return await on_both("expiry-load", expiries)


async def lease_load() -> list[Figure]:
    return await on_both("lease-load", leases)
