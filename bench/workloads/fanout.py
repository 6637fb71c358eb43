"""Fan-out benchmark: one task, N subscribers in separate client processes, callbacks at a fixed rate.

Prints the gateway server's CPU microseconds per delivered frame (its process's CPU-time clock, every
thread), its idle memory per subscriber (VmRSS growth / N), the callbacks' latency and the frames
lost or out of order (every client process checks, per subscriber, that versions arrive as 1, 2, 3, ...;
a ``conflated`` snapshot may jump ahead), beside a minimal raw ``websockets`` broadcast server sending
frames of the same size (the floor of Python on this machine), and the ratio.

    python -m bench fanout [--subscribers 1000] [--callbacks 200] [--rate 50] [--procs 4]
                           [--buses local,postgres,redis] [--pg-admin-url URL] [--redis-url URL]

With ``--buses`` (default: ``local`` alone, on SQLite) the gateway runs once per bus, on one PostgreSQL
database made for the run (``local`` included, so that only the bus differs), and prints the server's CPU
per delivered frame for each: with the callbacks posted to the same process, and, for the buses that link
processes, posted to a second process (the subscribers' process then gets every entry from the bus).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

from bench.lib import harness
from bench.lib.harness import Clients, cpu_seconds, percentile, rss_bytes


def plan(n: int) -> list[dict[str, object]]:
    """``n`` callbacks that each add one entry: [start, progress 1..98, retryable fail] cycles, then
    start, progress and succeed."""
    assert n >= 2
    events: list[dict[str, object]] = []
    while n - len(events) > 100:
        events.append({"type": "start", "worker": "bench"})
        events += [{"type": "progress", "progress": p, "cursor": f"row-{p}"} for p in range(1, 99)]
        events.append({"type": "fail", "error": "lease lost", "retryable": True})
    events.append({"type": "start", "worker": "bench"})
    remaining = n - len(events) - 1
    events += [{"type": "progress", "progress": p, "cursor": f"row-{p}"} for p in range(1, remaining + 1)]
    events.append({"type": "succeed", "resultRef": "s3://bench/result", "resultHash": "sha256:b"})
    return events


def attempts_for(callbacks: int) -> int:
    return callbacks // 100 + 1


async def create_task(http: Any, task_id: str, attempts: int = 1) -> dict[str, Any]:
    answer = await http.post("/v1/tasks", json={"id": task_id, "ttlMs": 3_600_000, "maxAttempts": attempts})
    answer.raise_for_status()
    made: dict[str, Any] = answer.json()
    return made


async def post_callbacks(
    http: Any,
    task_id: str,
    token: str,
    events: list[dict[str, object]],
    rate: float,
    seconds: float | None = None,
) -> dict[str, Any]:
    """Post ``events`` one after the other, each due at ``i / rate`` (sent when due or, if the previous one
    is still unanswered, as soon as it is answered); every one must change the task. With ``seconds``, stop
    once that long has passed and end the task (start if it was requeued, succeed): ``posted`` says how
    many callbacks were posted in all, the closing ones included (they are not timed)."""
    headers = {"Authorization": f"Bearer {token}"}
    latencies = []
    run = uuid.uuid4().hex[:8]

    async def post(i: int, event: dict[str, object]) -> None:
        answer = await http.post(
            f"/v1/tasks/{task_id}/callbacks",
            json={"callbackId": f"{run}-{i}", "event": event},
            headers=headers,
        )
        answer.raise_for_status()
        if not answer.json().get("changed"):
            raise RuntimeError(f"callback {i} ({event['type']}) changed nothing: {answer.text}")

    started = time.perf_counter()
    sent_at = []
    posted = 0
    for i, event in enumerate(events):
        if seconds is not None and time.perf_counter() - started >= seconds:
            break
        due = started + i / rate
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        t0 = time.perf_counter()
        sent_at.append(t0)
        await post(i, event)
        latencies.append(time.perf_counter() - t0)
        posted += 1
    if posted < len(events) and posted:
        last = events[posted - 1]["type"]
        closing: list[dict[str, object]] = []
        if last == "fail":  # requeued: it takes a start before it can succeed
            closing.append({"type": "start", "worker": "bench"})
        if last != "succeed":
            closing.append({"type": "succeed", "resultRef": "s3://bench/result", "resultHash": "sha256:b"})
        for event in closing:
            await post(posted, event)
            posted += 1
    return {
        "latencies": latencies,
        "posted": posted,
        "timed": len(latencies),
        # Intervals between sends: the rate asked, if every callback was answered before the next was due.
        "achieved_rate": (len(sent_at) - 1) / (sent_at[-1] - sent_at[0])
        if len(sent_at) > 1
        else float("nan"),
        "callback_p50_ms": statistics.median(latencies) * 1000,
        "callback_p99_ms": percentile(latencies, 0.99) * 1000,
    }


async def bench_gateway(
    subscribers: int,
    callbacks: int,
    rate: float,
    procs: int,
    database_url: str | None = None,
    bus: str | None = None,
    remote: bool = False,
    timeout_s: float = 180.0,
    seconds: float | None = None,
    server: harness.Server | None = None,
    cores: tuple[set[int], set[int]] | None = None,
) -> dict[str, Any]:
    """One run: ``subscribers`` on one gateway process (none: callbacks alone); ``callbacks`` posted to it
    at ``rate`` (with ``seconds``: for that long at most, then the task ended), or (``remote``) to a second
    process on the same database and bus. The gateway is started for the run and stopped after it, or is
    ``server``, already running (a run makes a task of its own).

    The server's CPU is read before the first callback and after the last one is answered and, with
    subscribers, once every subscriber has the last entry: with none, the window holds the callbacks
    alone, the base a run with subscribers is compared with.

    ``cores`` (``harness.split_cores``): the gateway and this process (which times the callbacks) on the
    first set for the run, the subscriber processes on the second."""
    import httpx

    task_id = f"bench-{uuid.uuid4().hex[:8]}"  # runs may share a database
    async with contextlib.AsyncExitStack() as stack:
        if server is None:
            server = await stack.enter_async_context(harness.gateway(database_url, bus=bus))
        writer = server
        if remote:
            writer = await stack.enter_async_context(harness.gateway(database_url, bus=bus))
        if cores is not None:
            stack.enter_context(harness.on_cores([server.pid, writer.pid, os.getpid()], cores[0]))
        http = await stack.enter_async_context(httpx.AsyncClient(base_url=server.http, timeout=60))
        write_http = await stack.enter_async_context(httpx.AsyncClient(base_url=writer.http, timeout=60))
        made = await create_task(http, task_id, attempts_for(callbacks))
        start_version = made["task"]["version"]
        rss_before = rss_bytes(server.pid)
        clients = None
        if subscribers:
            url = f"{server.ws}/v1/tasks/{task_id}/ws?cursor={start_version}&token={made['subscribeToken']}"
            clients = await Clients.start(
                [(url, subscribers, "caught-up")],
                procs=procs,
                stream=True,
                expect_close=1000,
                timeout_s=timeout_s,
                cores=cores[1] if cores is not None else None,
            )
            stack.push_async_callback(clients.close)
            await clients.connect(timeout_s)
        rss_idle = rss_bytes(server.pid)
        direct_before = metric((await http.get("/metrics")).text, "gateway_hub_direct_writes")
        cpu_before = cpu_seconds(server.pid)
        async with harness.profiled(server.pid, f"fanout-gateway-{subscribers}"):
            posted = await post_callbacks(
                write_http, task_id, made["callbackToken"], plan(callbacks), rate, seconds
            )
            stats = {}
            if clients is not None:
                await clients.final(start_version + posted["posted"])
                stats = await clients.done(timeout_s)
            cpu = cpu_seconds(server.pid) - cpu_before
        version = (await http.get(f"/v1/tasks/{task_id}")).json()["version"]
        direct = metric((await http.get("/metrics")).text, "gateway_hub_direct_writes") - direct_before
    frames = stats.get("deliveries", 0)
    return {
        **stats,
        **posted,
        "frames": frames,
        "direct_writes": direct,
        "entries": version - start_version,
        "cpu_s": cpu,
        "cpu_us_per_frame": cpu * 1e6 / frames if frames else float("nan"),
        "cpu_us_per_callback": cpu * 1e6 / posted["posted"],
        "idle_bytes_per_subscriber": (rss_idle - rss_before) / subscribers if subscribers else float("nan"),
    }


def pooled(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Runs of :func:`bench_gateway` as one: their callbacks' latencies pooled (p50, p99, how many), the
    mean of their rates achieved and CPU per callback."""
    latencies = [latency for run in runs for latency in run["latencies"]]
    return {
        "timed": len(latencies),
        "callback_p50_ms": statistics.median(latencies) * 1000,
        "callback_p99_ms": percentile(latencies, 0.99) * 1000,
        "achieved_rate": statistics.mean(run["achieved_rate"] for run in runs),
        "cpu_us_per_callback": statistics.mean(run["cpu_us_per_callback"] for run in runs),
    }


def metric(text: str, name: str) -> float:
    """One value of a Prometheus text exposition (``nan`` if absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def sample_frame(version: int) -> str:
    """An ``event`` frame of the gateway's shape and size, at ``version``."""
    return json.dumps(
        {
            "type": "event",
            "taskId": "bench",
            "version": version,
            "event": {"type": "progress", "atMs": 1795990509567, "progress": 41, "cursor": "row-41"},
            "task": {
                "id": "bench",
                "state": "running",
                "expiresAtMs": 1795994109539,
                "attempts": 1,
                "maxAttempts": 1,
                "progress": 41,
                "version": version,
            },
        },
        separators=(",", ":"),
    )


async def bench_floor(
    subscribers: int,
    callbacks: int,
    rate: float,
    procs: int,
    timeout_s: float = 180.0,
    server: harness.Server | None = None,
) -> dict[str, Any]:
    """The same run against the raw ``websockets`` broadcast server: ``callbacks`` frames at ``rate``, sent by
    a publisher connection (to ``server`` if given, else to one started for the run). The server's CPU is
    read before the first frame and after it has answered a ping sent behind the last one (it has read
    them all) and, with subscribers, once every subscriber has the last one: with none, the window holds
    the publisher's frames alone."""
    from websockets.asyncio.client import connect

    async with contextlib.AsyncExitStack() as stack:
        if server is None:
            server = await stack.enter_async_context(harness.floor_server())
        publisher = await stack.enter_async_context(connect(f"{server.ws}/publish", compression=None))
        rss_before = rss_bytes(server.pid)
        clients = None
        if subscribers:
            clients = await Clients.start(
                [(f"{server.ws}/", subscribers, "hello")],
                procs=procs,
                stream=True,
                final=callbacks,
                timeout_s=timeout_s,
            )
            stack.push_async_callback(clients.close)
            await clients.connect(timeout_s)
        rss_idle = rss_bytes(server.pid)
        frames_out = [sample_frame(v) for v in range(1, callbacks + 1)]
        cpu_before = cpu_seconds(server.pid)
        async with harness.profiled(server.pid, f"fanout-floor-{subscribers}"):
            started = time.perf_counter()
            for i, frame in enumerate(frames_out):
                due = started + i / rate
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                await publisher.send(frame)
            await asyncio.wait_for(await publisher.ping(), timeout_s)
            stats = await clients.done(timeout_s) if clients is not None else {}
            cpu = cpu_seconds(server.pid) - cpu_before
    frames = stats.get("deliveries", 0)
    return {
        **stats,
        "frames": frames,
        "cpu_s": cpu,
        "cpu_us_per_frame": cpu * 1e6 / frames if frames else float("nan"),
        "idle_bytes_per_subscriber": (rss_idle - rss_before) / subscribers if subscribers else float("nan"),
    }


async def main(args: argparse.Namespace) -> None:
    harness.raise_nofile(args.subscribers + 1024)
    buses = [b.strip() for b in args.buses.split(",") if b.strip()]
    run = (args.subscribers, args.callbacks, args.rate, args.procs)
    by_bus: dict[str, dict[str, Any]] = {}
    if buses == ["local"]:
        gateway = await bench_gateway(*run)
    else:
        async with harness.pg_database(args.pg_admin_url) as database_url:
            for bus in buses:
                bus_url = args.redis_url if bus == "redis" else bus
                by_bus[bus] = await bench_gateway(*run, database_url, bus_url)
                if bus != "local":
                    by_bus[f"{bus}, writer elsewhere"] = await bench_gateway(
                        *run, database_url, bus_url, True
                    )
        gateway = by_bus[buses[0]]
    floor = await bench_floor(*run)
    n = args.subscribers
    print(
        f"fan-out: 1 task, {n} subscribers in {args.procs} client processes, "
        f"{args.callbacks} callbacks at {args.rate}/s, {os.cpu_count()} cores"
    )
    print(f"{'':28}{'gateway':>14}{'raw websockets':>16}{'ratio':>8}")
    rows = [
        ("frames delivered", gateway["frames"], floor["frames"], "{:>14.0f}", "{:>16.0f}"),
        (
            "server CPU us / frame",
            gateway["cpu_us_per_frame"],
            floor["cpu_us_per_frame"],
            "{:>14.1f}",
            "{:>16.1f}",
        ),
        (
            "idle memory / subscriber",
            gateway["idle_bytes_per_subscriber"] / 1024,
            floor["idle_bytes_per_subscriber"] / 1024,
            "{:>11.1f} KiB",
            "{:>13.1f} KiB",
        ),
    ]
    for name, ours, theirs, f1, f2 in rows:
        ratio = ours / theirs if theirs else float("nan")
        print(f"{name:<28}" + f1.format(ours) + f2.format(theirs) + f"{ratio:>8.2f}")
    print(
        f"{'frames lost / out of order':<28}{gateway['lost']:>9} / {gateway['out_of_order']:<2}"
        f"{floor['lost']:>11} / {floor['out_of_order']:<2}"
    )
    print(
        f"callback latency at {n} subscribers: p50 {gateway['callback_p50_ms']:.1f} ms, "
        f"p99 {gateway['callback_p99_ms']:.1f} ms ({gateway['achieved_rate']:.1f}/s of {args.rate:g}/s asked)"
    )
    written = f"{gateway['direct_writes']:.0f} of {gateway['frames']:.0f}"
    print(f"frames the hub wrote straight to sockets: {written}")
    if gateway["conflated"]:
        print(f"note: {gateway['conflated']} conflated snapshots stood for the entries they cover")
    if buses != ["local"]:
        base = by_bus[buses[0]]["cpu_us_per_frame"]
        raw = floor["cpu_us_per_frame"]
        print(f"\nby bus (PostgreSQL store; ratio to the {buses[0]} bus; raw websockets {raw:.1f} us/frame)")
        header = ("bus", "CPU us/frame", "ratio", "frames", "cb p50 ms", "cb p99 ms")
        print(f"{header[0]:<28}{header[1]:>14}{header[2]:>8}{header[3]:>10}{header[4]:>11}{header[5]:>11}")
        for name, result in by_bus.items():
            print(
                f"{name:<28}{result['cpu_us_per_frame']:>14.1f}{result['cpu_us_per_frame'] / base:>8.2f}"
                f"{result['frames']:>10.0f}{result['callback_p50_ms']:>11.1f}{result['callback_p99_ms']:>11.1f}"
            )


def command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench fanout", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--subscribers", type=int, default=1000)
    parser.add_argument("--callbacks", type=int, default=200)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--buses", default="local", help="comma-separated: local, postgres, redis")
    parser.add_argument("--pg-admin-url", default=harness.PG_ADMIN)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    return harness.run_to_the_end(main(parser.parse_args(argv)))
