"""Sockets held by one server, as workloads 3, 5 and 9 of ``bench/suite.py`` measure them: the server's memory
per idle subscriber (:func:`idle_gateway`, :func:`idle_floor`) and the time for N subscribers connecting at
once to get their resume frames (:func:`storm_gateway`, :func:`storm_floor`).

``servers`` is ``bench/suite.py``'s ``Servers`` (anything whose ``use(name)`` gives a server's context);
``procs`` are the client processes at least (``harness.Clients`` starts more past 18,000 sockets each).
The gateway's figures come with ``refused``: the WebSockets it answered ``503 too-many-sockets`` (its
``gateway_sockets_refused`` metric; a subscriber refused is retried, and counted in ``retries``). With
``BENCH_PROFILE=DIR``, py-spy samples the gateway during a storm (``harness.profiled``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, Protocol

from bench.lib import harness
from bench.lib.harness import Clients, rss_bytes
from bench.workloads import fanout

STORM_HISTORY = 40  # versions of each task before the storm
STORM_BEHIND = 3  # the delta half's cursor is this many versions behind (retention keeps 8)


# Handshakes in flight per client process in a storm of many thousands (workload 9): a client process
# (under SCHED_IDLE, sharing this machine with the server) that starts thousands at once is slow to send
# each one's request after its connection is accepted; the gateway closes a connection that has said
# nothing for GATEWAY_IDLE_TIMEOUT_MS (5 s) and the client retries, which measures the co-located client,
# not the server (a real client speaks right after connecting). A few hundred in flight per process,
# several processes, still keep more connections waiting than the server's accept backlog (2048).
IN_FLIGHT = 500


class Lender(Protocol):
    def use(self, name: str) -> contextlib.AbstractAsyncContextManager[Any]: ...


async def refused(http: Any) -> int:
    """The WebSockets the gateway answered 503 too-many-sockets so far (its descriptor reserve)."""
    value = fanout.metric((await http.get("/metrics")).text, "gateway_sockets_refused_total")
    return 0 if value != value else int(value)  # nan: not exposed (no refusal counted yet)


async def warm_up(url: str) -> None:
    """One socket opened, read and closed, so that what a first connection loads is not counted per socket."""
    from websockets.asyncio.client import connect

    async with connect(url, compression=None, ping_interval=None) as ws:
        await asyncio.wait_for(ws.recv(), 10)


async def idle_gateway(
    n: int, servers: Lender, *, procs: int, timeout_s: float, server_name: str = "fresh gateway"
) -> dict[str, Any]:
    import httpx

    task_id = f"idle-{uuid.uuid4().hex[:8]}"
    async with contextlib.AsyncExitStack() as stack:
        server = await stack.enter_async_context(servers.use(server_name))
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=server.http, timeout=60))
        made = await fanout.create_task(http, task_id)
        url = f"{server.ws}/v1/tasks/{task_id}/ws?cursor=0&token={made['subscribeToken']}"
        await warm_up(url)
        await asyncio.sleep(0.2)
        rss_before = rss_bytes(server.pid)
        refused_before = await refused(http)
        clients = await Clients.start(
            [(url, n, "caught-up")], procs=procs, stream=True, final=1, hold=True, timeout_s=timeout_s
        )
        stack.push_async_callback(clients.close)
        await clients.connect(timeout_s)
        rss_resumed = rss_bytes(server.pid)
        await fanout.post_callbacks(http, task_id, made["callbackToken"], fanout.plan(2)[:1], 1.0)
        stats = await clients.done(timeout_s)
        await asyncio.sleep(0.2)
        rss_after = rss_bytes(server.pid)
        stats["refused"] = await refused(http) - refused_before
    return {
        **stats,
        "bytes_per_subscriber": (rss_after - rss_before) / n,
        "resumed_bytes_per_subscriber": (rss_resumed - rss_before) / n,
    }


async def idle_floor(
    n: int, servers: Lender, *, procs: int, timeout_s: float, server_name: str = "fresh floor"
) -> dict[str, Any]:
    from websockets.asyncio.client import connect

    async with contextlib.AsyncExitStack() as stack:
        server = await stack.enter_async_context(servers.use(server_name))
        publisher = await stack.enter_async_context(connect(f"{server.ws}/publish", compression=None))
        await warm_up(f"{server.ws}/")
        await asyncio.sleep(0.2)
        rss_before = rss_bytes(server.pid)
        clients = await Clients.start(
            [(f"{server.ws}/", n, "hello")], procs=procs, stream=True, final=1, hold=True, timeout_s=timeout_s
        )
        stack.push_async_callback(clients.close)
        await clients.connect(timeout_s)
        rss_resumed = rss_bytes(server.pid)
        await publisher.send(fanout.sample_frame(1))
        stats = await clients.done(timeout_s)
        await asyncio.sleep(0.2)
        rss_after = rss_bytes(server.pid)
    return {
        **stats,
        "bytes_per_subscriber": (rss_after - rss_before) / n,
        "resumed_bytes_per_subscriber": (rss_resumed - rss_before) / n,
    }


async def storm(
    groups: list[tuple[str, int, str | None]],
    procs: int,
    timeout_s: float,
    in_flight: int = 0,
    stall_s: float | None = None,
) -> dict[str, Any]:
    """Every client process opens all its sockets at the same instant; with ``in_flight``, at most that
    many handshakes at a time per process (see :data:`IN_FLIGHT`); ``stall_s``: see ``harness.Clients``."""
    clients = await Clients.start(
        groups, procs=procs, hold=True, concurrency=in_flight, timeout_s=timeout_s, stall_s=stall_s
    )
    try:
        overflows = harness.listen_overflows()
        go = time.monotonic()
        lines = await clients.connect(timeout_s)
        seconds = max(line["t"] for line in lines) - go
        after = harness.listen_overflows()
        stats = await clients.done(timeout_s)
    finally:
        await clients.close()
    dropped = after - overflows if after is not None and overflows is not None else None
    return {**stats, "seconds": seconds, "listen_overflows": dropped, "procs": len(clients.processes)}


async def storm_gateway(
    n: int,
    tasks: int,
    servers: Lender,
    *,
    procs: int,
    timeout_s: float,
    server_name: str = "gateway",
    in_flight: int = 0,
) -> dict[str, Any]:
    """N subscribers over ``tasks`` tasks of :data:`STORM_HISTORY` versions, half a few versions behind
    (``delta``), half far behind (``snapshot``), connecting at once."""
    import httpx

    tasks = max(1, min(tasks, n // 2))
    async with (
        servers.use(server_name) as server,
        httpx.AsyncClient(base_url=server.http, timeout=60) as http,
    ):
        groups: list[tuple[str, int, str | None]] = []
        per_task = [n // tasks + (1 if i < n % tasks else 0) for i in range(tasks)]
        for i, count in enumerate(per_task):
            task_id = f"storm-{uuid.uuid4().hex[:8]}-{i}"
            made = await fanout.create_task(http, task_id)
            events = fanout.plan(STORM_HISTORY + 1)[:STORM_HISTORY]  # start, progress...: not terminal
            await fanout.post_callbacks(http, task_id, made["callbackToken"], events, 1e9)
            base = f"{server.ws}/v1/tasks/{task_id}/ws?token={made['subscribeToken']}&cursor="
            groups.append((base + str(STORM_HISTORY - STORM_BEHIND), count // 2, "delta"))
            groups.append((base + "1", count - count // 2, "snapshot"))
        refused_before = await refused(http)
        async with harness.profiled(server.pid, f"storm-gateway-{n}"):
            result = await storm(groups, procs, timeout_s, in_flight)
        result["refused"] = await refused(http) - refused_before
        return result


async def storm_floor(
    n: int,
    servers: Lender,
    *,
    procs: int,
    timeout_s: float,
    server_name: str = "floor",
    in_flight: int = 0,
) -> dict[str, Any]:
    async with servers.use(server_name) as server:
        return await storm([(f"{server.ws}/", n, "hello")], procs, timeout_s, in_flight)
