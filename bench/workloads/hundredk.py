"""Workload 10: 100,000 subscribers over ``gateway serve --workers W`` on PostgreSQL, beside raw
``websockets`` serving the same sockets from as many processes (bench/programs/sharded_floor.py).

    python -m bench hundredk [--smoke]      (or as workload 10 of python -m bench)

10,000 tasks with 10 subscribers each; callbacks at 200/s for 60 s, each on a task picked at random (the
picks drawn before the run, so that each subscriber knows the version it ends at). Measured: the CPU of
every process of the gateway (the parent and each worker, read from their CPU-time clocks) per delivered
frame, beside the floor's processes; the callbacks' p99 beside the same callbacks with no subscriber;
the longest full garbage collection of each gateway process (bench/programs/gcwatched.py); a reconnect storm
of the 100,000 (every socket dropped, all reconnecting at once with their cursors) beside the floor's time
to open them; frames lost or out of order, checked per subscriber by the client processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from math import nan
from pathlib import Path
from typing import Any

from bench.lib import harness
from bench.lib.harness import Clients, percentile
from bench.lib.report import Report, Row, frames_summary
from bench.programs.callback_client import exchange, request_bytes
from bench.workloads import held

# Requests in flight at once (creations, callbacks): the connections of :class:`RawHttp`.
HTTP_CONNECTIONS = 64
GC_TARGET_S = 0.050


@dataclass(frozen=True)
class Sizes:
    subscribers: int
    tasks: int  # subscribers / tasks each
    rate: float  # callbacks/s
    seconds: float  # of callbacks with the subscribers
    base_seconds: float  # of the same callbacks with none (CPU per callback and p99 of the base)
    workers: int  # gateway processes, and floor processes
    procs: int  # client processes (at least; harness.Clients takes more if a process would hold too many)
    together: bool = False  # the gateway's side and the floor's at once (smoke: its figures are not judged)


FULL = Sizes(
    subscribers=100_000, tasks=10_000, rate=200.0, seconds=60.0, base_seconds=10.0, workers=6, procs=6
)
SMOKE = Sizes(
    subscribers=200, tasks=20, rate=50.0, seconds=1.0, base_seconds=0.5, workers=2, procs=2, together=True
)


# --- processes ---------------------------------------------------------------------------------------


def family(pid: int) -> list[int]:
    """``pid`` and its descendants now."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with contextlib.suppress(OSError):
                    queue += [
                        int(c) for c in Path(f"/proc/{current}/task/{task}/children").read_text().split()
                    ]
    return found


def a_worker(children: list[int]) -> int:
    """A ``--workers`` child among ``children`` of the parent: not multiprocessing's resource tracker."""
    for pid in children:
        with contextlib.suppress(OSError):
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise RuntimeError(f"no worker among {children}")


def cpu_of(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += harness.cpu_seconds(pid)
    return total


async def every_worker(gc_dir: str, processes: int, timeout_s: float = 60) -> None:
    """Until each process of the gateway wrote its file (at start), polled: it says so nowhere else."""
    async with asyncio.timeout(timeout_s):
        while len(os.listdir(gc_dir)) < processes:  # noqa: ASYNC110
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def gateway(database_url: str, workers: int, gc_dir: str) -> AsyncIterator[harness.Server]:
    """``gateway serve --workers W`` through bench/programs/gcwatched.py (each process's GC pauses in
    ``gc_dir``)."""
    port = harness.free_port()
    command = harness.program("gcwatched", "serve", "--port", str(port), "--database-url", database_url)
    command += ["--workers", str(workers)]
    # A connection gets as long to send its request as the floor's (websockets' open_timeout, 10 s): in a
    # storm the client processes here, busy with thousands of handshakes, are slower to send it than
    # clients on machines of their own (GATEWAY_IDLE_TIMEOUT_MS, 5 s by default).
    env = harness.gateway_env(extra={"BENCH_GC_DIR": gc_dir, "GATEWAY_IDLE_TIMEOUT_MS": "10000"})
    with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
        log_path = Path(tmp) / "gateway.log"
        with log_path.open("wb") as log:
            process = await harness.spawn(command, env=env, stderr=log)
        try:
            await harness.wait_http(f"http://127.0.0.1:{port}", 60, process=process)
            await every_worker(gc_dir, workers + 1 if workers > 1 else 1)
            yield harness.Server(port, process)
        finally:
            await harness.stop(process, 40)
            harness.summarize_log(port, log_path.read_text(errors="replace"))


@contextlib.asynccontextmanager
async def floor(workers: int) -> AsyncIterator[tuple[harness.Server, list[Any]]]:
    """``workers`` floor processes on one port (SO_REUSEPORT), and a publisher connection to each."""
    from websockets.asyncio.client import connect

    port = harness.free_port()
    async with contextlib.AsyncExitStack() as stack:
        processes, publishers = [], []
        for _ in range(workers):
            command = harness.program("sharded_floor", str(port), str(harness.BACKLOG))
            process = await harness.spawn(command, stdout=asyncio.subprocess.PIPE)
            stack.push_async_callback(harness.stop, process)
            processes.append(process)
        for process in processes:
            assert process.stdout is not None
            line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().split()
            if not line or line[0] != "ready":
                raise RuntimeError(f"a floor process did not start: {line}")
            url = f"ws://127.0.0.1:{line[1]}/"
            publishers.append(await stack.enter_async_context(connect(url, compression=None)))
        yield (
            harness.Server(port, processes[0]),
            [(p.pid, ws) for p, ws in zip(processes, publishers, strict=True)],
        )


# --- the callbacks -----------------------------------------------------------------------------------


class RawHttp:
    """Keep-alive HTTP/1.1 connections to the gateway, a request at a time on each
    (bench/programs/callback_client.py's), in place of httpx: its pool scans every waiting request at
    each request and answer, and once the callbacks queued for a moment that scan took this process's core
    (py-spy: 40% of its samples), so it never caught up with the rate it was to hold.

    ``connections`` slots, the last used first; a slot's connection is opened when it has none, or when the
    gateway closed it while it was idle (``GATEWAY_IDLE_TIMEOUT_MS``, while the sockets open). A request
    that a reused connection failed before any answer came (a close not seen yet) is sent once more on a
    new one: a callback's id makes a second copy harmless (``duplicateCallback``)."""

    Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]

    def __init__(self, port: int, connections: int, timeout_s: float = 120.0) -> None:
        self.port = port
        self.timeout_s = timeout_s
        self._slots: asyncio.LifoQueue[RawHttp.Conn | None] = asyncio.LifoQueue()
        for _ in range(connections):
            self._slots.put_nowait(None)
        self._open: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> RawHttp:
        return self

    async def __aexit__(self, *_: object) -> None:
        for writer in list(self._open):
            self._close(writer)

    def _close(self, writer: asyncio.StreamWriter) -> None:
        self._open.discard(writer)
        writer.close()

    async def _exchange(self, conn: RawHttp.Conn | None, request: bytes) -> tuple[RawHttp.Conn, int, bytes]:
        if conn is None or conn[0].at_eof() or conn[1].is_closing():
            if conn is not None:
                self._close(conn[1])
            conn = await asyncio.open_connection("127.0.0.1", self.port)
            self._open.add(conn[1])
        try:
            status, raw = await exchange(*conn, request)
        except BaseException:
            self._close(conn[1])  # its answer may be half read: not used again
            raise
        return conn, status, raw

    async def post(self, path: str, body: dict[str, object], token: str = "none") -> tuple[int, Any]:
        """The answer's status and JSON body; a slot of the pool, waited for if all are busy."""
        request = request_bytes(path, body, token)
        conn = await self._slots.get()
        kept: RawHttp.Conn | None = None
        try:
            async with asyncio.timeout(self.timeout_s):
                try:
                    kept, status, raw = await self._exchange(conn, request)
                except (ConnectionError, asyncio.IncompleteReadError) as exc:
                    if conn is None or (isinstance(exc, asyncio.IncompleteReadError) and exc.partial):
                        raise
                    kept, status, raw = await self._exchange(None, request)
        finally:
            self._slots.put_nowait(kept)
        return status, json.loads(raw)


@dataclass
class Task:
    id: str
    callback_token: str
    subscribe_token: str
    version: int
    calls: int = 0  # callbacks sent so far: the next is a start (0) or progress N


async def create_tasks(http: RawHttp, count: int) -> list[Task]:
    run = uuid.uuid4().hex[:6]
    tasks: list[Task | None] = [None] * count

    async def one(i: int) -> None:
        body = {"id": f"hk-{run}-{i}", "ttlMs": 3_600_000, "maxAttempts": 1}
        status, made = await http.post("/v1/tasks", body)
        if status != 201:
            raise RuntimeError(f"creating a task: {status} {made}")
        tasks[i] = Task(
            made["task"]["id"], made["callbackToken"], made["subscribeToken"], made["task"]["version"]
        )

    await asyncio.gather(*(one(i) for i in range(count)))
    return [t for t in tasks if t is not None]


def event(calls: int) -> dict[str, object]:
    if calls == 0:
        return {"type": "start", "worker": "bench"}
    return {"type": "progress", "progress": min(calls, 99), "cursor": f"row-{calls}"}


async def drive(http: RawHttp, tasks: list[Task], picks: list[int], rate: float) -> dict[str, Any]:
    """One callback per pick, each sent when due (``i / rate``: callbacks of different tasks overlap, as
    those of many workers do; a task's callbacks one after the other). Latencies from when it could be sent
    (due, and its task's previous callback answered) to its answer, a wait for a connection included."""
    locks = [asyncio.Lock() for _ in tasks]
    latencies: list[float] = []
    run = uuid.uuid4().hex[:8]
    late = 0

    async def one(i: int, index: int) -> None:
        task = tasks[index]
        async with locks[index]:
            t0 = time.perf_counter()
            status, answer = await http.post(
                f"/v1/tasks/{task.id}/callbacks",
                {"callbackId": f"{run}-{i}", "event": event(task.calls)},
                task.callback_token,
            )
            latencies.append(time.perf_counter() - t0)
            if status != 200 or not answer.get("changed"):
                raise RuntimeError(f"a callback to {task.id} was answered {status}: {answer}")
            task.calls += 1
            task.version += 1

    started = time.perf_counter()
    pending: list[asyncio.Task[None]] = []
    failed: list[asyncio.Task[None]] = []

    def noted(done: asyncio.Task[None]) -> None:
        if not done.cancelled() and done.exception() is not None:
            failed.append(done)

    try:
        for i, index in enumerate(picks):
            if failed:
                break
            delay = started + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -0.1:
                late += 1
            pending.append(asyncio.create_task(one(i, index)))
            pending[-1].add_done_callback(noted)
        await asyncio.gather(*pending)
    finally:
        for left in pending:
            left.cancel()
    took = time.perf_counter() - started
    return {
        "callbacks": len(latencies),
        "seconds": took,
        "achieved_rate": len(latencies) / took if took else float("nan"),
        "late": late,
        "p50_ms": percentile(latencies, 0.5) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
    }


def draw(rng: random.Random, tasks: int, count: int) -> list[int]:
    return [rng.randrange(tasks) for _ in range(count)]


# --- GC pauses ---------------------------------------------------------------------------------------


Pauses = dict[int, list[tuple[int, float, float, float]]]


def gc_pauses(gc_dir: str, since: float, until: float) -> Pauses:
    """Per process (pid): its noted collections (generation, end, seconds, CPU seconds) between ``since`` and
    ``until``."""
    found: Pauses = {}
    for name in os.listdir(gc_dir):
        lines = Path(gc_dir, name).read_text().split("\n")
        fields = [line.split() for line in lines if line.strip() and not line.startswith("f ")]
        rows = [
            (int(g), float(t), float(s), float(rest[1]) if len(rest) > 1 else nan)
            for g, t, s, *rest in fields
        ]
        found[int(name.split(".")[0])] = [row for row in rows if since <= row[1] <= until]
    return found


def longest_full(pauses: Pauses) -> tuple[float, int, float]:
    """The longest full collection (seconds), how many there were, and the CPU time of the longest."""
    full = sorted((s, cpu) for rows in pauses.values() for g, _, s, cpu in rows if g == 2)
    longest, cpu = full[-1] if full else (0.0, 0.0)
    return longest, len(full), cpu


# --- the gateway's side ------------------------------------------------------------------------------


async def gateway_side(sizes: Sizes, timeout_s: float, rng: random.Random) -> dict[str, Any]:
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gw-bench-gc-") as gc_dir:
        async with (
            harness.pg_database(harness.PG_ADMIN, "gw_bench_hk") as url,
            gateway(url, sizes.workers, gc_dir) as server,
            RawHttp(server.port, HTTP_CONNECTIONS) as http,
        ):
            t0 = up = time.monotonic()
            tasks = await create_tasks(http, sizes.tasks)
            result["create_s"] = time.monotonic() - t0
            base_picks = draw(rng, sizes.tasks, int(sizes.rate * sizes.base_seconds))
            run_picks = draw(rng, sizes.tasks, int(sizes.rate * sizes.seconds))
            pids = family(server.pid)
            result["processes"] = len(pids)
            cpu0 = cpu_of(pids)
            result["base"] = await drive(http, tasks, base_picks, sizes.rate)
            result["base"]["cpu_s"] = cpu_of(pids) - cpu0
            # The subscribers: 10 per task, each from the task's version now to its version after the run.
            finals = [t.version for t in tasks]
            for index in run_picks:
                finals[index] += 1
            per_task = sizes.subscribers // sizes.tasks
            groups: list[tuple[str, int, str | None]] = [
                (
                    f"{server.ws}/v1/tasks/{t.id}/ws?cursor={t.version}&token={t.subscribe_token}"
                    f"#final={finals[i]}",
                    per_task,
                    "caught-up",
                )
                for i, t in enumerate(tasks)
            ]
            t0 = time.monotonic()
            clients = await Clients.start(
                groups,
                procs=sizes.procs,
                stream=True,
                hold=True,
                timeout_s=timeout_s,
                stall_s=harness.STALL_S,
            )
            try:
                await clients.connect(timeout_s)
                result["connect_s"] = time.monotonic() - t0
                pids = family(server.pid)
                cpu0, since = cpu_of(pids), time.monotonic()
                async with harness.profiled(a_worker(pids[1:]), "hundredk-gateway-worker"):
                    result["run"] = await drive(http, tasks, run_picks, sizes.rate)
                    result["frames"] = stats = await clients.done(timeout_s)
                until = time.monotonic()
                result["run"]["cpu_s"] = cpu_of(pids) - cpu0
                result["run"]["pids"] = len(pids)
            finally:
                await clients.close()
            result["gc_run"] = gc_pauses(gc_dir, since, until)
            # The storm: every socket dropped (above), all reconnecting at once with their cursors: a task
            # that had callbacks one version behind (a delta), the others where they are (caught up).
            storm_groups: list[tuple[str, int, str | None]] = []
            for i, t in enumerate(tasks):
                behind = 1 if t.calls and t.version == finals[i] and finals[i] > 1 else 0
                base = f"{server.ws}/v1/tasks/{t.id}/ws?cursor={t.version - behind}&token={t.subscribe_token}"
                storm_groups.append((base, per_task, "delta" if behind else "caught-up"))
            # At most held.IN_FLIGHT handshakes at a time per client process, on both sides (see there).
            result["storm"] = await held.storm(
                storm_groups, sizes.procs, timeout_s, in_flight=held.IN_FLIGHT, stall_s=harness.STALL_S
            )
            result["gc_all"] = gc_pauses(gc_dir, up, time.monotonic())
            if os.environ.get("BENCH_GC_KEEP"):  # every process's collections, for a look after the run
                shutil.copytree(gc_dir, os.environ["BENCH_GC_KEEP"], dirs_exist_ok=True)
            result["phases"] = {"up": up, "connected": since, "run_end": until}
            stats["versions_checked"] = sum(finals)
    return result


# --- the floor's side --------------------------------------------------------------------------------


def floor_frame(task: str, version: int) -> str:
    from bench.workloads.fanout import sample_frame

    return task + "\n" + sample_frame(version)


async def publish(publishers: list[Any], picks: list[int], versions: list[int], rate: float) -> None:
    started = time.perf_counter()
    for i, index in enumerate(picks):
        await asyncio.sleep(max(0.0, started + i / rate - time.perf_counter()))
        versions[index] += 1
        message = floor_frame(str(index), versions[index])
        for ws in publishers:
            await ws.send(message)
    for ws in publishers:  # each has read them all once it answers a ping sent behind the last
        await asyncio.wait_for(await ws.ping(), 60)


async def floor_side(sizes: Sizes, timeout_s: float, rng: random.Random) -> dict[str, Any]:
    result: dict[str, Any] = {}
    base_picks = draw(rng, sizes.tasks, int(sizes.rate * sizes.base_seconds))
    run_picks = draw(rng, sizes.tasks, int(sizes.rate * sizes.seconds))
    async with floor(sizes.workers) as (server, shards):
        pids = [pid for pid, _ in shards]
        publishers = [ws for _, ws in shards]
        versions = [0] * sizes.tasks
        cpu0 = cpu_of(pids)
        await publish(publishers, base_picks, versions, sizes.rate)
        result["base"] = {"cpu_s": cpu_of(pids) - cpu0, "callbacks": len(base_picks)}
        finals = [0] * sizes.tasks
        for index in run_picks:
            finals[index] += 1
        versions = [0] * sizes.tasks
        per_task = sizes.subscribers // sizes.tasks
        groups: list[tuple[str, int, str | None]] = [
            (f"{server.ws}/t/{i}#final={finals[i]}", per_task, "hello") for i in range(sizes.tasks)
        ]
        clients = await Clients.start(
            groups,
            procs=sizes.procs,
            stream=True,
            hold=True,
            concurrency=held.IN_FLIGHT,
            timeout_s=timeout_s,
            stall_s=harness.STALL_S,
        )
        try:
            overflows = harness.listen_overflows()
            go = time.monotonic()  # all at once: the floor's time to open them, beside the gateway's storm
            lines = await clients.connect(timeout_s)
            result["open_s"] = max(line["t"] for line in lines) - go
            result["listen_overflows"] = (harness.listen_overflows() or 0) - (overflows or 0)
            cpu0 = cpu_of(pids)
            async with harness.profiled(pids[0], "hundredk-floor"):
                await publish(publishers, run_picks, versions, sizes.rate)
                result["frames"] = await clients.done(timeout_s)
            result["run"] = {"cpu_s": cpu_of(pids) - cpu0, "callbacks": len(run_picks)}
        finally:
            await clients.close()
    return result


# --- the workload ------------------------------------------------------------------------------------


def per_callback(side: dict[str, Any]) -> float:
    return float(side["base"]["cpu_s"] * 1e6 / side["base"]["callbacks"])


def above_base(side: dict[str, Any]) -> float:
    """CPU per frame above the same callbacks (messages) with no subscriber, scaled to the run's count."""
    frames = side["frames"]["deliveries"]
    if not frames:
        return float("nan")
    base = side["base"]["cpu_s"] / side["base"]["callbacks"] * side["run"]["callbacks"]
    return float((side["run"]["cpu_s"] - base) * 1e6 / frames)


async def workload(cfg: Any, servers: Any, report: Report) -> None:
    sizes: Sizes = cfg.hundredk
    started = time.monotonic()
    # Each step (opening the sockets, a storm, every frame delivered) within harness.socket_bound, and
    # while its subscribers move on (harness.STALL_S).
    timeout_s = harness.socket_bound(sizes.subscribers, cfg.step_timeout_s)
    seed = random.randrange(2**32)
    # python -m bench hundredk --side: one side alone, nothing judged
    if getattr(cfg, "side", None) == "gateway":
        gw = await gateway_side(sizes, timeout_s, random.Random(seed))
        print(
            gw["run"],
            gw["base"],
            {k: v for k, v in gw["storm"].items() if k != "errors"},
            gw["storm"]["errors"],
        )
        print(longest_full(gw["gc_run"]), longest_full(gw["gc_all"]), gw.get("connect_s"), gw.get("create_s"))
        return
    if getattr(cfg, "side", None) == "floor":
        fl = await floor_side(sizes, timeout_s, random.Random(seed))
        print(fl["run"], fl["base"], fl["open_s"], fl["listen_overflows"], frames_summary(fl["frames"]))
        return
    if sizes.together:
        gw, fl = await asyncio.gather(
            gateway_side(sizes, timeout_s, random.Random(seed)),
            floor_side(sizes, timeout_s, random.Random(seed)),
        )
        gateway_s = time.monotonic() - started
    else:
        gw = await gateway_side(sizes, timeout_s, random.Random(seed))
        gateway_s = time.monotonic() - started
        fl = await floor_side(sizes, timeout_s, random.Random(seed))
    took = time.monotonic() - started
    n = sizes.subscribers
    g_frames, f_frames = gw["frames"], fl["frames"]
    g_total = gw["run"]["cpu_s"] * 1e6 / g_frames["deliveries"] if g_frames["deliveries"] else float("nan")
    f_total = fl["run"]["cpu_s"] * 1e6 / f_frames["deliveries"] if f_frames["deliveries"] else float("nan")
    g_above, f_above = above_base(gw), above_base(fl)
    label = f"{n:,} over --workers {sizes.workers}"
    report.rows += [
        Row(10, f"{label}: server CPU per frame", g_total, f_total, "us", "(callbacks' own CPU included)"),
        Row(
            10,
            f"{label}: CPU per frame above the same callbacks with no subscriber",
            g_above,
            f_above,
            "us",
            "<= 1.3x",
        ),
        Row(
            10,
            f"{label}: callback p99 (floor: no subscriber)",
            gw["run"]["p99_ms"],
            gw["base"]["p99_ms"],
            "ms",
            "<= 2x",
        ),
    ]
    longest, count, longest_cpu = longest_full(gw["gc_run"])
    report.rows.append(
        Row(
            10,
            f"{label}: longest full GC pause of any process during the run",
            longest * 1e3,
            None,
            "ms",
            "<= 50 ms",
        )
    )
    storm = gw["storm"]
    report.rows.append(
        Row(
            10,
            f"reconnect storm, N={n:,}: until every resume frame (floor: opening them)",
            storm["seconds"],
            fl["open_s"],
            "s",
            "<= 2x",
            2,
        )
    )
    lost = g_frames["lost"] + g_frames["out_of_order"] + storm["lost"] + storm["out_of_order"]
    report.rows.append(
        Row(
            10,
            f"{label}: frames lost + out of order",
            lost,
            f_frames["lost"] + f_frames["out_of_order"],
            "",
            "0",
            0,
            ratio=float("nan"),
        )
    )
    for what, value in (
        ("CPU/frame", g_total),
        ("floor CPU/frame", f_total),
        ("p99", gw["run"]["p99_ms"]),
        ("storm", storm["seconds"]),
        ("floor open", fl["open_s"]),
    ):
        report.figure(f"hundredk {what}", value)
    report.figure("hundredk CPU/frame above base", g_above, positive=False)
    report.frames("hundredk gateway", g_frames)
    report.frames("hundredk storm", storm)
    report.frames("hundredk floor", f_frames)
    longest_all, count_all, longest_all_cpu = longest_full(gw["gc_all"])
    per_process = {
        pid: max((s for g, _, s, _ in rows if g == 2), default=0.0) for pid, rows in gw["gc_all"].items()
    }
    report.details.append(
        f"hundredk: {n:,} subscribers ({n // sizes.tasks} per task) over {sizes.tasks:,} tasks, "
        f"`gateway serve --workers {sizes.workers}` ({gw['processes']} processes: the parent, its workers, "
        "multiprocessing's resource tracker) on PostgreSQL, "
        f"{sizes.workers} floor processes; {gw['run']['callbacks']:,} callbacks at {sizes.rate:g}/s asked "
        f"({gw['run']['achieved_rate']:.1f}/s achieved, {gw['run']['late']} sent over 100 ms late), p50 "
        f"{gw['run']['p50_ms']:.1f} ms; with no subscriber {gw['base']['callbacks']:,} callbacks, p50 "
        f"{gw['base']['p50_ms']:.1f} ms, {per_callback(gw):,.0f} us of CPU each (floor: "
        f"{per_callback(fl):,.0f} us per message); gateway "
        f"{frames_summary(g_frames)} | floor {frames_summary(f_frames)}; tasks created in "
        f"{gw['create_s']:.1f} s, subscribers connected in {gw['connect_s']:.1f} s (200 at a time per client "
        f"process)"
    )
    report.details.append(
        f"hundredk GC: {count} full collections during the run, {count_all} in all, the longest of each "
        f"process since it started (ms): {', '.join(f'{s * 1e3:.0f}' for s in sorted(per_process.values()))}"
        f" (longest {longest_all * 1e3:.0f} ms, of which {longest_all_cpu * 1e3:.0f} ms on the CPU; during "
        f"the run {longest * 1e3:.0f} ms, {longest_cpu * 1e3:.0f} ms on the CPU: the rest is the process "
        f"waiting for a core)"
    )
    overflows = "unknown" if storm["listen_overflows"] is None else f"{storm['listen_overflows']:,}"
    report.details.append(
        f"hundredk storm: resume frames {storm['resume']}, {storm['retries']} attempts retried, "
        f"{storm['failed']} failed; floor open: {f_frames['connected']:,} connected, {f_frames['retries']} "
        f"retried; at most {held.IN_FLIGHT} handshakes in flight per client process, on both sides; "
        f"connections dropped by a full accept queue (kernel ListenOverflows, machine-wide; each process "
        f"of either side has a listening socket of its own, backlog {harness.BACKLOG}): gateway "
        f"{overflows}, floor "
        f"{fl['listen_overflows']:,}; the workload took {took:.0f} s (gateway side {gateway_s:.0f} s)"
        + (f"; storm errors: {'; '.join(storm['errors'][:3])}" if storm["errors"] else "")
    )


async def main(args: argparse.Namespace) -> int:
    from bench.lib.report import table

    sizes = SMOKE if args.smoke else FULL
    changes = {k: v for k, v in vars(args).items() if k in Sizes.__dataclass_fields__ and v is not None}
    cfg = argparse.Namespace(
        hundredk=dataclasses.replace(sizes, **changes), step_timeout_s=60.0, side=args.side
    )
    harness.raise_nofile(20_000)
    report = Report()
    await workload(cfg, None, report)
    print(table(report.rows, markdown=False))
    for line in report.details + [f"CHECK {p}" for p in report.problems]:
        print(f"- {line}")
    return 1 if report.problems else 0


def command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench hundredk", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--side", choices=("gateway", "floor"), help="one side alone (a run under 6 minutes)")
    for name, kind in (("subscribers", int), ("tasks", int), ("rate", float), ("seconds", float)):
        parser.add_argument(f"--{name}", type=kind)
    for name, kind in (("base-seconds", float), ("workers", int), ("procs", int)):
        parser.add_argument(f"--{name}", type=kind)
    return harness.run_to_the_end(main(parser.parse_args(argv)))
