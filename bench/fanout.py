"""Fan-out benchmark: one task, N subscribers in separate client processes, callbacks at a fixed rate.

Prints the gateway server's CPU microseconds per delivered frame (utime + stime of its process, from
/proc/<pid>/stat), its idle memory per subscriber (VmRSS growth / N) and the callbacks' latency, beside
a minimal raw ``websockets`` broadcast server sending frames of the same size (the floor of Python on
this machine), and the ratio.

    python bench/fanout.py [--subscribers 1000] [--callbacks 200] [--rate 50] [--procs 4]
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
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")
SECRET = "bench-secret-0123456789abcdef0123456789"

# The floor: every message from the "publisher" connection goes to every other connection.
FLOOR_SERVER = """
import asyncio, sys
from websockets.asyncio.server import serve, broadcast
subscribers = set()
async def handler(ws):
    if ws.request.path == "/publish":
        async for message in ws:
            broadcast(subscribers, message)
        return
    subscribers.add(ws)
    try:
        await ws.wait_closed()
    finally:
        subscribers.discard(ws)
async def main():
    async with serve(handler, "127.0.0.1", int(sys.argv[1]), ping_interval=20, compression=None):
        print("ready", flush=True)
        await asyncio.Future()
asyncio.run(main())
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


# --- the subscriber processes ------------------------------------------------------------------------


async def client_main(url: str, count: int, expect: int) -> None:
    """Open ``count`` sockets, say "ready" once all are subscribed, then count frames until ``expect``."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    ready = 0
    totals: list[int] = []
    all_ready = asyncio.Event()

    async def one() -> None:
        nonlocal ready
        received = 0
        async with connect(url, max_size=2**22, open_timeout=60) as ws:
            await ws.recv()  # the resume frame (gateway) / a hello (floor)
            ready += 1
            if ready == count:
                all_ready.set()
            try:
                while received < expect:
                    await ws.recv()
                    received += 1
            except ConnectionClosed:
                pass
        totals.append(received)

    tasks = [asyncio.create_task(one()) for _ in range(count)]
    await all_ready.wait()
    print("ready", flush=True)
    await asyncio.gather(*tasks)
    print(json.dumps({"frames": sum(totals), "min": min(totals)}), flush=True)


# --- the driver --------------------------------------------------------------------------------------


async def start_clients(
    url: str, subscribers: int, procs: int, expect: int
) -> list[asyncio.subprocess.Process]:
    procs = max(1, min(procs, subscribers))
    per = [subscribers // procs + (1 if i < subscribers % procs else 0) for i in range(procs)]
    clients = []
    for count in per:
        clients.append(
            await asyncio.create_subprocess_exec(
                sys.executable, __file__, "client", url, str(count), str(expect), stdout=subprocess.PIPE
            )
        )
    for client in clients:
        assert client.stdout is not None
        line = await asyncio.wait_for(client.stdout.readline(), 120)
        assert line.strip() == b"ready", line
    return clients


async def finish_clients(clients: list[asyncio.subprocess.Process]) -> int:
    frames = 0
    for client in clients:
        assert client.stdout is not None
        line = await asyncio.wait_for(client.stdout.readline(), 120)
        frames += json.loads(line)["frames"]
        await client.wait()
    return frames


async def wait_http(url: str) -> None:
    import httpx

    async with httpx.AsyncClient() as http:
        for _ in range(200):
            try:
                if (await http.get(url + "/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError("gateway did not start")


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


def start_gateway(port: int, database_url: str, bus: str | None) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(GATEWAY_SECRET=SECRET, GATEWAY_LOG_LEVEL="warning")
    if bus is not None:
        env["GATEWAY_BUS_URL"] = bus
    command = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--port",
        str(port),
        "--database-url",
        database_url,
    ]
    return subprocess.Popen(command, env=env)


async def bench_gateway(
    args: argparse.Namespace, database_url: str | None = None, bus: str | None = None, remote: bool = False
) -> dict[str, float]:
    """One run: subscribers on one gateway process; callbacks to it, or (``remote``) to a second one."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    task_id = f"bench-{uuid.uuid4().hex[:8]}"  # runs may share a database
    with tempfile.TemporaryDirectory() as tmp:
        server = start_gateway(port, database_url or f"sqlite:///{tmp}/bench.db", bus)
        writer_port = free_port() if remote else port
        writer = start_gateway(writer_port, database_url or "", bus) if remote else None
        try:
            await wait_http(url)
            if writer is not None:
                await wait_http(f"http://127.0.0.1:{writer_port}")
            async with (
                httpx.AsyncClient(base_url=url, timeout=60) as http,
                httpx.AsyncClient(base_url=f"http://127.0.0.1:{writer_port}", timeout=60) as write_http,
            ):
                attempts = args.callbacks // 100 + 1
                made = (
                    await http.post(
                        "/v1/tasks", json={"id": task_id, "ttlMs": 3_600_000, "maxAttempts": attempts}
                    )
                ).json()
                cb = {"Authorization": f"Bearer {made['callbackToken']}"}
                rss_before = rss_bytes(server.pid)
                ws_url = (
                    f"ws://127.0.0.1:{port}/v1/tasks/{task_id}/ws?cursor=0&token={made['subscribeToken']}"
                )
                clients = await start_clients(ws_url, args.subscribers, args.procs, args.callbacks)
                rss_idle = rss_bytes(server.pid)
                cpu_before = cpu_seconds(server.pid)
                latencies = []
                started = time.perf_counter()
                for i, event in enumerate(plan(args.callbacks)):
                    due = started + i / args.rate
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    t0 = time.perf_counter()
                    answer = await write_http.post(
                        f"/v1/tasks/{task_id}/callbacks", json={"event": event}, headers=cb
                    )
                    latencies.append(time.perf_counter() - t0)
                    answer.raise_for_status()
                    assert answer.json()["changed"], answer.text
                version = (await http.get(f"/v1/tasks/{task_id}")).json()["version"]
                frames = await finish_clients(clients)
                cpu = cpu_seconds(server.pid) - cpu_before
        finally:
            for process in (server, writer):
                if process is not None:
                    process.terminate()
                    process.wait(10)
    latencies.sort()
    return {
        "frames": frames,
        "entries": version,
        "cpu_us_per_frame": cpu * 1e6 / max(frames, 1),
        "idle_bytes_per_subscriber": (rss_idle - rss_before) / args.subscribers,
        "callback_p50_ms": statistics.median(latencies) * 1000,
        "callback_p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
    }


async def bench_floor(args: argparse.Namespace, frame: str) -> dict[str, float]:
    from websockets.asyncio.client import connect

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", FLOOR_SERVER, str(port)], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == b"ready"
        async with connect(f"ws://127.0.0.1:{port}/publish") as publisher:
            rss_before = rss_bytes(server.pid)
            # The floor has no resume frame: each subscriber's first frame is a hello.
            clients_task = asyncio.create_task(
                start_clients(f"ws://127.0.0.1:{port}/", args.subscribers, args.procs, args.callbacks)
            )
            while not clients_task.done():
                await publisher.send("hello")
                await asyncio.sleep(0.2)
            clients = clients_task.result()
            rss_idle = rss_bytes(server.pid)
            await asyncio.sleep(0.5)  # let the last hellos drain before counting
            cpu_before = cpu_seconds(server.pid)
            started = time.perf_counter()
            for i in range(args.callbacks):
                due = started + i / args.rate
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                await publisher.send(frame)
            frames = await finish_clients(clients)
            cpu = cpu_seconds(server.pid) - cpu_before
    finally:
        server.terminate()
        server.wait(10)
    return {
        "frames": frames,
        "cpu_us_per_frame": cpu * 1e6 / max(frames, 1),
        "idle_bytes_per_subscriber": (rss_idle - rss_before) / args.subscribers,
    }


SAMPLE_FRAME = json.dumps(
    {
        "type": "event",
        "taskId": "bench",
        "version": 42,
        "event": {"type": "progress", "atMs": 1795990509567, "progress": 41, "cursor": "row-41"},
        "task": {
            "id": "bench",
            "state": "running",
            "expiresAtMs": 1795994109539,
            "attempts": 1,
            "maxAttempts": 1,
            "progress": 41,
            "version": 42,
        },
    },
    separators=(",", ":"),
)


async def main(args: argparse.Namespace) -> None:
    buses = [b.strip() for b in args.buses.split(",") if b.strip()]
    if buses == ["local"]:
        gateway = await bench_gateway(args)
    else:
        async with bench_database(args.pg_admin_url) as database_url:
            by_bus: dict[str, dict[str, float]] = {}
            for bus in buses:
                bus_url = args.redis_url if bus == "redis" else bus
                by_bus[bus] = await bench_gateway(args, database_url, bus_url)
                if bus != "local":
                    by_bus[f"{bus}, writer elsewhere"] = await bench_gateway(
                        args, database_url, bus_url, True
                    )
        gateway = by_bus[buses[0]]
    floor = await bench_floor(args, SAMPLE_FRAME)
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
        f"callback latency at {n} subscribers: p50 {gateway['callback_p50_ms']:.1f} ms, "
        f"p99 {gateway['callback_p99_ms']:.1f} ms"
    )
    expected = n * args.callbacks
    if gateway["frames"] != expected:
        print(
            f"note: gateway delivered {gateway['frames']} of {expected} frames "
            "(a conflated snapshot replaces the entries it covers)"
        )
    if buses != ["local"]:
        base = by_bus[buses[0]]["cpu_us_per_frame"]
        raw = floor["cpu_us_per_frame"]
        print(f"\nby bus (PostgreSQL store; ratio to the {buses[0]} bus; raw websockets {raw:.1f} us/frame)")
        header = ("bus", "CPU us/frame", "ratio", "frames", "cb p50 ms", "cb p99 ms")
        print(f"{header[0]:<28}{header[1]:>14}{header[2]:>8}{header[3]:>10}{header[4]:>11}{header[5]:>11}")
        for name, run in by_bus.items():
            print(
                f"{name:<28}{run['cpu_us_per_frame']:>14.1f}{run['cpu_us_per_frame'] / base:>8.2f}"
                f"{run['frames']:>10.0f}{run['callback_p50_ms']:>11.1f}{run['callback_p99_ms']:>11.1f}"
            )


@contextlib.asynccontextmanager
async def bench_database(admin_url: str) -> AsyncIterator[str]:
    """A PostgreSQL database of the run's own, dropped at the end."""
    import asyncpg

    name = f"gw_bench_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(admin_url, timeout=5)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield admin_url.rsplit("/", 1)[0] + "/" + name
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        asyncio.run(client_main(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subscribers", type=int, default=1000)
    parser.add_argument("--callbacks", type=int, default=200)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--buses", default="local", help="comma-separated: local, postgres, redis")
    parser.add_argument("--pg-admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    asyncio.run(main(parser.parse_args()))
