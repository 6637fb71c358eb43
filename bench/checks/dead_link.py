"""**watch-dead-link**: ``watch`` (gateway.client) replaces a link that died without a word within 10 s, at
its defaults (docs/python.md: a ping every ``heartbeat_s``, 3 s, a pong later than ``deadline_s``, 3 s, drops
the socket, and a new one is opened at once).

``gateway serve`` on SQLite, watched through a relay (``TcpProxy``, tests/support) that, once the watch has
seen the task's second version, stops forwarding both ways and closes nothing (a phone changing networks,
a NAT forgetting the flow); two entries are committed meanwhile. Held to: the frame that brings them, on
the new connection, within 10 s of the link's death.

The suite holds the behaviour without the bound (tests/integration/test_client.py: the dead socket replaced
by one new connection, the watch resumed from its cursor and ending with the task exact, the change said
once each way), through the same scenario (:func:`watch_through_a_dead_link`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from bench.lib import harness
from bench.lib.verdict import Figure
from gateway.client import Worker, watch
from gateway.client.watch import LinkStatus
from tests.support import TcpProxy, create_task

BOUND_S = 10.0
TASK = "dead-link"


@dataclass
class Watched:
    """What ``watch`` gave through a link that died: the versions its frames carried, in order, its last
    frame, what it said of the link, and the task as the gateway has it at the end."""

    versions: list[int]
    last: dict[str, Any]
    statuses: list[LinkStatus]
    final: dict[str, Any]
    resumed_after_s: float  # from the link's death to the frame bringing what was committed meanwhile


async def watch_through_a_dead_link(client: httpx.AsyncClient, relay: TcpProxy, step_s: float) -> Watched:
    """The task ``dead-link`` made on ``client``'s gateway (workers report to it directly), watched through
    ``relay`` (to the same gateway): started, at 10%; once the watch has version 2, the link dies silently
    and the task moves to 20% and 30%; once the watch has version 4, it succeeds. Each of these waits is
    given ``step_s``."""
    made = await create_task(client, TASK, ttl_ms=120_000, max_attempts=1)
    statuses: list[LinkStatus] = []
    versions: list[int] = []
    last: dict[str, Any] = {}
    died_at = resumed_at = math.nan
    async with Worker(str(client.base_url), TASK, made["callbackToken"]) as worker:
        await worker.start("w1")
        await worker.progress(10, "p10")
        frames = watch(relay.url, {TASK: made["subscribeToken"]}, on_status=statuses.append)
        with anyio.fail_after(step_s) as scope:
            async for frame in frames:
                versions.extend(e["version"] for e in frame.get("events", ()))
                if frame["type"] in ("event", "snapshot", "caught-up"):
                    versions.append(frame["version"])
                last = frame
                if frame["version"] > 2 and math.isnan(resumed_at):
                    resumed_at = time.monotonic()
                if frame["version"] == 2 and relay.stalls == 0:
                    relay.stall()
                    died_at = time.monotonic()
                    # Committed while the link is dead: what the old socket gets is lost in the relay.
                    await worker.progress(20, "p20")
                    await worker.progress(30, "p30")
                    scope.deadline = anyio.current_time() + step_s  # noticed, replaced, resumed
                elif frame["version"] == 4:
                    scope.deadline = anyio.current_time() + step_s
                    await worker.succeed(f"s3://results/{TASK}", "sha256:0")
    final = (await client.get(f"/v1/tasks/{TASK}")).raise_for_status().json()
    return Watched(versions, last, statuses, final, resumed_at - died_at)


async def watch_replaced() -> list[Figure]:
    async with (
        harness.gateway() as gw,
        TcpProxy(gw.port) as relay,
        httpx.AsyncClient(base_url=gw.http, timeout=30) as client,
    ):
        watched = await watch_through_a_dead_link(client, relay, 60)
    said = "; ".join(status.message for status in watched.statuses)
    if watched.versions != [1, 2, 3, 4, 5] or watched.last.get("task") != watched.final:
        raise RuntimeError(f"the watch did not end exact: versions {watched.versions}, said {said!r}")
    return [
        Figure(
            "watch-dead-link (SQLite)",
            "a link dead without a word replaced, what was committed meanwhile in after",
            watched.resumed_after_s,
            "s",
            BOUND_S,
            digits=2,
            detail=f"{relay.accepted} connections; said: {said}",
        )
    ]
