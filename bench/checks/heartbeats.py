"""**worker-heartbeats**: the Python ``Worker`` holds its task by its own heartbeats for as long as it lives
and loses it soon after it stops (issue 17's acceptance line as it is written): ``gateway serve`` on
SQLite, a task with a 1 s lease, a worker process (tests/support/lease_worker.py, ``idle``: no callback but
its heartbeats) left alone for 30 s; then SIGSTOPped.

Held to: at least 30 heartbeats in the 30 s (one a second holds a 1 s lease), no attempt lost meanwhile
(the task's subscriber saw its start and nothing else), and the lease's end (the ``fail`` entry's
``atMs``, ``heartbeat-timeout``) within 2 s of the SIGSTOP. Woken, the worker is told its attempt is
over.

The suite holds the same on a longer lease, for a few heartbeats rather than 30 s
(tests/integration/test_lease_workers.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from typing import Any

import anyio
import httpx
from websockets.asyncio.client import connect

from bench.checks.under_load import wall_ms
from bench.lib import harness
from bench.lib.verdict import Figure

HELD_S = 30
LEASE_MS = 1_000


async def heartbeats(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    (line,) = [line for line in text.splitlines() if line.startswith("gateway_heartbeats_total ")]
    return float(line.rpartition(" ")[2])


async def line(process: asyncio.subprocess.Process, prefix: str) -> str:
    """The worker's next line of output that starts with ``prefix``."""
    assert process.stdout is not None
    async with asyncio.timeout(10):
        while True:
            said = (await process.stdout.readline()).decode()
            if not said:
                raise RuntimeError(f"the worker exited before saying {prefix!r}")
            if said.startswith(prefix):
                return said.strip()


async def held() -> list[Figure]:
    async with harness.gateway() as gw, httpx.AsyncClient(base_url=gw.http, timeout=30) as client:
        # One attempt: the lease's end fails the task, and the worker, woken, is told its attempt is over
        # (with one left, it would take the task back and go on).
        body = {"id": "held-1", "ttlMs": 600_000, "maxAttempts": 1, "heartbeatMs": LEASE_MS}
        made = (await client.post("/v1/tasks", json=body)).raise_for_status().json()
        events: list[dict[str, Any]] = []
        ended = anyio.Event()

        async def follow() -> None:
            async with connect(f"{gw.ws}/v1/tasks/held-1/ws?cursor=0") as ws:
                async for raw in ws:
                    frame = json.loads(raw)
                    if frame["type"] == "event":
                        events.append(frame["event"])
                        if frame["event"]["type"] == "fail":
                            ended.set()

        command = [
            sys.executable,
            "-m",
            "tests.support.lease_worker",
            gw.http,
            "held-1",
            made["callbackToken"],
        ]
        worker = await harness.spawn([*command, "w1", "idle"], stdout=asyncio.subprocess.PIPE)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(follow)
                await line(worker, "started")
                beats = await heartbeats(client)
                await anyio.sleep(HELD_S)  # left alone: the duration is what is measured, not a condition
                task = (await client.get("/v1/tasks/held-1")).json()
                beaten = await heartbeats(client) - beats
                lost = [e["type"] for e in events[1:]]
                running = (task["state"], task["attempts"]) == ("running", 1)

                stopped_at = wall_ms()
                os.kill(worker.pid, signal.SIGSTOP)
                with anyio.fail_after(30):
                    await ended.wait()
                fail = events[-1]
                os.kill(worker.pid, signal.SIGCONT)
                told = await line(worker, "attempt over")
                tg.cancel_scope.cancel()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.pid, signal.SIGCONT)  # were it stopped, a kill would wait for it
            await harness.stop(worker, 5)
    check = "worker-heartbeats (SQLite)"
    state = f"after {HELD_S} s: {task['state']}, attempt {task['attempts']}, events after the start {lost}"
    return [
        Figure(
            check,
            f"heartbeats in {HELD_S} s on a {LEASE_MS} ms lease",
            beaten,
            "",
            HELD_S,
            at_least=True,
            detail=state,
        ),
        Figure(check, f"attempts lost in {HELD_S} s", len(lost) + (0 if running else 1), "", 0, detail=state),
        Figure(
            check,
            "lease's end after the SIGSTOP",
            fail["atMs"] - stopped_at,
            "ms",
            2_000,
            detail=f"{fail}; woken, the worker said {told!r}",
        ),
    ]
