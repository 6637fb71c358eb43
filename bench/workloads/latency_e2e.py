"""Workload 12, latency end to end: from a callback's request to the frame at the subscriber, and from the
entry's commit to that frame, beside raw ``websockets``' publish-to-receive at the same N.

    python -m bench --only 12 [--smoke]

For each N of ``Sizes.runs``: one task with N subscribers on one gateway process on a SQLite file of its
own, run through bench/programs/timed.py (which writes each entry's commit time); the bench posts callbacks
one at a time at the rate asked (each sent when due, or as soon as the previous one is answered), noting each
request's ``time.monotonic_ns()`` just before it is sent. Then the same N on the raw ``websockets``
broadcast server (``harness.floor_server``): a publisher connection sends frames of the gateway's size at
the same rate, noting each send time the same way. Every K-th subscriber of each client process notes when
it read each frame (``subscribers.py``'s ``timed_every``), about ``Sizes.sample`` subscribers in all,
spread over the processes; every (timed subscriber, version) pair is one sample. CLOCK_MONOTONIC is one
clock for every process of the machine, so the differences need no synchronisation.

While frames are timed, the gateway, or the floor server, and this process (which sends and times) are on
the first core; the subscriber processes on the others, under ``SCHED_IDLE`` (``harness.split_cores``, as
workload 4 does); the sockets are opened before, on every core.
Every subscriber checks its frames (versions 1 by 1; none lost or out of order).

``Sizes.wide``: N subscribers of one task over ``gateway serve --workers W`` on PostgreSQL (the callback
committed by one process, its entry reaching the others over the bus), beside W raw ``websockets``
processes on one port (bench/programs/sharded_floor.py), each sent every frame by the publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.lib import harness
from bench.lib.harness import Clients, percentile
from bench.lib.report import Report, Row, frames_summary
from bench.programs import timed
from bench.workloads import hundredk
from bench.workloads.fanout import attempts_for, create_task, plan, sample_frame

QUANTILES = (0.5, 0.95, 0.99)
TARGET = 1.5  # the gateway's p99 at most this many times the floor's


@dataclass(frozen=True)
class Wide:
    """The run over several gateway processes (``gateway serve --workers``, PostgreSQL)."""

    subscribers: int
    callbacks: int
    rate: float  # per second
    workers: int  # gateway processes, and floor processes (bench/programs/sharded_floor.py)


@dataclass(frozen=True)
class Sizes:
    runs: tuple[tuple[int, int, float], ...]  # (subscribers, callbacks, rate per second), one process each
    sample: int  # subscribers whose frames are timed, about (spread over the client processes)
    wide: Wide | None  # then N over several processes


# The rate falls as N grows, so that the frames per second stay within what the client processes, on the
# one other core of this machine, read as they come (about 10,000/s): above that the receive times are the
# clients' own queue, on both sides.
FULL = Sizes(
    runs=((10, 200, 20.0), (1000, 100, 10.0), (10_000, 20, 1.0)),
    sample=500,
    # 100,000 frames a callback take the client processes about 10 s to read on their one core: a callback
    # every 10 s.
    wide=Wide(subscribers=100_000, callbacks=6, rate=0.1, workers=6),
)
SMOKE = Sizes(runs=((10, 10, 20.0),), sample=10, wide=Wide(subscribers=20, callbacks=4, rate=20.0, workers=2))


def every(n: int, sample: int) -> int:
    """``timed_every`` for ``n`` subscribers: about ``sample`` of them timed, spread over the processes."""
    return max(1, n // max(1, sample))


def latencies(received: dict[int, list[int]], sent: dict[int, int]) -> list[float]:
    """Milliseconds from each version's time in ``sent`` to each time it was received."""
    return [(at - sent[v]) / 1e6 for v, times in received.items() if v in sent for at in times]


def quantiles(values: list[float]) -> dict[str, float]:
    return {f"p{round(q * 100)}": percentile(values, q) for q in QUANTILES} | {"samples": len(values)}


async def run_gateway(
    server: harness.Server, pids: list[int], commits: str, n: int, callbacks: int, rate: float, cfg: Any
) -> dict[str, Any]:
    """One run, on a task of its own, on ``server`` (bench/programs/timed.py, writing its commit times to the
    file ``commits``; its processes ``pids``): the request-to-frame and commit-to-frame latencies of the
    timed subscribers."""
    sizes: Sizes = cfg.latency_e2e
    timeout_s = timeout(cfg, n)
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=server.http, timeout=60))
        task_id = f"e2e-{uuid.uuid4().hex[:8]}"
        made = await create_task(http, task_id, attempts_for(callbacks))
        start = made["task"]["version"]
        url = f"{server.ws}/v1/tasks/{task_id}/ws?cursor={start}&token={made['subscribeToken']}"
        clients = await Clients.start(
            [(url, n, "caught-up")],
            procs=cfg.procs,
            stream=True,
            expect_close=1000,
            timeout_s=timeout_s,
            stall_s=harness.STALL_S,
            timed_every=every(n, sizes.sample),
        )
        stack.push_async_callback(clients.close)
        await clients.connect(timeout_s)
        stack.enter_context(split(pids, clients))
        # A worker of a --workers gateway, not its parent (which serves no socket).
        profiled = hundredk.a_worker(pids[1:]) if len(pids) > 1 else server.pid
        async with harness.profiled(profiled, f"latency-e2e-gateway-{n}"):
            sent, achieved = await post(http, task_id, made["callbackToken"], plan(callbacks), rate)
            await clients.final(start + callbacks)
            stats = await clients.done(timeout_s)
    committed = {v: at for (t, v), at in timed.read(commits).items() if t == task_id}
    received: dict[int, list[int]] = stats.pop("received")
    return {
        **stats,
        "achieved_rate": achieved,
        "request": quantiles(latencies(received, sent)),
        "commit": quantiles(latencies(received, committed)),
        "commits_timed": len(committed),
        "versions": len(sent),
    }


@contextlib.contextmanager
def split(pids: list[int], clients: Clients) -> Iterator[None]:
    """For the timed part of a run: the servers ``pids`` and this process on the first core, the client
    processes on the others (``harness.split_cores``; the sockets are opened before, on every core)."""
    cores = harness.split_cores()
    if cores is None:
        yield
        return
    with (
        harness.on_cores([*pids, os.getpid()], cores[0]),
        harness.on_cores([p.pid for p in clients.processes], cores[1]),
    ):
        yield


def timeout(cfg: Any, n: int) -> float:
    """A step's time bound: the run's, and more for the sockets of the run over several processes."""
    return harness.socket_bound(n, cfg.step_timeout_s)


async def post(
    http: httpx.AsyncClient, task_id: str, token: str, events: list[dict[str, object]], rate: float
) -> tuple[dict[int, int], float]:
    """Post ``events`` one at a time, each when due at ``rate`` (or once the previous one is answered):
    each version's request time (monotonic ns, just before it was sent), and the rate achieved."""
    headers = {"Authorization": f"Bearer {token}"}
    run = uuid.uuid4().hex[:8]
    sent: dict[int, int] = {}
    started = time.monotonic()
    for i, event in enumerate(events):
        await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
        at = time.monotonic_ns()
        answer = await http.post(
            f"/v1/tasks/{task_id}/callbacks",
            json={"callbackId": f"{run}-{i}", "event": event},
            headers=headers,
        )
        answer.raise_for_status()
        body = answer.json()
        if not body.get("changed"):
            raise RuntimeError(f"callback {i} ({event['type']}) changed nothing: {answer.text}")
        sent[body["task"]["version"]] = at
    took = time.monotonic() - started
    return sent, (len(events) - 1) / took if took > 0 and len(events) > 1 else math.nan


async def run_floor(
    server: harness.Server,
    pids: list[int],
    publishers: list[Any],
    url: str,
    frame: Callable[[int], str],
    n: int,
    frames: int,
    rate: float,
    cfg: Any,
) -> dict[str, Any]:
    """The same run on raw ``websockets`` broadcast servers (processes ``pids``), their subscribers at
    ``url``: each ``frame(version)`` sent to every one of ``publishers`` in turn, its time noted just before
    the first: publish-to-receive latencies."""
    sizes: Sizes = cfg.latency_e2e
    timeout_s = timeout(cfg, n)
    async with contextlib.AsyncExitStack() as stack:
        clients = await Clients.start(
            [(url, n, "hello")],
            procs=cfg.procs,
            stream=True,
            final=frames,
            timeout_s=timeout_s,
            stall_s=harness.STALL_S,
            timed_every=every(n, sizes.sample),
        )
        stack.push_async_callback(clients.close)
        await clients.connect(timeout_s)
        stack.enter_context(split(pids, clients))
        out = [frame(v) for v in range(1, frames + 1)]
        sent: dict[int, int] = {}
        async with harness.profiled(server.pid, f"latency-e2e-floor-{n}"):
            started = time.monotonic()
            for i, message in enumerate(out):
                await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
                sent[i + 1] = time.monotonic_ns()
                for publisher in publishers:
                    await publisher.send(message)
            stats = await clients.done(timeout_s)
    received: dict[int, list[int]] = stats.pop("received")
    return {**stats, "publish": quantiles(latencies(received, sent))}


async def one_process(
    cfg: Any, servers: Any, report: Report, gateway: asyncio.Task[harness.Server], commits: str
) -> list[str]:
    """The runs of ``Sizes.runs``: one gateway process (SQLite), one floor server; their details."""
    from websockets.asyncio.client import connect

    details = []
    for n, callbacks, rate in cfg.latency_e2e.runs:
        async with (
            servers.use("floor") as server,
            connect(f"{server.ws}/publish", compression=None) as publisher,
        ):
            floor = await run_floor(
                server, [server.pid], [publisher], f"{server.ws}/", sample_frame, n, callbacks, rate, cfg
            )
        gateway_server = await gateway
        run = await run_gateway(gateway_server, [gateway_server.pid], commits, n, callbacks, rate, cfg)
        details.append(record(report, n, callbacks, rate, run, floor, "one gateway process, SQLite"))
    return details


async def several_processes(
    cfg: Any, report: Report, gateway: asyncio.Task[harness.Server], commits: str
) -> str:
    """The run of ``Sizes.wide``: ``gateway serve --workers W`` on PostgreSQL beside W floor processes
    (bench/programs/sharded_floor.py, one port); its details."""
    wide: Wide = cfg.latency_e2e.wide
    n = wide.subscribers
    async with hundredk.floor(wide.workers) as (server, shards):
        floor = await run_floor(
            server,
            [pid for pid, _ in shards],
            [ws for _, ws in shards],
            f"{server.ws}/t/0",
            lambda v: hundredk.floor_frame("0", v),
            n,
            wide.callbacks,
            wide.rate,
            cfg,
        )
    gateway_server = await gateway
    pids = hundredk.family(gateway_server.pid)
    run = await run_gateway(gateway_server, pids, commits, n, wide.callbacks, wide.rate, cfg)
    where = f"gateway serve --workers {wide.workers} on PostgreSQL, the floor in {wide.workers} processes"
    return record(report, n, wide.callbacks, wide.rate, run, floor, where)


@contextlib.asynccontextmanager
async def workers_gateway(workers: int, commits: str) -> AsyncIterator[harness.Server]:
    """``gateway serve --workers W`` through bench/programs/timed.py, on a PostgreSQL database made for it."""
    async with harness.pg_database(harness.PG_ADMIN, "gw_bench_e2e") as url:
        port = harness.free_port()
        command = [*harness.gateway_command(port, url, timed=True), "--workers", str(workers)]
        with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
            log_path = Path(tmp) / "gateway.log"
            with log_path.open("wb") as log:
                process = await harness.spawn(
                    command, env=harness.gateway_env(extra={timed.ENV: commits}), stderr=log
                )
            try:
                await harness.wait_http(f"http://127.0.0.1:{port}", 60, process=process)
                async with asyncio.timeout(60):  # every worker started (each then accepts on the port)
                    while len(hundredk.family(process.pid)) < workers + 1:  # noqa: ASYNC110
                        await asyncio.sleep(0.1)
                yield harness.Server(port, process)
            finally:
                await harness.stop(process, 40)
                harness.summarize_log(port, log_path.read_text(errors="replace"))


async def workload(cfg: Any, servers: Any, report: Report) -> None:
    sizes: Sizes = cfg.latency_e2e
    harness.raise_nofile(max((n for n, _, _ in sizes.runs), default=0) + 1024)
    async with contextlib.AsyncExitStack() as stack:
        commits = str(Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gw-bench-"))) / "commits")
        # The gateways start while the first floor run goes.
        single = asyncio.create_task(
            stack.enter_async_context(harness.gateway(env={timed.ENV: commits}, timed=True))
        )
        stack.push_async_callback(settle, single)
        details = await one_process(cfg, servers, report, single, commits)
        if sizes.wide is not None:
            several = asyncio.create_task(
                stack.enter_async_context(workers_gateway(sizes.wide.workers, commits))
            )
            stack.push_async_callback(settle, several)
            details.append(await several_processes(cfg, report, several, commits))
    report.details.append(
        "latency end to end (the gateway or floor servers and the bench on one core, the subscribers on "
        "the other): " + "; ".join(details)
    )


async def settle(starting: asyncio.Task[harness.Server]) -> None:
    """The gateway's start, if the workload ended before it did: cut short (which stops the gateway)."""
    starting.cancel()
    await asyncio.gather(starting, return_exceptions=True)


def record(
    report: Report,
    n: int,
    callbacks: int,
    rate: float,
    gateway: dict[str, Any],
    floor: dict[str, Any],
    where: str,
) -> str:
    """One N's rows and checks; its details line."""
    for key, what in (("request", "request-to-frame"), ("commit", "commit-to-frame")):
        report.rows.append(
            Row(
                12,
                f"{what} p99 at N={n:,}, {rate:g}/s (floor: raw websockets publish-to-receive)",
                gateway[key]["p99"],
                floor["publish"]["p99"],
                "ms",
                f"<= {TARGET:g}x",
                digits=2,
            )
        )
        report.figure(f"{what} p99 at N={n}", gateway[key]["p99"])
    report.figure(f"publish-to-receive p99 at N={n}", floor["publish"]["p99"])
    report.frames(f"latency end to end, gateway, N={n}", gateway)
    report.frames(f"latency end to end, floor, N={n}", floor)
    if gateway["commits_timed"] < gateway["versions"]:
        report.problems.append(
            f"latency end to end N={n}: {gateway['commits_timed']} commit times for {gateway['versions']} "
            "versions"
        )
    return (
        f"N={n:,} ({where}), {callbacks} callbacks at {rate:g}/s "
        f"({gateway['achieved_rate']:.1f}/s achieved): "
        f"request-to-frame {ms(gateway['request'])}, commit-to-frame {ms(gateway['commit'])}; floor "
        f"publish-to-receive {ms(floor['publish'])}; gateway {frames_summary(gateway)}; floor "
        f"{frames_summary(floor)}"
    )


def ms(q: dict[str, float]) -> str:
    return f"p50 {q['p50']:.2f} / p95 {q['p95']:.2f} / p99 {q['p99']:.2f} ms ({q['samples']:,} samples)"
