"""Expiry benchmark: a sweep pass among a million live tasks costs what it costs among a few.

Builds two PostgreSQL databases of its own (dropped at the end): one with ``--live`` tasks that are not
due (1,000,000 by default) plus ``--due`` tasks that are, one with only the due tasks (the floor). In each
it times an idle pass (nothing due yet: the one query a sweeper makes every 200 ms) and the pass that
expires the due tasks (in batches of ``EXPIRY_BATCH``, each one transaction), and prints them side by side
with the ratio, and the plan PostgreSQL chose for the claim query.

    python -m bench expiry [--live 1000000] [--due 1000] [--pg-admin-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import uuid
from collections.abc import Sequence

import asyncpg  # type: ignore[import-untyped]  # no stubs, no py.typed (as in gateway/store/database.py)

from gateway.book.book import EXPIRY_BATCH, Book
from gateway.jobs.sweeper import sweep_once
from gateway.store import Database
from gateway.store.sql import SqlStore

NOW = 1_800_000_000_000


async def fill(url: str, live: int, due: int) -> None:
    conn = await asyncpg.connect(url)
    try:
        # Tasks in the shape the gateway writes them: live ones far from their deadline, due ones past it.
        insert = (
            "INSERT INTO tasks (id, state, expires_at_ms, attempts, max_attempts, progress, version, ttl_ms,"
            " created_at_ms) SELECT $1 || g, $2, $3::bigint + g, 0, 1, 0, 0, 1, 0"
            " FROM generate_series(1, $4) g"
        )
        if live:
            await conn.execute(insert, "live-", "queued", NOW + 3_600_000, live)
        await conn.execute(insert, "due-", "running", NOW - 60_000, due)
        await conn.execute("ANALYZE tasks")
    finally:
        await conn.close()


async def measure(url: str, due: int, idle_runs: int = 50) -> dict[str, float | str]:
    db = Database(url)
    store = SqlStore(db)
    await store.open()
    try:
        idle: list[float] = []
        book = Book(store, lambda: NOW - 120_000)  # before any deadline: nothing is due
        for _ in range(idle_runs):
            started = time.perf_counter()
            assert await book.expire_due(EXPIRY_BATCH) == 0
            idle.append(time.perf_counter() - started)
        book = Book(store, lambda: NOW)
        started = time.perf_counter()
        expired = await sweep_once(book)
        pass_s = time.perf_counter() - started
        assert expired == due, (expired, due)
        conn = await asyncpg.connect(url)
        try:
            plan = await conn.fetch(
                "EXPLAIN SELECT * FROM tasks WHERE state IN ('queued', 'running') AND expires_at_ms <= $1 "
                "ORDER BY expires_at_ms LIMIT 200 FOR UPDATE SKIP LOCKED",
                NOW,
            )
        finally:
            await conn.close()
    finally:
        await store.close()
    return {
        "idle_ms": statistics.median(idle) * 1000,
        "pass_ms": pass_s * 1000,
        "plan": " / ".join(r[0].strip() for r in plan if "Scan" in r[0]),
    }


async def main(args: argparse.Namespace) -> None:
    admin = await asyncpg.connect(args.pg_admin_url)
    names = {kind: f"gw_bench_expiry_{kind}_{uuid.uuid4().hex[:8]}" for kind in ("big", "floor")}
    base = args.pg_admin_url.rsplit("/", 1)[0]
    try:
        results = {}
        for kind, name in names.items():
            await admin.execute(f'CREATE DATABASE "{name}"')
            url = f"{base}/{name}"
            await Database(url).open()  # the schema, as the gateway makes it (migrations)
            started = time.perf_counter()
            await fill(url, args.live if kind == "big" else 0, args.due)
            print(f"{kind}: filled in {time.perf_counter() - started:.1f} s")
            results[kind] = await measure(url, args.due)
    finally:
        for name in names.values():
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
    big, floor = results["big"], results["floor"]
    print(
        f"expiry: {args.live:,} live tasks not due + {args.due:,} due, batches of {EXPIRY_BATCH}, PostgreSQL"
    )
    print(f"{'':34}{'1M live':>12}{'floor':>12}{'ratio':>8}")
    for key, label in (
        ("idle_ms", "idle pass (nothing due), ms"),
        ("pass_ms", f"pass expiring {args.due:,}, ms"),
    ):
        ours, theirs = float(big[key]), float(floor[key])
        print(f"{label:<34}{ours:>12.2f}{theirs:>12.2f}{ours / theirs:>8.2f}")
    print(f"plan with {args.live:,} live tasks: {big['plan']}")


def command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench expiry", description=__doc__.splitlines()[0])
    parser.add_argument("--live", type=int, default=1_000_000)
    parser.add_argument("--due", type=int, default=1_000)
    parser.add_argument("--pg-admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    asyncio.run(main(parser.parse_args(argv)))
    return 0
