"""Callback throughput: the gateway beside the floor of the same Python stack, in one run.

``--connections`` keep-alive HTTP connections (32) each drive tasks of their own through start and
progress 1..100 (every callback a real change, each with a unique callbackId), for ``--seconds``, against:

- the gateway (``gateway serve``, one process) on SQLite and on PostgreSQL;
- the floor: uvicorn + Starlette, one handler doing the same transaction per callback on the bare driver
  (sqlite3 with WAL and synchronous=FULL, or asyncpg): lock the task, look the callback id up, update the
  task, append the entry, remember the id, commit;
- the same handler answering without a database (what HTTP alone costs here).

The client is a small raw-socket HTTP/1.1 client in its own process (one core), so that it is not what
is measured. Prints callbacks/s for each and the gateway's ratio to its floor.

    python bench/callbacks.py [--seconds 5] [--connections 32] [--only sqlite,postgresql,none]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import harness
from harness import free_port, wait_port

PG_ADMIN = harness.PG_ADMIN

FLOOR_SERVER = r"""
import asyncio, json, sqlite3, sys, time
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

kind, target, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
SCHEMA = [
    "CREATE TABLE IF NOT EXISTS tasks (id TEXT PRIMARY KEY, state TEXT, progress BIGINT, version BIGINT)",
    "CREATE TABLE IF NOT EXISTS entries (task_id TEXT, version BIGINT, event BYTEA,"
    " PRIMARY KEY (task_id, version))",
    "CREATE TABLE IF NOT EXISTS callbacks (callback_id TEXT PRIMARY KEY, task_id TEXT, digest TEXT)",
]
db = None
pool = None

def ok(body):
    return Response(json.dumps(body), media_type="application/json")

async def create(request: Request):
    body = json.loads(await request.body())
    if kind == "sqlite":
        with db:
            db.execute("INSERT INTO tasks VALUES (?, 'queued', 0, 0)", (body["id"],))
    elif kind == "postgresql":
        async with pool.acquire() as conn:
            await conn.execute("INSERT INTO tasks VALUES ($1, 'queued', 0, 0)", body["id"])
    return ok({"task": {"id": body["id"]}, "callbackToken": "x", "subscribeToken": "x"})

async def callback(request: Request):
    task_id = request.path_params["task_id"]
    body = json.loads(await request.body())
    event, cid = body["event"], body["callbackId"]
    event["atMs"] = time.time_ns() // 1_000_000
    raw = json.dumps(event)
    progress = event.get("progress", 0)
    if kind == "none":
        return ok({"changed": True, "reason": "progress"})
    if kind == "sqlite":
        db.execute("BEGIN IMMEDIATE")
        try:
            version = db.execute("SELECT version FROM tasks WHERE id = ?", (task_id,)).fetchone()[0]
            db.execute("SELECT digest FROM callbacks WHERE callback_id = ?", (cid,)).fetchone()
            db.execute("UPDATE tasks SET state = 'running', progress = ?, version = ? WHERE id = ?",
                       (progress, version + 1, task_id))
            db.execute("INSERT INTO entries VALUES (?, ?, ?)", (task_id, version + 1, raw))
            db.execute("INSERT INTO callbacks VALUES (?, ?, 'd')", (cid, task_id))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
    else:
        async with pool.acquire() as conn, conn.transaction():
            version = await conn.fetchval("SELECT version FROM tasks WHERE id = $1 FOR UPDATE", task_id)
            await conn.fetchval("SELECT digest FROM callbacks WHERE callback_id = $1", cid)
            await conn.execute(
                "UPDATE tasks SET state = 'running', progress = $1, version = $2 WHERE id = $3",
                progress, version + 1, task_id)
            await conn.execute("INSERT INTO entries VALUES ($1, $2, $3)", task_id, version + 1, raw.encode())
            await conn.execute("INSERT INTO callbacks VALUES ($1, $2, 'd')", cid, task_id)
    return ok({"changed": True, "reason": "progress"})

async def startup():
    global db, pool
    if kind == "sqlite":
        db = sqlite3.connect(target, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=FULL")
        for statement in SCHEMA:
            db.execute(statement.replace("BYTEA", "BLOB"))
    elif kind == "postgresql":
        import asyncpg
        pool = await asyncpg.create_pool(target, min_size=10, max_size=20)
        async with pool.acquire() as conn:
            for statement in SCHEMA:
                await conn.execute(statement)

import contextlib

@contextlib.asynccontextmanager
async def lifespan(app):
    await startup()
    yield

app = Starlette(routes=[Route("/v1/tasks", create, methods=["POST"]),
                        Route("/v1/tasks/{task_id}/callbacks", callback, methods=["POST"])],
                lifespan=lifespan)
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""


# --- the client (its own process) -------------------------------------------------------------------


def request_bytes(path: str, body: dict[str, object], token: str) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {token}\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[int, bytes]:
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    return status, await reader.readexactly(length)


async def client_main(port: int, connections: int, seconds: float) -> None:
    run = uuid.uuid4().hex[:8]
    done = [0]
    errors: dict[int, int] = {}
    stop_at = 0.0

    async def one(c: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        k = 0
        while True:
            task_id = f"b-{run}-{c}-{k}"
            status, body = await exchange(
                reader,
                writer,
                request_bytes("/v1/tasks", {"id": task_id, "ttlMs": 3_600_000, "maxAttempts": 1}, "none"),
            )
            token = json.loads(body)["callbackToken"]
            path = f"/v1/tasks/{task_id}/callbacks"
            steps = [{"type": "start", "worker": "w"}] + [
                {"type": "progress", "progress": p, "cursor": "c"} for p in range(1, 101)
            ]
            for i, event in enumerate(steps):
                if time.monotonic() >= stop_at:
                    writer.close()
                    return
                status, _ = await exchange(
                    reader,
                    writer,
                    request_bytes(path, {"callbackId": f"{task_id}-{i}", "event": event}, token),
                )
                if status == 200:
                    done[0] += 1
                else:
                    errors[status] = errors.get(status, 0) + 1
            k += 1

    stop_at = time.monotonic() + seconds
    started = time.monotonic()
    await asyncio.gather(*(one(c) for c in range(connections)))
    elapsed = time.monotonic() - started
    print(json.dumps({"per_s": done[0] / elapsed, "done": done[0], "errors": errors}), flush=True)


async def measure(port: int, args: argparse.Namespace) -> dict[str, Any]:
    client = await harness.spawn(
        [sys.executable, __file__, "client", str(port), str(args.connections), str(args.seconds)],
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        out, _ = await asyncio.wait_for(client.communicate(), args.seconds + 60)
    finally:
        await harness.stop(client, 5)
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


@contextlib.asynccontextmanager
async def server(command: list[str], port: int, env: dict[str, str] | None = None) -> AsyncIterator[None]:
    process = await harness.spawn(command, env=env)
    try:
        await wait_port(port, process=process)
        yield
    finally:
        await harness.stop(process)


@contextlib.asynccontextmanager
async def pg_database(admin_url: str = PG_ADMIN) -> AsyncIterator[str]:
    async with harness.pg_database(admin_url, "gw_bench_cb") as url:
        yield url


async def measure_gateway(gateway: harness.Server, store: str, args: argparse.Namespace) -> dict[str, Any]:
    """The client against a running gateway (``store``: sqlite or postgresql, for the profile's name)."""
    async with harness.profiled(gateway.pid, f"callbacks-gateway-{store}"):
        return await measure(gateway.port, args)


async def run_gateway(database_url: str, args: argparse.Namespace) -> dict[str, Any]:
    async with harness.gateway(database_url) as gateway:
        store = "sqlite" if database_url.startswith("sqlite") else "postgresql"
        return await measure_gateway(gateway, store, args)


@contextlib.asynccontextmanager
async def floor(kind: str, target: str) -> AsyncIterator[int]:
    """The floor handler (``kind``: none, sqlite on file ``target``, postgresql at URL ``target``) running;
    yields its port."""
    port = free_port()
    async with server([sys.executable, "-c", FLOOR_SERVER, kind, target, str(port)], port):
        yield port


async def run_floor(kind: str, target: str, args: argparse.Namespace) -> dict[str, Any]:
    async with floor(kind, target) as port:
        return await measure(port, args)


async def main(args: argparse.Namespace) -> None:
    only = set(args.only.split(","))
    rows: list[tuple[str, dict[str, Any], dict[str, Any] | None]] = []
    with tempfile.TemporaryDirectory() as tmp:
        if "none" in only:
            rows.append(("no database (HTTP alone)", await run_floor("none", "", args), None))
        if "sqlite" in only:
            gateway = await run_gateway(f"sqlite:///{Path(tmp) / 'gw.db'}", args)
            floor = await run_floor("sqlite", str(Path(tmp) / "floor.db"), args)
            rows.append(("SQLite", gateway, floor))
        if "postgresql" in only:
            async with pg_database() as url:
                gateway = await run_gateway(url, args)
            async with pg_database() as url:
                floor = await run_floor("postgresql", url, args)
            rows.append(("PostgreSQL", gateway, floor))
    print(
        f"callbacks/s: {args.connections} keep-alive connections, {args.seconds:.0f} s each, "
        f"{os.cpu_count()} cores"
    )
    print(f"{'':28}{'gateway':>10}{'floor':>10}{'ratio':>8}")
    for name, first, floor in rows:
        if floor is None:
            print(f"{name:<28}{'':>10}{first['per_s']:>10.0f}")
        else:
            ratio = first["per_s"] / floor["per_s"]
            print(f"{name:<28}{first['per_s']:>10.0f}{floor['per_s']:>10.0f}{ratio:>8.2f}")
        for label, result in (("gateway", first), ("floor", floor)):
            if result and result.get("errors"):
                print(f"  {label} errors: {result['errors']}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        asyncio.run(client_main(int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])))
        sys.exit(0)
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--only", default="none,sqlite,postgresql")
    try:
        asyncio.run(main(parser.parse_args()))
    finally:
        harness.kill_all()
        harness.drop_leftover_databases()
