"""Workload 11: more processes cost no more per unit of work: ``gateway serve --workers 2`` beside one.

On PostgreSQL (a database of its own per gateway), alternating one process and ``--workers 2`` (1, 2, 1,
2, ...) and taking the medians, since other work shares the machine:

1. callbacks: ``connections`` keep-alive connections (bench/programs/callback_client.py, its own process)
drive
   tasks through start and progress for ``seconds``: the server's CPU (the parent and every child, from
   /proc) per applied callback, the throughput, the mean group-commit batch size per process
   (``gateway_callbacks_batched`` / ``gateway_callback_batches``) and the bus traffic (messages each
   process's listener heard, per applied callback);
2. fan-out: ``subscribers`` sockets on one task, spread by the kernel over the processes, ``fanout_callbacks``
   callbacks at ``fanout_rate``: the server's CPU per delivered frame; every subscriber checks its frames
   (none lost or out of order).

    python -m bench workers_cost [--smoke]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib import harness
from bench.lib.harness import Clients, cpu_seconds
from bench.lib.report import Report, Row, frames_summary
from bench.workloads import callbacks, fanout


@dataclass(frozen=True)
class Sizes:
    connections: int  # keep-alive callback connections
    seconds: float  # per callback run
    warmup_s: float  # callbacks driven before a run is measured (each process's pool and statements ready)
    alternations: int  # (one process, --workers 2) pairs
    subscribers: int  # fan-out sockets, on one task
    fanout_callbacks: int
    fanout_rate: float
    together: bool = False  # start both gateways at once (a smoke run)


FULL = Sizes(
    connections=64,
    seconds=8.0,
    warmup_s=3.0,
    alternations=2,
    subscribers=1000,
    fanout_callbacks=100,
    fanout_rate=20.0,
)
SMOKE = Sizes(
    connections=8,
    seconds=0.5,
    warmup_s=0.0,
    alternations=1,
    subscribers=20,
    fanout_callbacks=5,
    fanout_rate=50.0,
)


@dataclass
class Workers:
    """``gateway serve --workers N`` (N = 1: no flag, one process) on a free port."""

    port: int
    process: asyncio.subprocess.Process
    workers: int

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def pids(self) -> list[int]:
        """The parent and all its descendants."""
        found, todo = [], [self.process.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            with contextlib.suppress(OSError):
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(c) for c in (task / "children").read_text().split()]
        return found

    def counters(self) -> dict[str, float]:
        """Summed over the processes: user and system CPU seconds (/proc/PID/stat, clock ticks), and
        voluntary and involuntary context switches (/proc/PID/status)."""
        total = {"user_s": 0.0, "system_s": 0.0, "voluntary": 0.0, "involuntary": 0.0}
        for pid in self.pids():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total["user_s"] += int(fields[11]) / harness.TICKS
                total["system_s"] += int(fields[12]) / harness.TICKS
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("voluntary_ctxt_switches:"):
                        total["voluntary"] += int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        total["involuntary"] += int(line.split()[1])
        return total

    def cpu(self) -> float:
        total = 0.0
        for pid in self.pids():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += cpu_seconds(pid)
        return total


@contextlib.asynccontextmanager
async def gateway(workers: int) -> AsyncIterator[Workers]:
    async with harness.pg_database(prefix="gw_bench_wk") as url:
        with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
            port = harness.free_port()
            command = harness.gateway_command(port, url) + (
                ["--workers", str(workers)] if workers > 1 else []
            )
            log_path = Path(tmp) / "gateway.log"
            with log_path.open("wb") as log:
                process = await harness.spawn(command, env=harness.gateway_env(), stderr=log)
            try:
                await harness.wait_http(f"http://127.0.0.1:{port}", process=process)
                server = Workers(port, process, workers)
                await processes(server)  # every child answers before the run
                yield server
            finally:
                await harness.stop(process)
                harness.summarize_log(port, log_path.read_text(errors="replace"))


async def processes(server: Workers, tries: int = 200) -> dict[int, dict[str, float]]:
    """Each process's counters (by its pid), scraped from /metrics on fresh connections until every one
    answered (the kernel hands each connection to one of them)."""
    import httpx

    names = ("gateway_callback_batches", "gateway_callbacks_batched", "gateway_bus_messages_heard")
    seen: dict[int, dict[str, float]] = {}
    for _ in range(tries):
        async with httpx.AsyncClient(base_url=server.http, timeout=10) as http:
            text = (await http.get("/metrics")).text
        pid = int(fanout.metric(text, "gateway_process_id"))
        seen[pid] = {name: fanout.metric(text, name) for name in names}
        if len(seen) == server.workers:
            return seen
    raise RuntimeError(f"only {len(seen)} of {server.workers} processes answered /metrics")


async def callbacks_run(server: Workers, sizes: Sizes) -> dict[str, Any]:
    args = argparse.Namespace(seconds=sizes.seconds, connections=sizes.connections)
    if sizes.warmup_s:
        await callbacks.measure(
            server.port, argparse.Namespace(seconds=sizes.warmup_s, connections=sizes.connections)
        )
    before, cpu0, counters0 = await processes(server), server.cpu(), server.counters()
    async with contextlib.AsyncExitStack() as stack:
        for pid in server.pids()[1:] or [server.process.pid]:
            await stack.enter_async_context(harness.profiled(pid, f"workers-{server.workers}-{pid}"))
        result = await callbacks.measure(server.port, args)
    cpu, after = server.cpu() - cpu0, await processes(server)
    counters = {k: v - counters0[k] for k, v in server.counters().items()}
    deltas = {pid: {k: after[pid][k] - before[pid][k] for k in after[pid]} for pid in after}
    applied = sum(d["gateway_callbacks_batched"] for d in deltas.values())
    heard = [d["gateway_bus_messages_heard"] for d in deltas.values()]
    return {
        **result,
        "applied": applied,
        "cpu_us": cpu * 1e6 / applied if applied else float("nan"),
        "batch": [
            d["gateway_callbacks_batched"] / d["gateway_callback_batches"]
            if d["gateway_callback_batches"]
            else 0
            for d in deltas.values()
        ],
        "heard_per_callback": statistics.mean(heard) / applied if applied else float("nan"),
        **{f"{k}_per_callback": v / applied if applied else float("nan") for k, v in counters.items()},
    }


async def fanout_run(server: Workers, sizes: Sizes, procs: int, timeout_s: float) -> dict[str, Any]:
    import httpx

    task_id = f"wk-{uuid.uuid4().hex[:8]}"
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=server.http, timeout=60))
        made = await fanout.create_task(http, task_id, fanout.attempts_for(sizes.fanout_callbacks))
        start = made["task"]["version"]
        url = f"{server.ws}/v1/tasks/{task_id}/ws?cursor={start}&token={made['subscribeToken']}"
        clients = await Clients.start(
            [(url, sizes.subscribers, "caught-up")],
            procs=procs if sizes.subscribers >= 100 else 1,  # a smoke run's few: one client process
            stream=True,
            expect_close=1000,
            timeout_s=timeout_s,
        )
        stack.push_async_callback(clients.close)
        await clients.connect(timeout_s)
        cpu0 = server.cpu()
        async with contextlib.AsyncExitStack() as profiles:
            for pid in server.pids()[1:] or [server.process.pid]:
                await profiles.enter_async_context(
                    harness.profiled(pid, f"workers-fanout-{server.workers}-{pid}")
                )
            posted = await fanout.post_callbacks(
                http, task_id, made["callbackToken"], fanout.plan(sizes.fanout_callbacks), sizes.fanout_rate
            )
            await clients.final(start + posted["posted"])
            stats = await clients.done(timeout_s)
            cpu = server.cpu() - cpu0
    frames = stats.get("deliveries", 0)
    return {**stats, "frames": frames, "cpu_us": cpu * 1e6 / frames if frames else float("nan")}


@contextlib.asynccontextmanager
async def both() -> AsyncIterator[dict[int, Workers]]:
    """One process and ``--workers 2`` started together (a smoke run's, whose figures are not judged: the
    idle one would be noise beside the other)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    ready: dict[int, asyncio.Future[Workers]] = {w: loop.create_future() for w in (1, 2)}

    async def hold(workers: int) -> None:
        try:
            async with gateway(workers) as server:
                ready[workers].set_result(server)
                await stop.wait()
        except BaseException as exc:
            if not ready[workers].done():
                ready[workers].set_exception(exc)
            raise

    holders = [asyncio.create_task(hold(w)) for w in ready]
    try:
        yield {w: await future for w, future in ready.items()}
    finally:
        stop.set()
        await asyncio.gather(*holders, return_exceptions=True)


async def measure(
    server: Workers, sizes: Sizes, procs: int, timeout_s: float, runs: dict[str, Any], say: Any
) -> None:
    """Callbacks, then fan-out (unless ``sizes.subscribers`` is 0), on ``server``: into ``runs``."""
    workers = server.workers
    result = await callbacks_run(server, sizes)
    runs[f"cb{workers}"].append(result)
    say(
        f"callbacks, {workers} process(es): {result['cpu_us']:.0f} us/callback, "
        f"{result['per_s']:.0f}/s, batches {[round(b, 2) for b in result['batch']]}, "
        f"heard/callback {result['heard_per_callback']:.2f}, errors {result['errors']}; per "
        f"callback: user {result['user_s_per_callback'] * 1e6:.0f} us, system "
        f"{result['system_s_per_callback'] * 1e6:.0f} us, context switches "
        f"{result['voluntary_per_callback']:.2f} + {result['involuntary_per_callback']:.2f} forced"
    )
    if sizes.subscribers:
        result = await fanout_run(server, sizes, procs, timeout_s)
        runs[f"fo{workers}"].append(result)
        say(f"fan-out, {workers} process(es): {result['cpu_us']:.1f} us/frame, {frames_summary(result)}")


async def run(
    sizes: Sizes, procs: int, timeout_s: float, say: Any = print
) -> dict[str, list[dict[str, Any]]]:
    """Alternating gateways (one process, --workers 2, ...), each started for its measurement (both at
    once with ``sizes.together``); by kind ("cb1", "cb2", "fo1", "fo2"), every run's result."""
    runs: dict[str, list[dict[str, Any]]] = {"cb1": [], "cb2": [], "fo1": [], "fo2": []}
    for _ in range(sizes.alternations):
        if sizes.together:
            async with both() as servers:
                for workers in (1, 2):
                    await measure(servers[workers], sizes, procs, timeout_s, runs, say)
            continue
        for workers in (1, 2):
            async with gateway(workers) as server:
                await measure(server, sizes, procs, timeout_s, runs, say)
    return runs


def median(results: list[dict[str, Any]], key: str) -> float:
    return float(statistics.median(r[key] for r in results))


async def workload(cfg: Any, servers: Any, report: Report) -> None:
    sizes: Sizes = cfg.workers_cost
    runs = await run(sizes, cfg.procs, cfg.step_timeout_s, say=lambda line: None)
    one, two = runs["cb1"], runs["cb2"]
    report.rows.append(
        Row(
            11,
            "--workers 2: server CPU per applied callback (floor: one process)",
            median(two, "cpu_us"),
            median(one, "cpu_us"),
            "us",
            "<= 1.2x",
        )
    )
    report.rows.append(
        Row(
            11,
            "--workers 2: callbacks/s (floor: one process)",
            median(two, "per_s"),
            median(one, "per_s"),
            "/s",
            "(shown)",
            0,
        )
    )
    report.rows.append(
        Row(
            11,
            f"--workers 2, N={sizes.subscribers:,} over both: server CPU per frame (floor: one process)",
            median(runs["fo2"], "cpu_us"),
            median(runs["fo1"], "cpu_us"),
            "us",
            "<= 1.1x",
        )
    )
    lost = sum(r["lost"] + r["out_of_order"] for r in runs["fo1"] + runs["fo2"])
    report.rows.append(Row(11, "--workers 2 fan-out: frames lost + out of order", lost, None, "", "0", 0))
    report.figure("workers 2 CPU/callback", median(two, "cpu_us"))
    report.figure("workers 1 CPU/callback", median(one, "cpu_us"))
    report.figure("workers 2 CPU/frame", median(runs["fo2"], "cpu_us"))
    report.figure("workers 1 CPU/frame", median(runs["fo1"], "cpu_us"))
    for kind in ("fo1", "fo2"):
        for r in runs[kind]:
            report.frames(f"workers {kind[-1]} fan-out", r)

    def batches(results: list[dict[str, Any]]) -> str:
        return ", ".join("/".join(f"{b:.1f}" for b in r["batch"]) for r in results)

    def split(results: list[dict[str, Any]]) -> str:
        return (
            f"user {median(results, 'user_s_per_callback') * 1e6:.0f} us, system "
            f"{median(results, 'system_s_per_callback') * 1e6:.0f} us, context switches "
            f"{median(results, 'voluntary_per_callback'):.2f} + "
            f"{median(results, 'involuntary_per_callback'):.2f} forced"
        )

    report.details.append(f"more processes, per callback: one process {split(one)}; --workers 2 {split(two)}")
    report.details.append(
        f"more processes: {sizes.connections} keep-alive callback connections on PostgreSQL, "
        f"{sizes.seconds:g} s per run, {sizes.alternations} alternations (1, 2, ...), medians; mean "
        f"group-commit batch per process, "
        f"one process {batches(one)}, --workers 2 {batches(two)}; bus messages heard per callback by each "
        f"process: one {median(one, 'heard_per_callback'):.2f}, two {median(two, 'heard_per_callback'):.2f}; "
        f"answers other than 200: {[r['errors'] for r in one + two if r['errors']]}; fan-out "
        f"{sizes.fanout_callbacks} callbacks at {sizes.fanout_rate:g}/s to {sizes.subscribers:,} "
        "subscribers: " + " | ".join(frames_summary(r) for r in runs["fo1"] + runs["fo2"])
    )


async def main(args: argparse.Namespace) -> None:
    sizes = SMOKE if args.smoke else FULL
    if args.alternations:
        sizes = Sizes(**{**sizes.__dict__, "alternations": args.alternations})
    if args.callbacks_only:
        sizes = Sizes(**{**sizes.__dict__, "subscribers": 0})
    runs = await run(sizes, args.procs, 120.0, say=lambda line: print(line, flush=True))
    for kind, results in runs.items():
        if results:
            print(
                f"{kind}: median {median(results, 'cpu_us'):.1f} us"
                + (f", {median(results, 'per_s'):.0f}/s" if kind.startswith("cb") else "")
            )


def command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench workers_cost", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--alternations", type=int, default=0)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--callbacks-only", action="store_true")
    return harness.run_to_the_end(main(parser.parse_args(argv)))
