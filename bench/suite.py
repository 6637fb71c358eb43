"""Every benchmark workload in one command: one table of figures beside their floors, and docs/benchmarks.md.

    python -m bench [--procs 4] [--pg-admin-url URL] [--only 1,2,...,17]
    python -m bench --smoke

Each figure is printed beside its floor measured in the same run (the same machine, the same noise) and
the ratio, with the target it is held to; targets are printed, never asserted. The run starts everything
it needs (gateways as ``gateway serve``, the floor servers, the client processes, a PostgreSQL database of
its own per run) and ends every process and drops every database it made, however it ends.

``--smoke`` runs every workload tiny (small N, short runs, in about 10 s: it starts its servers together
and lends a process to several workloads, see ``Servers``) and checks only that each produced a figure
and that no frame was lost or reordered (no subscriber failed to connect or missed its end); it exits 1
otherwise, and does not write docs/benchmarks.md. A full run writes docs/benchmarks.md (not with
``--only``) and exits 1 if a workload could not run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, Collection, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib import harness, needs
from bench.lib.report import (
    DOCS,
    WORKLOADS,
    Report,
    Row,
    cpu_probe,
    frames_summary,
    machine,
    table,
    write_docs,
)
from bench.workloads import (
    batches,
    callbacks,
    fanout,
    held,
    hosts,
    hundredk,
    latency_e2e,
    pg_ceiling,
    retention,
    scale_one,
    stream_live,
    streams,
    tags,
    workers_cost,
)

TERMINATED = threading.Event()  # SIGTERM was received


@dataclass(frozen=True)
class Config:
    callback_seconds: float
    callback_connections: int
    fanout: tuple[tuple[int, int, float], ...]  # (subscribers, callbacks, rate)
    memory_n: int
    latency_n: tuple[int, int, int]  # the baseline N, the N held to 2x of it, the N that sheds
    latency_seconds: float
    latency_repeats: int
    latency_rate: float
    storm_n: int
    storm_tasks: int
    retention_tasks: int
    retention_slices: int
    retention_growth: bool  # check the sizes (a smoke run's are too small to compare)
    tags: tags.Sizes
    workers_cost: workers_cost.Sizes
    scale_one: scale_one.Sizes
    hundredk: hundredk.Sizes
    latency_e2e: latency_e2e.Sizes
    hosts: hosts.Sizes
    pg_ceiling: pg_ceiling.Sizes
    streams: streams.Sizes
    stream_live: stream_live.Sizes
    batches: batches.Sizes
    celery_iterations: int
    celery_runs: int
    procs: int
    step_timeout_s: float
    total_timeout_s: float


FULL = Config(
    callback_seconds=5.0,
    callback_connections=32,
    fanout=((100, 300, 50.0), (1000, 100, 10.0), (5000, 30, 2.0)),
    memory_n=10_000,
    latency_n=(10, 1000, 5000),
    latency_seconds=20.0,
    latency_repeats=3,
    latency_rate=50.0,
    storm_n=5000,
    storm_tasks=10,
    retention_tasks=30_000,
    retention_slices=retention.SLICES,
    retention_growth=True,
    tags=tags.FULL,
    workers_cost=workers_cost.FULL,
    scale_one=scale_one.FULL,
    hundredk=hundredk.FULL,
    latency_e2e=latency_e2e.FULL,
    hosts=hosts.FULL,
    pg_ceiling=pg_ceiling.FULL,
    streams=streams.FULL,
    stream_live=stream_live.FULL,
    batches=batches.FULL,
    celery_iterations=10_000,
    celery_runs=5,
    procs=4,
    step_timeout_s=180.0,
    total_timeout_s=5400.0,
)
SMOKE = Config(
    callback_seconds=0.2,
    callback_connections=8,
    fanout=((50, 10, 50.0),),
    memory_n=200,
    latency_n=(2, 20, 100),
    latency_seconds=0.3,
    latency_repeats=1,
    latency_rate=50.0,
    storm_n=200,
    storm_tasks=2,
    retention_tasks=600,
    retention_slices=retention.SMOKE_SLICES,
    retention_growth=False,
    tags=tags.SMOKE,
    workers_cost=workers_cost.SMOKE,
    scale_one=scale_one.SMOKE,
    hundredk=hundredk.SMOKE,
    latency_e2e=latency_e2e.SMOKE,
    hosts=hosts.SMOKE,
    pg_ceiling=pg_ceiling.SMOKE,
    streams=streams.SMOKE,
    stream_live=stream_live.SMOKE,
    batches=batches.SMOKE,
    celery_iterations=1000,
    celery_runs=1,
    procs=2,
    step_timeout_s=30.0,
    total_timeout_s=300.0,
)


def need_fds(n: int) -> None:
    limit = harness.raise_nofile(n + 1024)
    if limit < n + 256:
        raise RuntimeError(
            f"RLIMIT_NOFILE is {limit}, too low for {n:,} sockets in one process: raise the hard limit "
            f"(ulimit -Hn) to {n + 1024} or more"
        )


# --- the server processes ----------------------------------------------------------------------------

ServerFactory = Callable[[], contextlib.AbstractAsyncContextManager[Any]]


@contextlib.asynccontextmanager
async def pg_gateway(admin_url: str) -> AsyncIterator[harness.Server]:
    async with harness.pg_database(admin_url, "gw_bench_all") as url, harness.gateway(url) as server:
        yield server


@contextlib.asynccontextmanager
async def sqlite_handler() -> AsyncIterator[int]:
    with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
        async with callbacks.floor("sqlite", str(Path(tmp) / "floor.db")) as port:
            yield port


@contextlib.asynccontextmanager
async def pg_handler(admin_url: str) -> AsyncIterator[int]:
    async with (
        harness.pg_database(admin_url, "gw_bench_all") as url,
        callbacks.floor("postgresql", url) as port,
    ):
        yield port


def server_factories(admin_url: str) -> dict[str, ServerFactory]:
    """The servers the workloads use, by name: a gateway (on a SQLite file of its own, or on a PostgreSQL
    database made for it), the raw ``websockets`` floor server, the callbacks workload's handlers."""
    return {
        "gateway": harness.gateway,
        "gateway on PostgreSQL": lambda: pg_gateway(admin_url),
        "floor": harness.floor_server,
        "fresh gateway": harness.gateway,
        "fresh floor": harness.floor_server,
        "handler without database": lambda: callbacks.floor("none", ""),
        "handler on SQLite": sqlite_handler,
        "handler on PostgreSQL": lambda: pg_handler(admin_url),
        "gateway counting its queries": tags.gateway,
    }


# What a smoke run starts, together, before a workload runs, and lends to it (see Servers).
SMOKE_SERVERS = {
    1: (
        "handler without database",
        "gateway",
        "handler on SQLite",
        "gateway on PostgreSQL",
        "handler on PostgreSQL",
    ),
    2: ("gateway", "floor"),
    3: ("fresh gateway", "fresh floor"),
    4: ("gateway",),
    5: ("gateway", "floor"),
    6: (),
    7: ("gateway counting its queries",),
    8: (),  # bench/workloads/celery_progress.py starts its gateway and its workers
    11: (),  # bench/workloads/workers_cost.py starts its gateways (one process, --workers 2)
    9: ("fresh gateway", "fresh floor", "gateway", "floor"),
    10: (),  # bench/workloads/hundredk.py starts its gateway (--workers) and floor processes
    12: ("floor",),  # bench/workloads/latency_e2e.py starts its gateways (through bench/programs/timed.py)
    13: (),  # bench/workloads/hosts.py starts its namespaces, its PostgreSQL and its gateways
    14: (),  # bench/workloads/pg_ceiling.py starts its cluster and its gateways
    15: (),  # bench/workloads/streams.py starts its gateways and floor handlers
    16: ("floor",),  # bench/workloads/stream_live.py starts its gateways and its resume floor
    17: ("gateway",),
}


class Servers:
    """Where the workloads get their server processes: ``async with servers.use(name) as server``.

    A full run starts a fresh process for every measurement and stops it after, so that nothing an earlier
    measurement left in a process (its memory, its database, its work) is counted in a later one. A smoke
    run, whose figures are not judged, starts the servers of all its workloads together before the first
    one (:meth:`lend`), stops them together after the last, and lends the same process to every
    measurement that uses its name: one SQLite gateway and one floor server serve workloads 1 (SQLite),
    2, 4 and 5, each run on a task of its own; the idle-memory workload, whose figure is the growth of a
    process's RSS from its baseline, has a gateway and a floor server that serve nothing else.
    """

    def __init__(self, factories: dict[str, ServerFactory]) -> None:
        self.factories = factories
        self.lent: dict[str, Any] = {}
        self._holders: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()

    def use(self, name: str) -> contextlib.AbstractAsyncContextManager[Any]:
        if name in self.lent:
            return contextlib.nullcontext(self.lent[name])
        return self.factories[name]()

    async def lend(self, names: Collection[str]) -> None:
        """Start these servers together; :meth:`use` lends them until :meth:`close`."""
        loop = asyncio.get_running_loop()
        started = {name: loop.create_future() for name in names}
        self._holders += [asyncio.create_task(self._hold(name, ready)) for name, ready in started.items()]
        results = await asyncio.gather(*started.values(), return_exceptions=True)
        for name, result in zip(started, results, strict=True):
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):  # the workload that uses it tries again, and says why
                print(f"{name} did not start: {type(result).__name__}: {result}", file=sys.stderr)
            else:
                self.lent[name] = result

    async def _hold(self, name: str, ready: asyncio.Future[Any]) -> None:
        try:
            async with self.factories[name]() as server:
                ready.set_result(server)
                await self._stop.wait()
        except asyncio.CancelledError:
            ready.cancel()
            raise
        except Exception as exc:
            if ready.done():
                raise
            ready.set_exception(exc)

    async def close(self) -> None:
        """Stop the lent servers (together)."""
        self._stop.set()
        self.lent.clear()
        for result in await asyncio.gather(*self._holders, return_exceptions=True):
            if isinstance(result, Exception):
                print(f"a server did not stop cleanly: {type(result).__name__}: {result}", file=sys.stderr)
        self._holders.clear()


# --- 1. callbacks/s ----------------------------------------------------------------------------------


async def workload_callbacks(cfg: Config, servers: Servers, report: Report) -> None:
    args = argparse.Namespace(seconds=cfg.callback_seconds, connections=cfg.callback_connections)

    def add(name: str, gateway: dict[str, Any], floor: dict[str, Any]) -> None:
        report.rows.append(
            Row(
                1,
                f"callbacks/s, {name} (floor: bare-driver handler)",
                gateway["per_s"],
                floor["per_s"],
                "/s",
                ">= 1.0x",
                0,
            )
        )
        report.figure(f"callbacks/s {name} gateway", gateway["per_s"])
        report.figure(f"callbacks/s {name} bare driver", floor["per_s"])
        share = gateway["per_s"] / bare["per_s"] if bare["per_s"] else math.nan
        report.details.append(
            f"callbacks/s {name}: {cfg.callback_connections} keep-alive connections, "
            f"{cfg.callback_seconds:g} s per server; the gateway does {share:.2f}x the no-database handler"
        )
        for label, result in (("gateway", gateway), ("bare driver", floor)):
            if result.get("errors"):
                report.details.append(
                    f"callbacks/s {name} {label}: answers other than 200: {result['errors']}"
                )

    async with servers.use("handler without database") as port:
        bare = await callbacks.measure(port, args)
    report.figure("callbacks/s no-database handler", bare["per_s"])
    try:
        async with servers.use("gateway") as server:
            gateway = await callbacks.measure_gateway(server, "sqlite", args)
        async with servers.use("handler on SQLite") as port:
            floor = await callbacks.measure(port, args)
        add("SQLite", gateway, floor)
        async with servers.use("gateway on PostgreSQL") as server:
            gateway = await callbacks.measure_gateway(server, "postgresql", args)
        async with servers.use("handler on PostgreSQL") as port:
            floor = await callbacks.measure(port, args)
        add("PostgreSQL", gateway, floor)
    finally:
        report.rows.append(
            Row(1, "callbacks/s, no-database handler (HTTP alone)", bare["per_s"], None, "/s", "(ceiling)", 0)
        )


# --- 2. fan-out --------------------------------------------------------------------------------------


async def workload_fanout(cfg: Config, servers: Servers, report: Report) -> None:
    for n, count, rate in cfg.fanout:
        need_fds(n)
        runs: dict[str, dict[int, dict[str, Any]]] = {"gateway": {}, "floor": {}}
        for subscribers in (0, n):  # the base first: the same callbacks (publishes) with no subscriber
            async with servers.use("gateway") as server:
                runs["gateway"][subscribers] = await fanout.bench_gateway(
                    subscribers, count, rate, cfg.procs, timeout_s=cfg.step_timeout_s, server=server
                )
        for subscribers in (0, n):
            async with servers.use("floor") as server:
                runs["floor"][subscribers] = await fanout.bench_floor(
                    subscribers, count, rate, cfg.procs, timeout_s=cfg.step_timeout_s, server=server
                )
        gateway, floor = runs["gateway"][n], runs["floor"][n]
        above = {
            side: (run[n]["cpu_s"] - run[0]["cpu_s"]) * 1e6 / run[n]["frames"]
            if run[n]["frames"]
            else math.nan
            for side, run in runs.items()
        }
        report.rows.append(
            Row(
                2,
                f"fan-out N={n:,}: server CPU per frame",
                gateway["cpu_us_per_frame"],
                floor["cpu_us_per_frame"],
                "us",
                "<= 1.3x (callbacks' own CPU included)",
            )
        )
        report.rows.append(
            Row(
                2,
                f"fan-out N={n:,}: CPU per frame above the same callbacks with no subscriber",
                above["gateway"],
                above["floor"],
                "us",
                "<= 1.3x",
            )
        )
        report.rows.append(
            Row(
                2,
                f"fan-out N={n:,}: frames lost + out of order",
                gateway["lost"] + gateway["out_of_order"],
                floor["lost"] + floor["out_of_order"],
                "",
                "0",
                0,
                ratio=math.nan,
            )
        )
        report.figure(f"fan-out N={n} gateway CPU/frame", gateway["cpu_us_per_frame"])
        report.figure(f"fan-out N={n} floor CPU/frame", floor["cpu_us_per_frame"])
        # A difference of two readings: on a tiny smoke run noise may take it to zero or below; it must
        # exist.
        report.figure(
            f"fan-out N={n} gateway CPU/frame above no subscriber", above["gateway"], positive=False
        )
        report.figure(f"fan-out N={n} floor CPU/frame above no subscriber", above["floor"], positive=False)
        report.frames(f"fan-out N={n} gateway", gateway)
        report.frames(f"fan-out N={n} floor", floor)
        base_gateway, base_floor = runs["gateway"][0], runs["floor"][0]
        report.details.append(
            f"fan-out N={n:,}, {count} callbacks at {rate:g}/s, {cfg.procs} client processes: gateway "
            f"{frames_summary(gateway)}; callbacks p50 {gateway['callback_p50_ms']:.1f} ms, p99 "
            f"{gateway['callback_p99_ms']:.1f} ms | floor {frames_summary(floor)} | with no subscriber "
            f"(the base): gateway {base_gateway['cpu_s'] * 1e3:,.1f} ms of CPU "
            f"({base_gateway['cpu_us_per_callback']:,.0f} us per callback), floor "
            f"{base_floor['cpu_s'] * 1e3:,.1f} ms; with {n:,}: gateway {gateway['cpu_s'] * 1e3:,.1f} ms, "
            f"floor {floor['cpu_s'] * 1e3:,.1f} ms"
        )


# --- 3. idle memory ----------------------------------------------------------------------------------


async def workload_memory(cfg: Config, servers: Servers, report: Report) -> None:
    n = cfg.memory_n
    need_fds(n)
    gateway = await held.idle_gateway(n, servers, procs=cfg.procs, timeout_s=cfg.step_timeout_s)
    floor = await held.idle_floor(n, servers, procs=cfg.procs, timeout_s=cfg.step_timeout_s)
    report.rows.append(
        Row(
            3,
            f"idle memory per subscriber, N={n:,}",
            gateway["bytes_per_subscriber"] / 1024,
            floor["bytes_per_subscriber"] / 1024,
            "KiB",
            "<= 1.5x",
        )
    )
    report.figure("idle memory gateway", gateway["bytes_per_subscriber"])
    report.figure("idle memory floor", floor["bytes_per_subscriber"])
    report.frames("idle memory gateway", gateway)
    report.frames("idle memory floor", floor)
    report.details.append(
        f"idle memory N={n:,}: the table's figure is after a first event frame too; after the resume "
        f"frames alone, gateway "
        f"{gateway['resumed_bytes_per_subscriber'] / 1024:.1f} KiB, floor "
        f"{floor['resumed_bytes_per_subscriber'] / 1024:.1f} KiB per subscriber; "
        f"{gateway['connected']:,} and {floor['connected']:,} sockets connected"
    )


# --- 4. callback latency under fan-out ---------------------------------------------------------------


async def workload_latency(cfg: Config, servers: Servers, report: Report) -> None:
    """Each N's callbacks in ``latency_repeats`` runs of ``latency_seconds``, the Ns alternated (10, 1,000,
    5,000, 10, ...: the machine's changes of speed fall on each alike), their latencies pooled: 3,003 in all,
    so that the p99 is the 30th slowest, not the 11th of 1,001 that one stall of a shared machine moves. A
    run is not made longer instead: at N=1,000 the client processes, on one core, read about as fast as 50
    callbacks a second make frames, and a run of 60 s left them a minute behind, past the step's bound."""
    small, middle, large = cfg.latency_n
    seconds, rate = cfg.latency_seconds, cfg.latency_rate
    need_fds(large)
    count = int(seconds * rate) + 1
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in (small, middle, large)}
    for _ in range(cfg.latency_repeats):
        for subscribers in runs:
            async with servers.use("gateway") as server:
                runs[subscribers].append(
                    await fanout.bench_gateway(
                        subscribers,
                        count,
                        rate,
                        cfg.procs,
                        timeout_s=cfg.step_timeout_s,
                        seconds=seconds,
                        server=server,
                        cores=harness.split_cores(),
                    )
                )
    pooled = {n: fanout.pooled(each) for n, each in runs.items()}
    base = pooled[small]
    for n, target in ((middle, "<= 2x"), (large, "(shed fan-out)")):
        for quantile, what in (("p99", target), ("p50", "(beside the p99)")):
            report.rows.append(
                Row(
                    4,
                    f"callback {quantile} at N={n:,} (floor: N={small})",
                    pooled[n][f"callback_{quantile}_ms"],
                    base[f"callback_{quantile}_ms"],
                    "ms",
                    what,
                )
            )
        report.rows.append(
            Row(
                4,
                f"callbacks/s achieved at N={n:,} of {rate:g} asked (floor: N={small})",
                pooled[n]["achieved_rate"],
                base["achieved_rate"],
                "/s",
                f"{rate:g}/s held",
            )
        )
    for n, each in runs.items():
        report.figure(f"callback p99 at N={n}", pooled[n]["callback_p99_ms"])
        if n != small:
            for run in each:
                report.frames(f"callback latency N={n}", run)
    lines = []
    for n, each in runs.items():
        p99s = ", ".join(f"{run['callback_p99_ms']:.1f}" for run in each)
        lines.append(
            f"N={n:,}: {pooled[n]['timed']} callbacks, p50 {pooled[n]['callback_p50_ms']:.1f} ms, p99 "
            f"{pooled[n]['callback_p99_ms']:.1f} ms (each run's p99: {p99s} ms), "
            f"{pooled[n]['achieved_rate']:.1f}/s, gateway CPU per callback "
            f"{pooled[n]['cpu_us_per_callback']:,.0f} us, the last run's {frames_summary(each[-1])}"
        )
    report.details.append(
        f"callback latency, {rate:g}/s asked, {cfg.latency_repeats} runs of {seconds:g} s per N (the Ns "
        "alternated, their latencies pooled), one task with N subscribers: " + "; ".join(lines)
    )


# --- 5. reconnect storm ------------------------------------------------------------------------------


async def workload_storm(cfg: Config, servers: Servers, report: Report) -> None:
    n = cfg.storm_n
    need_fds(n)
    gateway = await held.storm_gateway(
        n, cfg.storm_tasks, servers, procs=cfg.procs, timeout_s=cfg.step_timeout_s
    )
    floor = await held.storm_floor(n, servers, procs=cfg.procs, timeout_s=cfg.step_timeout_s)
    report.rows.append(
        Row(
            5,
            f"reconnect storm, N={n:,}: until every resume frame",
            gateway["seconds"],
            floor["seconds"],
            "s",
            "<= 2x",
            2,
        )
    )
    report.figure("reconnect storm gateway", gateway["seconds"])
    report.figure("reconnect storm floor", floor["seconds"])
    report.frames("reconnect storm gateway", gateway)
    report.frames("reconnect storm floor", floor)
    report.details.append(
        f"reconnect storm N={n:,} over {cfg.storm_tasks} tasks of {held.STORM_HISTORY} versions, all at "
        f"once from {cfg.procs} client processes: gateway resume frames {gateway['resume']}, "
        f"{gateway['retries']} attempts retried, {gateway['failed']} failed; floor {floor['resume']}, "
        f"{floor['retries']} retried, {floor['failed']} failed; "
        f"connections dropped by a full accept queue (kernel ListenOverflows, machine-wide, retried by "
        f"TCP after 1 s, 3 s, ...): gateway {gateway['listen_overflows']}, floor {floor['listen_overflows']}"
    )
    for label, result in (("gateway", gateway), ("floor", floor)):
        if result["errors"]:
            report.details.append(f"reconnect storm {label}: {'; '.join(result['errors'])}")


# --- 6. retention ------------------------------------------------------------------------------------


async def workload_retention(cfg: Config, servers: Servers, report: Report) -> None:
    """bench/workloads/retention.py in process, on a SQLite file and a PostgreSQL cluster of its own (no
    server): autovacuum on, as the shared server's is not."""
    for backend in ("sqlite", "postgresql"):
        async with retention.database(backend) as url:
            result = await retention.churn(
                url,
                cfg.retention_tasks,
                slices=cfg.retention_slices,
                growth=cfg.retention_growth,
                pass_s=None if cfg.retention_growth else retention.SMOKE_PASS_S,
                say=lambda line: None,
            )
        first, last = result.rounds[0], result.rounds[-1]
        report.rows.append(
            Row(
                6,
                f"retention, {result.backend}: database size after round 3 (floor: after round 1)",
                last.after.total / 2**20,
                first.after.total / 2**20,
                "MiB",
                f"<= {retention.MAX_GROWTH}x",
                2,
            )
        )
        report.rows.append(
            Row(
                6,
                f"retention, {result.backend}: bytes per finished task",
                result.bytes_per_task,
                None,
                "B",
                "",
                0,
            )
        )
        report.figure(f"retention {result.backend} size", last.after.total)
        report.figure(f"retention {result.backend} bytes per task", result.bytes_per_task)
        report.problems.extend(result.problems)
        report.details.extend(f"retention {result.backend}: FAILED {problem}" for problem in result.problems)
        report.details.append(
            f"retention {result.backend}, {cfg.retention_tasks:,} tasks: "
            + "; ".join(
                f"round {r.number}: {r.after.total / 2**20:.2f} MiB ({r.after.detail})" for r in result.rounds
            )
            + "".join(f"; {note}" for note in result.notes)
        )


# --- 7. tags -----------------------------------------------------------------------------------------


async def workload_tags(cfg: Config, servers: Servers, report: Report) -> None:
    """bench/workloads/tags.py: tag subscriptions beside task subscriptions (fan-out, subscribe, reconnect
    storm)."""
    need_fds(cfg.tags.tags)
    async with servers.use("gateway counting its queries") as server:
        await tags.workload(server, cfg.tags, cfg.procs, cfg.step_timeout_s, report)


# --- 8. Celery progress() ----------------------------------------------------------------------------


async def workload_celery(cfg: Config, servers: Servers, report: Report) -> None:
    """bench/workloads/celery_progress.py: a Celery task's time with progress() reported, beside the same
    without."""
    from bench.workloads import celery_progress  # Celery is the test extra's: only this workload needs it

    await celery_progress.workload(cfg.celery_iterations, cfg.celery_runs, report)


# --- the run -----------------------------------------------------------------------------------------

Workload = Callable[[Config, Servers, Report], Coroutine[Any, Any, None]]
RUNNERS: dict[int, Workload] = {
    1: workload_callbacks,
    2: workload_fanout,
    3: workload_memory,
    4: workload_latency,
    5: workload_storm,
    6: workload_retention,
    7: workload_tags,
    8: workload_celery,
    11: workers_cost.workload,
    9: scale_one.workload,
    10: hundredk.workload,
    12: latency_e2e.workload,
    13: hosts.workload,
    14: pg_ceiling.workload,
    15: streams.workload,
    16: stream_live.workload,
    17: batches.workload,
}


async def run(args: argparse.Namespace) -> int:
    cfg = SMOKE if args.smoke else FULL
    if args.procs:
        cfg = Config(**{**cfg.__dict__, "procs": args.procs})
    only = sorted({int(x) for x in args.only.split(",")}) if args.only else sorted(RUNNERS)
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None

    def terminate() -> None:
        TERMINATED.set()
        main_task.cancel()

    loop.add_signal_handler(signal.SIGTERM, terminate)
    # Children inherit the limit: raise it before any gateway, floor or client process starts.
    harness.raise_nofile(
        max(cfg.memory_n, cfg.storm_n, cfg.tags.tags, *cfg.latency_n, *(n for n, _, _ in cfg.fanout)) + 1024
    )
    report = Report()
    probe_start = cpu_probe()
    started = time.monotonic()
    try:
        pg_version = await harness.postgres_version(args.pg_admin_url)
        for name in await harness.drop_stale_databases(args.pg_admin_url):
            print(f"dropped {name}, left by a bench that was killed", flush=True)
    except Exception as exc:
        pg_version = f"unreachable ({type(exc).__name__}: {exc})"
        report.problems.append(f"PostgreSQL at {args.pg_admin_url} is unreachable: {exc}")
    mode = "smoke" if args.smoke else "full"
    print(
        f"python -m bench ({mode}): workloads {', '.join(map(str, only))}; {os.cpu_count()} cores", flush=True
    )
    servers = Servers(server_factories(args.pg_admin_url))
    try:
        async with asyncio.timeout(cfg.total_timeout_s):
            if args.smoke:
                t0 = time.monotonic()
                names = list(dict.fromkeys(name for number in only for name in SMOKE_SERVERS[number]))
                await servers.lend(names)
                took = time.monotonic() - t0
                print(
                    f"[{time.monotonic() - started:6.1f} s] {len(servers.lent)} servers started together "
                    f"in {took:.1f} s, lent to the workloads",
                    flush=True,
                )
            for number in only:
                name = WORKLOADS[number][0]
                print(f"[{time.monotonic() - started:6.1f} s] {number}. {name} ...", flush=True)
                async with needs.watched(f"{number}. {name}", report.needs) as need:
                    try:
                        await RUNNERS[number](cfg, servers, report)
                    except Exception as exc:
                        traceback.print_exc()
                        report.failures.append(f"{number}. {name}: {type(exc).__name__}: {exc}")
                    finally:
                        report.gateway_logs(name)
                print(
                    f"[{time.monotonic() - started:6.1f} s] {number}. {name} took {need.seconds:.1f} s "
                    f"(peaks: its processes {need.rss / 2**30:.2f} GiB RSS, machine {need.used / 2**30:.2f} "
                    f"GiB used, {need.sockets:,} TCP sockets)",
                    flush=True,
                )
    except TimeoutError:
        report.failures.append(f"the run passed its total time bound of {cfg.total_timeout_s:.0f} s")
    finally:
        if servers.lent:
            t0 = time.monotonic()
            await servers.close()
            report.gateway_logs("the servers lent to several workloads")
            took = time.monotonic() - t0
            print(f"[{time.monotonic() - started:6.1f} s] lent servers stopped in {took:.1f} s", flush=True)
    elapsed = time.monotonic() - started
    print()
    print(table(report.rows, markdown=False))
    print()
    for detail in report.details:
        print(f"- {detail}")
    for failure in report.failures:
        print(f"FAILED {failure}")
    if args.smoke:
        problems = report.failures + report.problems
        for problem in report.problems:
            print(f"CHECK {problem}")
        verdict = "FAILED" if problems else "passed"
        print(f"smoke {verdict}: {len(report.rows)} figures, {elapsed:.1f} s")
        return 1 if problems else 0
    if args.only:
        print("(--only: docs/benchmarks.md not written)")
    else:
        write_docs(report, cfg.procs, machine(pg_version, (probe_start, cpu_probe())), elapsed)
        print(f"wrote {DOCS.relative_to(harness.ROOT)} ({elapsed:.0f} s)")
    return 1 if report.failures else 0


def command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="every workload tiny; check, do not write docs")
    parser.add_argument("--procs", type=int, default=0, help="client processes (default: 4, smoke 2)")
    parser.add_argument("--only", default="", help="comma-separated workload numbers (1-17)")
    parser.add_argument("--pg-admin-url", default=harness.PG_ADMIN)
    args = parser.parse_args(argv)
    status = 1
    try:
        status = asyncio.run(run(args))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("terminated" if TERMINATED.is_set() else "interrupted", file=sys.stderr)
        status = 143 if TERMINATED.is_set() else 130
    finally:
        harness.kill_all()
        for name in harness.drop_leftover_databases():
            print(f"dropped leftover database {name}", file=sys.stderr)
    return status
