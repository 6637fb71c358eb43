"""Callback throughput: the gateway beside the floor of the same Python stack, in one run.

``--connections`` keep-alive HTTP connections (32) each drive tasks of their own through start and
progress 1..100 (every callback a real change, each with a unique callbackId), for ``--seconds``, against:

- the gateway (``gateway serve``, one process) on SQLite and on PostgreSQL;
- the floor: uvicorn + Starlette, one handler doing the same transaction per callback on the bare driver
  (sqlite3 with WAL and synchronous=FULL, or asyncpg): lock the task, look the callback id up, update the
  task, append the entry, remember the id, commit;
- the same handler answering without a database (what HTTP alone costs here).

The client (bench/programs/callback_client.py) is a small raw-socket HTTP/1.1 client in its own process
(one core), so that it is not what is measured; the floor handler is bench/programs/callback_floor.py.
Prints callbacks/s for each and the gateway's ratio to its floor.

    python -m bench callbacks [--seconds 5] [--connections 32] [--only sqlite,postgresql,none]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from bench.lib import harness
from bench.lib.harness import free_port, wait_port

PG_ADMIN = harness.PG_ADMIN


async def measure(port: int, args: argparse.Namespace) -> dict[str, Any]:
    client = await harness.spawn(
        harness.program("callback_client", str(port), str(args.connections), str(args.seconds)),
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
    async with server(harness.program("callback_floor", kind, target, str(port)), port):
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
    for name, first, second in rows:
        if second is None:
            print(f"{name:<28}{'':>10}{first['per_s']:>10.0f}")
        else:
            ratio = first["per_s"] / second["per_s"]
            print(f"{name:<28}{first['per_s']:>10.0f}{second['per_s']:>10.0f}{ratio:>8.2f}")
        for label, result in (("gateway", first), ("floor", second)):
            if result and result.get("errors"):
                print(f"  {label} errors: {result['errors']}")


def command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench callbacks", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--only", default="none,sqlite,postgresql")
    return harness.run_to_the_end(main(parser.parse_args(argv)))
