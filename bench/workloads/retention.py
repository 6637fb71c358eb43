"""Retention under steady churn: the database's size stays put, round after round.

    python -m bench retention [--tasks 100000] [--rounds 3] [--backends sqlite,postgresql]
                              [--scale-factor 0.02] [--autovacuum-each-step] [--pg-admin-url URL]
    python -m bench retention --smoke

For each backend, on a database of its own, a gateway (``gateway.runtime.Gateway``, the composition root,
with ``GATEWAY_RETAIN_FINISHED_S=10`` and its lifespan's retention loop) on a clock the bench moves: one
round is 10 s of the gateway's time, the retention, in ``SLICES`` steps. At each step ``--tasks / --rounds
/ SLICES`` tasks are created (in batches, through the store's ``insert_task``: the statement of ``POST
/v1/tasks``), run and finished by three callbacks each (start, progress 50, succeed, each with a callback
id; applied by the book in batches, as group commit applies concurrent callbacks), given one delivery
receipt each and drained; then the clock moves a step on, and the bench waits (a condition with a
deadline, never a fixed sleep) until the retention loop has deleted the tasks that are now a retention
old: steady churn, a step's tasks coming as the oldest step's go. At the end of each round it measures
the database's size: a SQLite database's pages (its WAL's included: the file's size once they are
checkpointed; the file and the WAL on disk are printed beside), PostgreSQL's ``pg_total_relation_size``
of the gateway's tables (their indexes, TOAST and free space maps included).

SQLite's database is a file in a temporary directory. PostgreSQL's is a cluster of the bench's own
(tests/support/pgcluster.py: ``initdb`` and ``pg_ctl`` on a free loopback port, stopped and removed after)
whose autovacuum does the work, nothing standing in for it: autovacuum on, its cycle compressed as the
retention is (``autovacuum_naptime`` a second, its least, for a minute by default), each table's
``autovacuum_vacuum_scale_factor`` the gateway's own (0.02, set by its migration 0006; ``--scale-factor`` to
measure another);
``pg_stat_user_tables.autovacuum_count`` says how often it ran. Each round's size is read once autovacuum
has caught up with the round's deletes (``Autovacuum.settled``; ``--autovacuum-each-step``: after each
step's too, before the next step's tasks). ``--pg-admin-url`` runs it on a database made on an existing
server instead, its autovacuum as it is set there (off, it is a failure: nothing would make the deleted
rows' space reusable).

After the last round, ``HELD`` tasks finish and nobody drains them: past the retention they are kept
(and counted, ``gateway_finished_tasks_held``) while every other task goes; drained, they go too.

Checks, each a line and exit 1 when one fails: the size after the last round within 1.2x the size after
the first; after each round every row of every table (tasks, history, callback ids, receipts,
notifications) is a task's that finished after the cutoff, none older (and a sample of the deleted ones is
``unknown-task`` through the book); every drain takes exactly the notifications of the tasks finished
since the one before; the held tasks are kept, and readable, until drained. Printed beside: the bytes a
finished task costs (its rows and index entries in the database at the end of the first round, divided by
its tasks).

``--smoke`` (used by ``python -m bench --smoke``): 600 tasks in rounds of ``SMOKE_SLICES`` steps, both
backends, the sizes not checked (too small to compare: a database's fixed overheads weigh more than its
tasks).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import sqlite3
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.book.book import Book, CallbackRequest
from gateway.errors import UnknownTask
from gateway.machine import Progress, Start, Succeed, create_task
from gateway.runtime import Gateway
from gateway.settings import Settings
from gateway.store.base import Notification, Receipt, Store, WriteTx
from gateway.web.render import notifications_body

ROOT = Path(__file__).resolve().parents[1]
RETAIN_S = 10
ROUNDS = 3
# Steps of a round (of the retention): each adds its tasks, while the retention loop deletes older ones.
SLICES = 10
# A smoke run's: each step waits for a pass of the retention loop, so fewer, and passes more often.
SMOKE_SLICES = 2
SMOKE_PASS_S = 0.1
# Tasks finished after the last round and not drained: kept past the retention, until they are.
HELD = 20
# Writes per transaction (creations, callbacks, receipts).
BATCH = 500
# The gateway's tables, whose sizes are the database's.
TABLES = ("tasks", "entries", "callbacks", "outbox", "deliveries")
# A task's rows in each: 3 entries, 3 callback ids, 1 notification, 1 receipt.
ROWS = {"tasks": 1, "entries": 3, "callbacks": 3, "outbox": 1, "deliveries": 1}
# The PostgreSQL cluster the bench makes (database()): autovacuum on, its cycle compressed as the retention
# is: autovacuum_naptime, how often it looks at each database, is a minute by default, a second at least.
SERVER_SETTINGS = {"autovacuum": "on", "autovacuum_naptime": "1s"}
# Each table's autovacuum_vacuum_scale_factor: None, the gateway's own (its migration 0006 sets it on the
# tables that churn); a number, set over it by ``ALTER TABLE`` (class Autovacuum), to measure another.
SCALE_FACTOR: float | None = None
# The longest the bench waits for the retention loop to have done a step's work.
WAIT_S = 600.0
MAX_GROWTH = 1.2


class Clock:
    """Epoch milliseconds that move when the bench says so (the gateway's clock)."""

    def __init__(self) -> None:
        self.now = time.time_ns() // 1_000_000

    def __call__(self) -> int:
        return self.now


@dataclass
class Sizes:
    """A database's size (its free pages included), and what its rows and indexes take (without them)."""

    total: int
    live: int
    detail: str


@dataclass
class RoundResult:
    number: int
    tasks: int  # the tasks in the database at its end (finished within the retention)
    after: Sizes
    deleted: int
    seconds: float
    # PostgreSQL: autovacuum's runs so far, by table.
    autovacuums: dict[str, int] = field(default_factory=dict)


@dataclass
class Result:
    backend: str
    empty: Sizes
    rounds: list[RoundResult] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def growth(self) -> float:
        return self.rounds[-1].after.total / self.rounds[0].after.total

    @property
    def bytes_per_task(self) -> float:
        first = self.rounds[0]
        return (first.after.live - self.empty.live) / first.tasks


# --- the database's size ----------------------------------------------------------------------------


def _sqlite_path(url: str) -> str:
    return url.removeprefix("sqlite:///")


def sqlite_sizes(path: str) -> Sizes:
    """A SQLite database's size: its pages as its readers see them (the WAL's included: the file's size
    once they are checkpointed), and the WAL file beside it."""
    wal = os.path.getsize(path + "-wal") if os.path.exists(path + "-wal") else 0
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        page_size, pages, free = (
            conn.execute(f"PRAGMA {name}").fetchone()[0]
            for name in ("page_size", "page_count", "freelist_count")
        )
    finally:
        conn.close()
    detail = (
        f"{pages:,} pages of which {free:,} free; on disk the file {os.path.getsize(path) / 2**20:.2f} MiB "
        f"and its WAL {wal / 2**20:.2f} MiB"
    )
    return Sizes(pages * page_size, (pages - free) * page_size, detail)


async def sizes(url: str) -> Sizes:
    """The database's size: a SQLite database's pages, PostgreSQL's ``pg_total_relation_size`` of the
    gateway's tables (with their indexes, TOAST and free space maps)."""
    if url.startswith("sqlite"):
        return sqlite_sizes(_sqlite_path(url))
    import asyncpg  # type: ignore[import-untyped]

    conn = await asyncpg.connect(url)
    try:
        total = 0
        parts = []
        for table in TABLES:
            size = await conn.fetchval("SELECT pg_total_relation_size($1::regclass)", table)
            total += size
            parts.append(f"{table} {size / 2**20:.2f}")
    finally:
        await conn.close()
    return Sizes(total, total, "MiB: " + ", ".join(parts))


async def finished_by(url: str, cutoff_ms: int) -> int:
    """How many tasks in the database finished at or before ``cutoff_ms``."""
    query = "SELECT count(*) FROM tasks WHERE finished_at_ms <= "
    if url.startswith("sqlite"):
        conn = sqlite3.connect(f"file:{_sqlite_path(url)}?mode=ro", uri=True)
        try:
            return int(conn.execute(query + "?", (cutoff_ms,)).fetchone()[0])
        finally:
            conn.close()
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        return int(await conn.fetchval(query + "$1", cutoff_ms))
    finally:
        await conn.close()


async def row_counts(url: str) -> dict[str, int]:
    if url.startswith("sqlite"):
        conn = sqlite3.connect(f"file:{_sqlite_path(url)}?mode=ro", uri=True)
        try:
            return {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0] for t in TABLES}
        finally:
            conn.close()
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        return {t: await conn.fetchval(f"SELECT count(*) FROM {t}") for t in TABLES}
    finally:
        await conn.close()


class Autovacuum:
    """PostgreSQL's autovacuum on the gateway's tables: each table's ``autovacuum_vacuum_scale_factor`` set
    by the gateway's migration 0006 (or over it: ``--scale-factor``), and its runs counted
    (``pg_stat_user_tables.autovacuum_count``). The server's settings are the cluster's
    (``SERVER_SETTINGS``, in the cluster :func:`database` makes)."""

    def __init__(self, url: str, scale_factor: float | None) -> None:
        self.url = url
        self.asked = scale_factor
        self.scale_factor = 0.2  # PostgreSQL's default, until configure() reads the tables' own
        self.server: dict[str, str] = {}

    async def configure(self) -> None:
        import asyncpg

        conn = await asyncpg.connect(self.url)
        try:
            if self.asked is not None:
                for table in TABLES:
                    await conn.execute(
                        f"ALTER TABLE {table} SET (autovacuum_vacuum_scale_factor = {self.asked:g})"
                    )
            # What the tables have: the gateway's migration sets it; a table that has none has the default.
            found = set()
            for table in TABLES:
                options = await conn.fetchval("SELECT reloptions FROM pg_class WHERE relname = $1", table)
                given = dict(o.split("=", 1) for o in options or ())
                found.add(float(given.get("autovacuum_vacuum_scale_factor", 0.2)))
            if len(found) != 1:
                raise RuntimeError(f"the tables' autovacuum_vacuum_scale_factor differ: {sorted(found)}")
            (self.scale_factor,) = found
            for name in ("autovacuum", "autovacuum_naptime", "autovacuum_vacuum_threshold"):
                self.server[name] = await conn.fetchval(f"SHOW {name}")
        finally:
            await conn.close()

    async def settled(self, deleted: int) -> None:
        """Until autovacuum has caught up with the deletes of ``deleted`` tasks: the statistics count each
        of their rows deleted (``n_tup_del``), and no table has as many dead rows as make autovacuum vacuum
        it (``n_dead_tup`` under ``autovacuum_vacuum_threshold`` + the scale factor x its rows). With
        autovacuum off, at once (nothing would)."""
        if self.server["autovacuum"] != "on":
            return
        import asyncpg

        base = float(self.server["autovacuum_vacuum_threshold"])
        conn = await asyncpg.connect(self.url)

        async def caught_up() -> bool:
            rows = await conn.fetch(
                "SELECT s.relname, s.n_tup_del, s.n_dead_tup, greatest(c.reltuples, 0) AS tuples "
                "FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid "
                "WHERE s.relname = ANY($1::text[])",
                list(TABLES),
            )
            return len(rows) == len(TABLES) and all(
                row["n_tup_del"] >= ROWS[row["relname"]] * deleted
                and row["n_dead_tup"] <= base + self.scale_factor * row["tuples"]
                for row in rows
            )

        try:
            await until("autovacuum caught up with the deletes", caught_up)
        finally:
            await conn.close()

    async def runs(self) -> dict[str, int]:
        """Autovacuum's runs so far, by table."""
        import asyncpg

        conn = await asyncpg.connect(self.url)
        try:
            rows = await conn.fetch(
                "SELECT relname, autovacuum_count FROM pg_stat_user_tables WHERE relname = ANY($1::text[])",
                list(TABLES),
            )
        finally:
            await conn.close()
        return {row["relname"]: row["autovacuum_count"] for row in rows}

    @property
    def note(self) -> str:
        server = ", ".join(f"{name} = {value}" for name, value in self.server.items())
        note = (
            f"PostgreSQL's autovacuum ({server}; each table's autovacuum_vacuum_scale_factor = "
            f"{self.scale_factor:g}); each round's size read once autovacuum caught up with its deletes"
        )
        if self.server.get("autovacuum") != "on":
            note += ": autovacuum is OFF on this server, nothing makes the deleted rows' space reusable"
        return note


# --- the tasks ---------------------------------------------------------------------------------------


async def make(book: Book, store: Store, ids: Sequence[str]) -> None:
    """Tasks created as ``POST /v1/tasks`` creates them (its statement), a batch per transaction."""
    now = book.clock()
    for start in range(0, len(ids), BATCH):
        chunk = ids[start : start + BATCH]

        async def work(tx: WriteTx, chunk: Sequence[str] = chunk) -> None:
            for task_id in chunk:
                await tx.insert_task(
                    create_task(id=task_id, now_ms=now, ttl_ms=3_600_000, max_attempts=3), 3_600_000, now
                )

        await store.transact(work)


async def run(book: Book, store: Store, ids: Sequence[str]) -> None:
    """Each task started, at 50%, succeeded (a callback id each, as a worker sends them), its result
    delivered once."""
    steps: list[Callable[[int], Any]] = [
        lambda now: Start(now, "bench-worker"),
        lambda now: Progress(now, 50, "row-500"),
        lambda now: Succeed(now, "s3://bench-results/report.pdf", "sha256:" + "9f2c" * 16),
    ]
    for number, step in enumerate(steps):
        for start in range(0, len(ids), BATCH):
            requests = [
                CallbackRequest(
                    task_id, step, str(uuid.uuid4()), f"digest-{number}", None if number == 0 else 1
                )
                for task_id in ids[start : start + BATCH]
            ]
            for outcome in await book.callbacks(requests):
                if isinstance(outcome, Exception) or not outcome.transition.changed:
                    raise RuntimeError(f"a callback did not apply: {outcome}")
    now = book.clock()
    for start in range(0, len(ids), BATCH):
        chunk = ids[start : start + BATCH]

        async def deliver(tx: WriteTx, chunk: Sequence[str] = chunk) -> None:
            for task_id in chunk:
                await tx.insert_receipt(
                    Receipt(
                        task_id,
                        "s3://bench-results/report.pdf",
                        "sha256:" + "9f2c" * 16,
                        str(uuid.uuid4()),
                        now,
                    )
                )

        await store.transact(deliver)


def deleted_so_far(gateway: Gateway) -> int:
    """The gateway's count of the tasks its retention deleted (its metric)."""
    value = gateway.metrics.registry.get_sample_value("gateway_finished_tasks_deleted_total")
    return int(value or 0)


async def until(what: str, check: Callable[[], Any], deadline_s: float = WAIT_S) -> None:
    """Wait for ``check()`` (awaitable) to be true, looking every 50 ms, at most ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {deadline_s:.0f} s")
        await asyncio.sleep(0.05)


async def churn(
    url: str,
    tasks: int,
    rounds: int = ROUNDS,
    *,
    slices: int = SLICES,
    growth: bool = True,
    scale_factor: float | None = SCALE_FACTOR,
    each_step: bool = False,
    pass_s: float | None = None,
    say: Callable[[str], None] = print,
) -> Result:
    """The rounds on the database at ``url`` (new and empty), with their checks; see the module's text.
    ``slices``: steps per round. ``growth``: check the sizes too (a run too small for them, a smoke run,
    checks the rest). ``scale_factor``: PostgreSQL's tables' ``autovacuum_vacuum_scale_factor``;
    ``each_step``: wait for autovacuum to catch up after each step's deletes, not only at a round's end.
    ``pass_s``: the retention loop's pass interval, if not the gateway's (a smoke run's steps each wait
    for a pass)."""
    backend = "SQLite" if url.startswith("sqlite") else "PostgreSQL"
    per_slice = max(1, tasks // rounds // slices)
    step_ms = RETAIN_S * 1000 // slices
    clock = Clock()
    settings = Settings(
        database_url=url,
        secret="bench-retention-secret-0123456789abcdef",
        retain_finished_s=RETAIN_S,
        sweep_interval_ms=0,
    )
    gateway = Gateway(settings, clock)
    retention = gateway.retention
    assert retention is not None
    if pass_s is not None:
        retention.interval_s = pass_s
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(gateway.running())
        book, store = gateway.book, gateway.store
        result = Result(backend, await sizes(url))
        autovacuum = None if url.startswith("sqlite") else Autovacuum(url, scale_factor)
        if autovacuum is not None:
            await autovacuum.configure()
            result.notes.append(autovacuum.note)
            if growth and autovacuum.server["autovacuum"] != "on":
                result.problems.append(f"{backend}: autovacuum is off on this server")
        # The tasks in the database, by when they finished; how many the retention loop deleted so far.
        present: dict[int, list[str]] = {}
        made = 0
        for number in range(1, rounds + 1):
            started = time.monotonic()
            gone: list[str] = []
            for part in range(slices):
                ids = [f"r{number}-{part}-{uuid.uuid4()}" for _ in range(per_slice)]
                await make(book, store, ids)
                await run(book, store, ids)
                present[clock.now] = ids
                made += len(ids)
                taken = {n.task_id for n in await drain_all(book)}
                if taken != set(ids):
                    result.problems.append(
                        f"round {number}: a drain took {len(taken):,} notifications, {len(ids):,} expected"
                    )
                clock.now += step_ms
                # The retention loop's next pass deletes the step that is now a retention old.
                cutoff = clock.now - RETAIN_S * 1000
                for at in [at for at in present if at <= cutoff]:
                    gone += present.pop(at)
                deleted = made - sum(map(len, present.values()))
                await until(
                    f"round {number}: the retention loop's deletes",
                    functools.partial(_deleted, gateway, url, cutoff, deleted),
                )
                if autovacuum is not None and each_step:
                    await autovacuum.settled(deleted)
            if autovacuum is not None:
                await autovacuum.settled(deleted)
            after = await sizes(url)
            live = [i for ids in present.values() for i in ids]
            took = time.monotonic() - started
            runs = {} if autovacuum is None else await autovacuum.runs()
            result.rounds.append(RoundResult(number, len(live), after, len(gone), took, runs))
            await check(result, book, url, f"round {number}", gone=gone, live=live)
            say(
                f"{backend} round {number}: {per_slice * slices:,} tasks made, {len(gone):,} deleted, "
                f"{len(live):,} within the retention; {after.total / 2**20:.2f} MiB ({after.detail}); "
                f"{took:.1f} s" + (f"; autovacuum's runs so far: {_runs(runs)}" if runs else "")
            )
        await held_until_drained(result, gateway, clock, url, made)
    if growth and result.growth > MAX_GROWTH:
        result.problems.append(
            f"{backend}: the size after round {rounds} is {result.growth:.2f}x the size after round 1 "
            f"(at most {MAX_GROWTH}x)"
        )
    return result


async def _deleted(gateway: Gateway, url: str, cutoff_ms: int, deleted: int) -> bool:
    """Whether no task finished by ``cutoff_ms`` is left, and the gateway counted ``deleted`` in all."""
    return await finished_by(url, cutoff_ms) == 0 and deleted_so_far(gateway) == deleted


async def drain_all(book: Book) -> list[Notification]:
    """Every notification not drained yet, batch after batch (a drain takes at most its limit)."""
    taken: list[Notification] = []
    while True:
        batch = await book.drain(notifications_body, limit=10_000)
        taken.extend(batch.taken)
        if not batch.more:
            return taken


async def held_until_drained(result: Result, gateway: Gateway, clock: Clock, url: str, made: int) -> None:
    """Tasks whose notification nobody took are kept past the retention, and counted; drained, they go.
    ``made``: the tasks made before, every one of them to be deleted."""
    book, retention = gateway.book, gateway.retention
    assert retention is not None
    held = [f"held-{uuid.uuid4()}" for _ in range(HELD)]
    await make(book, gateway.store, held)
    await run(book, gateway.store, held)
    clock.now += RETAIN_S * 1000 + 1  # every task is past the retention

    async def kept() -> bool:
        left = (await row_counts(url))["tasks"]
        return left == len(held) and retention.held == len(held) and deleted_so_far(gateway) == made

    await until("the tasks not drained kept, the others deleted", kept)
    await check(result, book, url, "not drained", gone=[], live=held)
    taken = sorted(n.task_id for n in await drain_all(book))
    if taken != sorted(held):
        result.problems.append(
            f"the drain after the retention took {len(taken)} of {len(held)} notifications"
        )

    async def gone() -> bool:
        left = (await row_counts(url))["tasks"]
        return left == 0 and retention.held == 0 and deleted_so_far(gateway) == made + len(held)

    await until("the drained tasks deleted", gone)
    await check(result, book, url, "drained", gone=held, live=[])


async def check(
    result: Result, book: Book, url: str, when: str, gone: Sequence[str], live: Sequence[str]
) -> None:
    """Every row of every table is one of the ``live`` tasks'; a sample of the ``gone`` is unknown."""
    counts = await row_counts(url)
    for table, rows in counts.items():
        if rows != ROWS[table] * len(live):
            result.problems.append(
                f"{when}: {table} has {rows:,} rows, {ROWS[table] * len(live):,} expected "
                "(those of the tasks within the retention)"
            )
    for task_id in live[:: max(1, len(live) // 100)]:
        await book.get(task_id)  # raises if it was deleted
    for task_id in gone[:: max(1, len(gone) // 200)]:
        try:
            await book.get(task_id)
        except UnknownTask:
            continue
        result.problems.append(f"{when}: {task_id}, past the retention, can still be read")


# --- the command -------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def database(backend: str, admin_url: str | None = None) -> AsyncIterator[str]:
    """A new, empty database for ``backend``: a SQLite file in a temporary directory; for PostgreSQL, a
    cluster of the bench's own with ``SERVER_SETTINGS`` (tests/support/pgcluster.py: initdb and pg_ctl,
    stopped and removed after), or, given ``admin_url``, a database made on that server and dropped after (its
    autovacuum as it is set there)."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="gw-retention-") as tmp:
            yield f"sqlite:///{Path(tmp) / 'gateway.db'}"
        return
    if admin_url is None:
        from tests.support.pgcluster import throwaway_postgres

        async with throwaway_postgres(SERVER_SETTINGS) as cluster:
            yield cluster.url
        return
    from bench.lib import harness

    async with harness.pg_database(admin_url, "gw_bench_retention") as url:
        yield url


def _runs(runs: dict[str, int]) -> str:
    return ", ".join(f"{table} {runs.get(table, 0)}" for table in TABLES)


def report(results: Sequence[Result]) -> str:
    lines = []
    for r in results:
        sizes_line = "  ".join(f"round {x.number}: {x.after.total / 2**20:8.2f} MiB" for x in r.rounds)
        lines.append(
            f"{r.backend:<10} after {sizes_line}  ->  {r.growth:.2f}x (at most {MAX_GROWTH}x); "
            f"{r.bytes_per_task:,.0f} bytes per finished task"
        )
        lines += [
            f"  round {x.number}: {x.tasks:,} tasks; {x.after.detail}"
            + (f"; autovacuum's runs so far: {_runs(x.autovacuums)}" if x.autovacuums else "")
            for x in r.rounds
        ]
        lines += [f"  note: {n}" for n in r.notes]
        lines += [f"  FAILED {p}" for p in r.problems]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> int:
    results = []
    for backend in args.backends.split(","):
        async with database(backend, args.pg_admin_url) as url:
            slices = SMOKE_SLICES if args.smoke else SLICES
            results.append(
                await churn(
                    url,
                    args.tasks,
                    args.rounds,
                    slices=slices,
                    growth=not args.smoke,
                    pass_s=SMOKE_PASS_S if args.smoke else None,
                    scale_factor=args.scale_factor,
                    each_step=args.autovacuum_each_step,
                )
            )
    print()
    print(report(results))
    return 1 if any(r.problems for r in results) else 0


def command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench retention", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--tasks", type=int, default=100_000, help="tasks in all, over the rounds")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--smoke", action="store_true", help="600 tasks; the sizes are not checked")
    parser.add_argument(
        "--pg-admin-url",
        help="run PostgreSQL's part on a database made on this server (autovacuum as it is set there), "
        "not on a cluster of the bench's own",
    )
    parser.add_argument(
        "--scale-factor",
        type=float,
        default=SCALE_FACTOR,
        help="each table's autovacuum_vacuum_scale_factor (default: the gateway's own, 0.02)",
    )
    parser.add_argument(
        "--autovacuum-each-step",
        action="store_true",
        help="wait for autovacuum to catch up after each step's deletes, before the next step's tasks (as "
        "a naptime far under the retention would), not only at each round's end",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.tasks = 600
    return asyncio.run(main_async(args))
