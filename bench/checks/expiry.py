"""Expiry on time, one task at a time (protocol.md, "Time and expiry": within 1 s of the deadline), on
SQLite and on PostgreSQL:

- **expiry-on-time**: ``gateway serve`` with its default sweep interval; a task with a 300 ms TTL seen
  expired (``GET`` every 10 ms) within 1.3 s of its creation (its TTL, the second, a little room for
  polling);
- **expiry-wakes**: ``GATEWAY_SWEEP_INTERVAL_MS`` a minute, which is the longest the sweeper sleeps, not its
  pace: a task made after its first pass expired within 1.3 s; then two more, the later (900 ms) made
  first, both within 1.9 s;
- **expiry-at-restart**: a task that fell due while no gateway ran (its deadline passed after the first
  gateway, which ran no sweeper, stopped), expired within 1.3 s of the next gateway answering;
- **expiry-busy-loop** (PostgreSQL): the gateway in this process (``gateway.runtime.Gateway``) with its
  event loop kept busy for 2 s from 300 ms after a task's creation, before its deadline: the expiry still
  commits within 1 s of the deadline (``gateway_expiry_lateness_seconds``), the sweeper running off the
  loop.

The suite holds the behaviour under each without the bound (tests/integration/test_expiry.py: the task
expires, its entry and notification at the deadline; the sweeper wakes for a deadline within a step of a
test, not its interval; a task due while down expires at the next start; on PostgreSQL an expiry commits
while the loop is held busy).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx

from bench.checks.under_load import database, until, wall_ms
from bench.lib import harness
from bench.lib.verdict import Figure
from gateway.runtime import Gateway, wall_clock_ms
from gateway.settings import Settings

BOUND_S = 1.3  # a 300 ms TTL plus the second, with a little room for polling
POLL_S = 0.01
SLOW_SWEEPS = {"GATEWAY_SWEEP_INTERVAL_MS": "60000"}


async def expired_after(client: httpx.AsyncClient, task_id: str, since: float) -> float:
    """Seconds from ``since`` (monotonic) until ``GET`` shows the task expired, polled every 10 ms."""

    async def state() -> str:
        answer = await client.get(f"/v1/tasks/{task_id}")
        answer.raise_for_status()
        return str(answer.json()["state"])

    with anyio.fail_after(30):
        while await state() != "expired":  # noqa: ASYNC110  (polling the server, as a client would)
            await anyio.sleep(POLL_S)
    return time.monotonic() - since


async def create(client: httpx.AsyncClient, task_id: str, ttl_ms: int) -> int:
    answer = await client.post("/v1/tasks", json={"id": task_id, "ttlMs": ttl_ms, "maxAttempts": 1})
    answer.raise_for_status()
    return int(answer.json()["task"]["expiresAtMs"])


@contextlib.asynccontextmanager
async def file_or_database(backend: str) -> AsyncIterator[str]:
    """A database two gateways in turn can open: a SQLite file, or a PostgreSQL database of the check's."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="gw-check-") as tmp:
            yield f"sqlite:///{Path(tmp) / 'gateway.db'}"
        return
    async with database(backend) as url:
        assert url is not None
        yield url


def named(backend: str) -> str:
    return "SQLite" if backend == "sqlite" else "PostgreSQL"


async def on_time() -> list[Figure]:
    found = []
    for backend in ("sqlite", "postgresql"):
        async with (
            file_or_database(backend) as url,
            harness.gateway(url) as gw,
            httpx.AsyncClient(base_url=gw.http, timeout=30) as client,
        ):
            t0 = time.monotonic()
            deadline = await create(client, "soon", 300)
            took = await expired_after(client, "soon", t0)
            detail = f"seen {wall_ms() - deadline} ms after the deadline"
            found.append(
                Figure(
                    f"expiry-on-time ({named(backend)})",
                    "expired after its creation (300 ms TTL)",
                    took,
                    "s",
                    BOUND_S,
                    digits=2,
                    detail=detail,
                )
            )
    return found


async def wakes() -> list[Figure]:
    found = []
    for backend in ("sqlite", "postgresql"):
        async with (
            file_or_database(backend) as url,
            harness.gateway(url, env=SLOW_SWEEPS) as gw,
            httpx.AsyncClient(base_url=gw.http, timeout=30) as client,
        ):
            check = f"expiry-wakes ({named(backend)})"
            t0 = time.monotonic()
            await create(client, "made-after-the-first-pass", 300)
            took = await expired_after(client, "made-after-the-first-pass", t0)
            found.append(
                Figure(check, "made after the first pass, expired after", took, "s", BOUND_S, digits=2)
            )
            # Two more, the later one made first: the sweeper knows the earlier deadline from its last pass.
            t0 = time.monotonic()
            await create(client, "later", 900)
            await create(client, "sooner", 300)
            await expired_after(client, "sooner", t0)
            took = await expired_after(client, "later", t0)
            found.append(
                Figure(
                    check, "a 300 ms and a 900 ms TTL, both expired after", took, "s", BOUND_S + 0.6, digits=2
                )
            )
    return found


async def at_restart() -> list[Figure]:
    found = []
    for backend in ("sqlite", "postgresql"):
        async with file_or_database(backend) as url:
            # The first gateway runs no sweeper (one would wake at the task's deadline, which a slow stop
            # may let come first): it is the second gateway that expires the task.
            async with (
                harness.gateway(url, env={"GATEWAY_SWEEP_INTERVAL_MS": "0"}) as gw,
                httpx.AsyncClient(base_url=gw.http, timeout=30) as client,
            ):
                deadline = await create(client, "sleeper", 300)
            with anyio.fail_after(5):
                while wall_ms() < deadline:  # noqa: ASYNC110  (the wall clock: nothing to signal it)
                    await anyio.sleep(POLL_S)
            async with harness.gateway(url) as gw, httpx.AsyncClient(base_url=gw.http, timeout=30) as client:
                took = await expired_after(client, "sleeper", time.monotonic())
            found.append(
                Figure(
                    f"expiry-at-restart ({named(backend)})",
                    "due while down, expired after the gateway answered",
                    took,
                    "s",
                    BOUND_S,
                    digits=2,
                )
            )
    return found


async def busy_loop() -> list[Figure]:
    async with database("postgresql") as url:
        assert url is not None
        settings = Settings(database_url=url, secret=harness.SECRET)
        gateway = Gateway(settings, wall_clock_ms)
        async with gateway.running():
            await gateway.book.create("due-while-busy", 300, 1)
            busy_until = time.monotonic() + 2.0
            while time.monotonic() < busy_until:  # the event loop busy: nothing else of it runs meanwhile
                pass
            registry = gateway.metrics.registry

            def sample(name: str, labels: dict[str, str] | None = None) -> float:
                return registry.get_sample_value(f"gateway_expiry_lateness_seconds_{name}", labels) or 0.0

            async def count() -> float:
                return sample("count")

            await until(count, lambda n: n >= 1, "the expiry observed", 30)
            late_s, within = sample("sum"), sample("bucket", {"le": "1.0"})
    detail = f"the loop busy for 2 s from the task's creation (its TTL 300 ms); within 1 s: {within:.0f} of 1"
    return [
        Figure(
            "expiry-busy-loop (PostgreSQL)",
            "committed after its deadline",
            late_s,
            "s",
            1.0,
            digits=3,
            detail=detail,
        )
    ]
