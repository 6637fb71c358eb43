"""A task's streams live (issue 33, Performance): ``chunks`` frames to subscribers, each figure beside its
floor measured in the same run.

    python -m bench stream_live [--smoke] [--only latency,resume,memory] [--procs N]

- **Chunk-to-frame**: one task's stream ``output`` followed by N subscribers on the single-task socket
  (``?streams=output:0``), one chunk per append at a steady rate, each append sent when due (or once the
  previous one is answered): the time from just before each append's request to each timed subscriber's
  ``chunks`` frame, p50 and p99, beside raw ``websockets``' publish-to-receive to as many receivers
  (bench/workloads/latency_e2e.py's floor run, frames of a ``chunks`` frame's size). The gateway and the
  bench on one core, the client processes on the other, as in latency_e2e.
- **Resume**: one subscriber asking a running task's stream of 10,000 chunks from offset 0: the time from
  its connect to its first ``chunks`` frame and to its last chunk, beside a raw ``websockets`` server
  (bench/programs/resume_floor.py) answering with a bare ``SELECT`` of the stream's rows in the gateway's
  own SQLite file and one send; medians of runs taken in turn.
- **Memory flat in stream length**: 100 ended tasks each with a stream of 4 MiB (chunks of 1,000 bytes),
  each read from offset 0 by 10 subscribers at once (the catch-up, then ``end`` and close 1000): the peak
  RSS (``VmHWM``) of a gateway process started on the filled database for the reads alone, beside the
  same with streams of 0.4 MiB.

Every subscriber checks its chunks by offset (bench/programs/subscribers.py with ``chunks``): none missing,
none repeated, every one up to the last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.lib import harness
from bench.lib.harness import Clients
from bench.lib.report import Report, Row, frames_summary, table
from bench.workloads import latency_e2e
from bench.workloads.fanout import create_task

STREAM = "output"
LATENCY_TARGET = 1.5  # the gateway's p99 at most this many times the floor's
FIRST_FRAME_TARGET_MS = 50.0
MEMORY_TARGET = 1.2
BATCH_CHUNKS = 1_000  # an append's chunks at most (protocol.md, Append)
MEMORY_CHUNK = 1_000  # bytes: 1,000 of them a batch stay under the 1 MiB body
START = {"type": "start", "worker": "bench"}
SUCCEED = {"type": "succeed", "resultRef": "s3://bench/result", "resultHash": "sha256:b"}


@dataclass(frozen=True)
class Sizes:
    latency: tuple[tuple[int, int, float], ...]  # (subscribers, appends, rate per second)
    sample: int  # subscribers whose frames are timed, about
    resume_chunks: int
    resume_runs: int
    memory_streams: int
    memory_subscribers: int  # per stream
    memory_bytes: tuple[int, int]  # a stream's size: the floor's, the figure's


# The rates of latency_e2e's runs at the same N: the frames per second within what the client processes,
# on the other core, read as they come. 3,000 and 50,000 samples: the p99 is not one of the 10 largest.
FULL = Sizes(
    latency=((10, 300, 20.0), (1000, 100, 10.0)),
    sample=500,
    resume_chunks=10_000,
    resume_runs=11,
    memory_streams=100,
    memory_subscribers=10,
    memory_bytes=(2**22 // 10, 2**22),
)
SMOKE = Sizes(
    latency=((10, 20, 20.0),),
    sample=10,
    resume_chunks=2_000,
    resume_runs=1,
    memory_streams=4,
    memory_subscribers=2,
    memory_bytes=(20_000, 200_000),
)
PARTS = ("latency", "resume", "memory")


@dataclass(frozen=True)
class Settings:
    """What latency_e2e's floor run reads of the suite's config."""

    sizes: Sizes
    procs: int
    step_timeout_s: float

    @property
    def latency_e2e(self) -> latency_e2e.Sizes:
        return latency_e2e.Sizes(runs=(), sample=self.sizes.sample, wide=None)


# --- a producer ----------------------------------------------------------------------------------------


@dataclass
class Producer:
    """A running task's worker appending to its stream ``output``, one batch after the other."""

    http: httpx.AsyncClient
    task_id: str
    token: str
    subscribe: str  # the task's subscribe token
    version: int
    seq: int = 0

    @classmethod
    async def start(cls, http: httpx.AsyncClient) -> Producer:
        task_id = f"live-{uuid.uuid4().hex[:8]}"
        made = await create_task(http, task_id)
        producer = cls(http, task_id, made["callbackToken"], made["subscribeToken"], 0)
        producer.version = (await producer.callback(START))["task"]["version"]
        return producer

    async def callback(self, event: Mapping[str, object]) -> dict[str, Any]:
        answer = await self.http.post(
            f"/v1/tasks/{self.task_id}/callbacks",
            json={"callbackId": uuid.uuid4().hex, "event": event},
            headers={"Authorization": f"Bearer {self.token}"},
        )
        answer.raise_for_status()
        body: dict[str, Any] = answer.json()
        return body

    async def append(self, chunks: list[str]) -> int:
        """The batch's first offset."""
        answer = await self.http.post(
            f"/v1/tasks/{self.task_id}/streams/{STREAM}",
            json={"attempt": 1, "seq": self.seq, "chunks": chunks},
            headers={"Authorization": f"Bearer {self.token}"},
        )
        answer.raise_for_status()
        self.seq += 1
        return int(answer.json()["offset"])

    def url(self, server: harness.Server) -> str:
        return (
            f"{server.ws}/v1/tasks/{self.task_id}/ws?cursor={self.version}&token={self.subscribe}"
            f"&streams={STREAM}:0"
        )


def token(i: int) -> str:
    """A model's token, unique to its offset."""
    return f" tok{i:06d}"


# --- 1. chunk-to-frame -----------------------------------------------------------------------------------


def floor_frame(version: int) -> str:
    """A frame of a one-token ``chunks`` frame's size, for the floor's subscribers (who count versions)."""
    body = {"type": "event", "taskId": "live-0123abcd", "stream": STREAM, "attempt": 1, "version": version}
    return json.dumps(body | {"chunks": [token(version)]}, separators=(",", ":"))


async def latency_gateway(
    server: harness.Server, n: int, appends: int, rate: float, cfg: Settings
) -> dict[str, Any]:
    timeout_s = latency_e2e.timeout(cfg, n)
    async with contextlib.AsyncExitStack() as stack:
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=server.http, timeout=60))
        producer = await Producer.start(http)
        clients = await Clients.start(
            [(producer.url(server), n, "caught-up")],
            procs=cfg.procs,
            stream=True,
            expect_close=1000,
            timeout_s=timeout_s,
            stall_s=harness.STALL_S,
            timed_every=latency_e2e.every(n, cfg.sizes.sample),
            chunks=STREAM,
        )
        stack.push_async_callback(clients.close)
        await clients.connect(timeout_s)
        stack.enter_context(latency_e2e.split([server.pid], clients))
        sent: dict[int, int] = {}
        async with harness.profiled(server.pid, f"stream-live-gateway-{n}"):
            started = time.monotonic()
            for i in range(appends):
                await asyncio.sleep(max(0.0, started + i / rate - time.monotonic()))
                at = time.monotonic_ns()
                sent[await producer.append([token(i)])] = at
            took = time.monotonic() - started
            await producer.callback(SUCCEED)
            await clients.final(appends - 1)
            stats = await clients.done(timeout_s)
    received: dict[int, list[int]] = stats.pop("received")
    return {
        **stats,
        "achieved_rate": (appends - 1) / took if appends > 1 else float("nan"),
        "request": latency_e2e.quantiles(latency_e2e.latencies(received, sent)),
    }


async def chunk_to_frame(cfg: Settings, report: Report, floor_server: Any) -> None:
    from websockets.asyncio.client import connect

    async with harness.gateway() as gateway:
        for n, appends, rate in cfg.sizes.latency:
            async with (
                floor_server() as server,
                connect(f"{server.ws}/publish", compression=None) as publisher,
            ):
                floor = await latency_e2e.run_floor(
                    server, [server.pid], [publisher], f"{server.ws}/", floor_frame, n, appends, rate, cfg
                )
            run = await latency_gateway(gateway, n, appends, rate, cfg)
            for q in ("p99", "p50"):
                report.rows.append(
                    Row(
                        16,
                        f"chunk-to-frame {q} at N={n:,}, {rate:g}/s "
                        "(floor: raw websockets publish-to-receive)",
                        run["request"][q],
                        floor["publish"][q],
                        "ms",
                        f"<= {LATENCY_TARGET:g}x" if q == "p99" else "",
                        digits=2,
                    )
                )
                report.figure(f"chunk-to-frame {q} at N={n}", run["request"][q])
                report.figure(f"publish-to-receive {q} at N={n}", floor["publish"][q])
            report.frames(f"chunk-to-frame N={n}, gateway", run)
            report.frames(f"chunk-to-frame N={n}, floor", floor)
            report.details.append(
                f"chunk-to-frame N={n:,}, {appends} appends of one chunk at {rate:g}/s "
                f"({run['achieved_rate']:.1f}/s achieved): gateway {latency_e2e.ms(run['request'])}; floor "
                f"publish-to-receive {latency_e2e.ms(floor['publish'])}; gateway {frames_summary(run)}; "
                f"floor {frames_summary(floor)}"
                + (f"; gateway sockets closed with {run['closes']}" if run["bad_close"] else "")
            )


# --- 2. resume -------------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def resume_floor(database: str) -> AsyncIterator[harness.Server]:
    port = harness.free_port()
    process = await harness.spawn(
        harness.program("resume_floor", str(port), database), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 30)
        if line.strip() != b"ready":
            raise RuntimeError(f"the resume floor did not start: {line!r}")
        yield harness.Server(port, process)
    finally:
        await harness.stop(process)


async def fill(producer: Producer, chunks: list[str]) -> None:
    for at in range(0, len(chunks), BATCH_CHUNKS):
        await producer.append(chunks[at : at + BATCH_CHUNKS])


async def resume_once(url: str, expect: str, count: int, cfg: Settings) -> dict[str, Any]:
    """One subscriber reading ``count`` chunks from offset 0: ms from its connect to its first ``chunks``
    frame and to its last chunk."""
    clients = await Clients.start(
        [(url, 1, expect)],
        procs=1,
        stream=True,
        final=count - 1,
        timeout_s=cfg.step_timeout_s,
        timed_every=1,
        chunks=STREAM,
    )
    try:
        (ready,) = await clients.connect(cfg.step_timeout_s)
        stats = await clients.done(cfg.step_timeout_s)
    finally:
        await clients.close()
    received: dict[int, list[int]] = stats.pop("received")
    go_ns = ready["t_go"] * 1e9
    first = min((at for times in received.values() for at in times), default=float("nan"))
    last = min(received.get(count - 1, [float("nan")]))
    return {**stats, "first_ms": (first - go_ns) / 1e6, "last_ms": (last - go_ns) / 1e6}


async def resume(cfg: Settings, report: Report) -> None:
    count = cfg.sizes.resume_chunks
    with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
        database = str(Path(tmp) / "streams.db")
        async with (
            harness.gateway(f"sqlite:///{database}") as gateway,
            httpx.AsyncClient(base_url=gateway.http, timeout=60) as http,
        ):
            producer = await Producer.start(http)
            await fill(producer, [f"chunk {i:07d} of text " for i in range(count)])
            async with resume_floor(database) as floor_server:
                runs: dict[str, list[dict[str, Any]]] = {"gateway": [], "floor": []}
                for _ in range(cfg.sizes.resume_runs):
                    runs["gateway"].append(await resume_once(producer.url(gateway), "caught-up", count, cfg))
                    floor_url = f"{floor_server.ws}/{producer.task_id}/{STREAM}"
                    runs["floor"].append(await resume_once(floor_url, "hello", count, cfg))
    median = {
        side: {key: statistics.median(run[key] for run in side_runs) for key in ("first_ms", "last_ms")}
        for side, side_runs in runs.items()
    }
    ours, floor = median["gateway"], median["floor"]
    resumed = f"resume of {count:,} chunks from offset 0"
    for measure, figure, floor_ms, target in (
        ("the first chunks frame", ours["first_ms"], None, f"<= {FIRST_FRAME_TARGET_MS:g} ms"),
        ("the last chunk (floor: a bare SELECT and one send)", ours["last_ms"], floor["last_ms"], "<= 2x"),
    ):
        report.rows.append(Row(16, f"{resumed}: {measure}", figure, floor_ms, "ms", target))
    for side, side_runs in runs.items():
        report.figure(f"resume {side} last chunk", median[side]["last_ms"])
        for i, run in enumerate(side_runs):
            report.frames(f"resume {side} run {i + 1}", run)
    report.details.append(
        f"resume of {count:,} chunks of 20 bytes ({count // BATCH_CHUNKS} batches) from offset 0, one "
        f"subscriber, {cfg.sizes.resume_runs} runs each in turn, ms from connect to the first frame / the "
        "last chunk: "
        + "; ".join(
            f"{side} "
            + ", ".join(f"{run['first_ms']:.1f} / {run['last_ms']:.1f}" for run in side_runs)
            + f" ({sum(run['deliveries'] for run in side_runs) / len(side_runs):.0f} frames a run)"
            for side, side_runs in runs.items()
        )
    )


# --- 3. memory flat in stream length ----------------------------------------------------------------------


def peak_rss(pid: int) -> int:
    """The process's peak RSS so far (``VmHWM``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


async def memory_once(stream_bytes: int, cfg: Settings) -> dict[str, Any]:
    sizes = cfg.sizes
    count = stream_bytes // MEMORY_CHUNK
    with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
        url = f"sqlite:///{tmp}/streams.db"
        async with (
            harness.gateway(url) as writer,
            httpx.AsyncClient(base_url=writer.http, timeout=120) as http,
        ):
            producers = [await Producer.start(http) for _ in range(sizes.memory_streams)]
            gate = asyncio.Semaphore(4)

            async def write(producer: Producer) -> None:
                async with gate:
                    chunks = [f"{producer.task_id} {i:09d} ".ljust(MEMORY_CHUNK, "x") for i in range(count)]
                    await fill(producer, chunks)
                    producer.version = (await producer.callback(SUCCEED))["task"]["version"]

            await asyncio.gather(*(write(producer) for producer in producers))
        async with harness.gateway(url) as gateway:  # a process that has done nothing but start
            idle = harness.rss_bytes(gateway.pid)
            clients = await Clients.start(
                [(producer.url(gateway), sizes.memory_subscribers, "caught-up") for producer in producers],
                procs=cfg.procs,
                stream=True,
                final=count - 1,
                expect_close=1000,
                timeout_s=cfg.step_timeout_s,
                stall_s=harness.STALL_S,
                chunks=STREAM,
            )
            try:
                started = time.monotonic()
                async with harness.profiled(gateway.pid, f"stream-live-memory-{stream_bytes}"):
                    await clients.connect(cfg.step_timeout_s)
                    stats = await clients.done(cfg.step_timeout_s)
                took = time.monotonic() - started
                peak = peak_rss(gateway.pid)
            finally:
                await clients.close()
    stats.pop("received")
    return {**stats, "idle": idle, "peak": peak, "seconds": took, "chunks": count}


async def memory(cfg: Settings, report: Report) -> None:
    sizes = cfg.sizes
    small, large = sizes.memory_bytes
    floor = await memory_once(small, cfg)
    run = await memory_once(large, cfg)
    report.rows.append(
        Row(
            16,
            f"gateway peak RSS, {sizes.memory_streams} streams of {large / 2**20:g} MiB read from 0 by "
            f"{sizes.memory_subscribers} subscribers each (floor: streams of {small / 2**20:g} MiB)",
            run["peak"] / 2**20,
            floor["peak"] / 2**20,
            "MiB",
            f"<= {MEMORY_TARGET:g}x",
        )
    )
    for label, result in (("large", run), ("small", floor)):
        report.figure(f"memory {label} peak", result["peak"])
        report.frames(f"memory {label}", result)
    report.details.append(
        f"memory flat in stream length, {sizes.memory_streams} ended tasks x {sizes.memory_subscribers} "
        "subscribers from offset 0, chunks of 1,000 bytes: "
        + "; ".join(
            f"{result['chunks']:,} chunks a stream: RSS {result['idle'] / 2**20:.0f} MiB started, peak "
            f"{result['peak'] / 2**20:.0f} MiB, read in {result['seconds']:.1f} s, {frames_summary(result)}"
            for result in (floor, run)
        )
    )


# --- the workload ----------------------------------------------------------------------------------------


async def run_parts(cfg: Settings, report: Report, parts: Sequence[str], floor_server: Any) -> None:
    harness.raise_nofile(max(n for n, _, _ in cfg.sizes.latency) + 1024)
    if "latency" in parts:
        await chunk_to_frame(cfg, report, floor_server)
    if "resume" in parts:
        await resume(cfg, report)
    if "memory" in parts:
        await memory(cfg, report)


async def workload(cfg: Any, servers: Any, report: Report) -> None:
    """Workload 16 of the suite (bench/suite.py)."""
    settings = Settings(cfg.stream_live, cfg.procs, cfg.step_timeout_s)
    await run_parts(settings, report, PARTS, lambda: servers.use("floor"))


def command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench stream_live", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; exit 1 if a chunk was lost")
    parser.add_argument(
        "--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}"
    )
    parser.add_argument("--procs", type=int, default=2, help="client processes")
    args = parser.parse_args(argv)
    parts = [part for part in args.only.split(",") if part]
    if unknown := set(parts) - set(PARTS):
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    cfg = Settings(SMOKE if args.smoke else FULL, args.procs, 30.0 if args.smoke else 300.0)
    report = Report()

    async def main() -> int:
        try:
            await run_parts(cfg, report, parts, harness.floor_server)
        finally:
            report.gateway_logs("stream live")
        print(table(report.rows, markdown=False))
        for detail in report.details:
            print(f"- {detail}")
        for problem in report.problems:
            print(f"CHECK {problem}", file=sys.stderr)
        return 1 if report.problems else 0

    return harness.run_to_the_end(main())


if __name__ == "__main__":
    sys.exit(command(sys.argv[1:]))
