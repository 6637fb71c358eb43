"""The ceiling of one PostgreSQL here: callbacks/s at saturation with the gateway's group commit, and where
the CPU goes, beside pgbench writing the same shape of transaction at the same client count.

    python -m bench pg_ceiling [--smoke]

Everything runs on a PostgreSQL cluster of the bench's own (tests/support/pgcluster.py: initdb and pg_ctl on a
free loopback port, removed after), never the shared server: its WAL position and its processes' CPU are then
this run's alone, and ``pg_stat_statements`` can be loaded (``shared_preload_libraries``, which the shared
server does not set and whose settings are not ours to change). Its other settings are the shared
server's (PostgreSQL's defaults, ``autovacuum = off``), with room for the clients (``max_connections``).

For each number of gateway processes (``gateway serve --workers W``) and each number of keep-alive callback
connections C (bench/programs/callback_client.py: each connection drives tasks of its own through start and
progress 1..100, every callback a real change), for ``seconds``, then pgbench at C clients for as long on a
database of its own in the same cluster, one transaction per callback of the shape the issue names (one
``UPDATE`` of the client's task row, one ``INSERT`` of its entry, ``COMMIT``): the database's own ceiling
for that write. The two alternate, ``repeats`` times; figures are medians. The connections are raised
until callbacks/s stop rising (by ``RISE``); the best median is the saturation. Read around each measurement:

- CPU (from /proc, ``utime + stime``, reaped children included): the cluster's processes (the postmaster's
  tree), the gateway's (its tree), the client's (this process's reaped children);
- ``pg_current_wal_lsn`` (WAL bytes), ``pg_stat_wal`` (WAL flushes), ``pg_stat_database`` (commits, rows);
- ``pg_stat_statements``: calls and execution time per statement, and the gateway's ``COMMIT`` statements
  (its write transactions: one per batch of callbacks; pgbench commits once per transaction).

Checked: every callback acknowledged (``200``) has its callback id in the database (nothing acknowledged is
lost), and no answer other than ``200``. There is no subscriber here, hence no frame to lose.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import resource
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lib import harness
from bench.lib.report import Report, Row
from bench.workloads import callbacks

# The cluster's settings: the shared server's (autovacuum off), pg_stat_statements loaded, and connections
# for pgbench's clients beside the gateway's pools (20 per process, 3 for its sweeper, 1 listening).
SERVER_SETTINGS = {
    "autovacuum": "off",
    "shared_preload_libraries": "pg_stat_statements",
    "max_connections": "400",
    "pg_stat_statements.track_utility": "on",
}
# A step whose callbacks/s is under this times the best before it ends the raising of connections.
RISE = 1.05
# The database both write to (the cluster's own: a CREATE DATABASE would cost its template's copy in WAL
# and in the checkpoint at the end); pgbench's tables are in a schema of their own.
DATABASE = "postgres"
# The bench's own readings, left out of the statements' list.
OWN_STATEMENTS = ("pg_stat_statements_reset", "pg_current_wal_lsn", "pg_stat_wal", "pg_stat_database")
# One callback as pgbench writes it: the task row's update, the entry's insert, the commit.
PGBENCH_SCRIPT = """BEGIN;
UPDATE floor.tasks SET state = 'running', progress = progress + 1, version = version + 1 WHERE id = :client_id
  RETURNING version \\gset
INSERT INTO floor.entries VALUES (:client_id, :version, '{ENTRY}');
END;
"""
# About the size of a progress entry the gateway stores (its event's JSON).
ENTRY = '{"type":"progress","progress":42,"cursor":"c","atMs":1764646387000,"message":"x"}'


@dataclass(frozen=True)
class Sizes:
    workers: tuple[int, ...]  # gateway processes (``--workers``)
    connections: tuple[int, ...]  # keep-alive callback connections, and pgbench's clients, raised in turn
    seconds: float  # per measurement
    repeats: int  # gateway and pgbench alternate this many times at each step
    # Backends send their statistics (pg_stat_database, pg_stat_wal) at most once a second, when idle: they
    # are read that long after the load stopped (which the next load's first reading follows). Not the
    # figures': CPU and WAL are read at once.
    settle_s: float


FULL = Sizes(workers=(1, 2), connections=(16, 64, 256), seconds=3.0, repeats=3, settle_s=1.1)
SMOKE = Sizes(workers=(1,), connections=(8,), seconds=0.5, repeats=1, settle_s=0.0)


# --- readings -------------------------------------------------------------------------------------------


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid`` and every descendant, those ended and reaped included (their time is
    in their parent's cutime and cstime): the difference of two readings is what the tree used between."""
    try:
        fields = _stat(pid)
        ticks = sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime, stime, cutime, cstime
        children = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError):
                children += [int(c) for c in (task / "children").read_text().split()]
    except OSError:  # gone meanwhile
        return 0.0
    return ticks / harness.TICKS + sum(tree_cpu_s(c) for c in children)


def lsn_bytes(lsn: str) -> int:
    """A WAL position (``16/B374D848``) as bytes from the start."""
    high, low = lsn.split("/")
    return (int(high, 16) << 32) + int(low, 16)


def reaped_children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Reading:
    at: float
    postgres_s: float
    gateway_s: float
    client_s: float
    wal_lsn: str
    wal_syncs: int
    xact_commit: int
    rows: int  # inserted + updated + deleted


@dataclass
class Step:
    """One measurement: what it did and what was read around it."""

    kind: str  # "gateway" or "pgbench"
    workers: int
    connections: int
    per_s: float
    done: int  # callbacks acknowledged, or pgbench transactions
    errors: dict[str, int]
    seconds: float
    postgres_s: float
    gateway_s: float
    client_s: float
    wal_bytes: float
    wal_syncs: int
    xact_commits: int
    rows: int
    write_commits: int  # COMMIT statements (pg_stat_statements)
    statements: list[tuple[str, int, float]] = field(default_factory=list)  # (query, calls, ms in total)

    def per(self, value: float) -> float:
        return value / self.done if self.done else float("nan")


class Cluster:
    """The bench's own cluster, read from outside: its processes' CPU, its WAL, its statistics."""

    def __init__(self, cluster: Any, admin: Any) -> None:
        self.cluster = cluster
        self.admin = admin
        self.postmaster = int((cluster.data / "postmaster.pid").read_text().split()[0])

    def url(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.cluster.port}/{database}"

    async def reading(self, database: str, gateway_pid: int | None) -> Reading:
        lsn = await self.admin.fetchval("SELECT pg_current_wal_lsn()::text")
        syncs = await self.admin.fetchval("SELECT wal_sync FROM pg_stat_wal")
        row = await self.admin.fetchrow(
            "SELECT xact_commit, tup_inserted + tup_updated + tup_deleted AS rows FROM pg_stat_database "
            "WHERE datname = $1",
            database,
        )
        return Reading(
            time.monotonic(),
            tree_cpu_s(self.postmaster),
            tree_cpu_s(gateway_pid) if gateway_pid else 0.0,
            reaped_children_cpu_s(),
            lsn,
            int(syncs),
            int(row["xact_commit"]),
            int(row["rows"]),
        )

    async def statements(self, database: str) -> tuple[int, list[tuple[str, int, float]]]:
        """The COMMIT statements since the last reset, and the statements that took the most time."""
        rows = await self.admin.fetch(
            "SELECT query, calls, total_exec_time FROM pg_stat_statements s JOIN pg_database d "
            "ON d.oid = s.dbid WHERE d.datname = $1 ORDER BY total_exec_time DESC",
            database,
        )
        commits = sum(r["calls"] for r in rows if r["query"].strip().upper() == "COMMIT")
        rows = [r for r in rows if not any(mine in r["query"] for mine in OWN_STATEMENTS)]
        top = [
            (" ".join(r["query"].split())[:70], int(r["calls"]), float(r["total_exec_time"])) for r in rows
        ]
        return commits, top[:5]

    async def measure(
        self, kind: str, workers: int, connections: int, gateway_pid: int | None, run: Any, settle_s: float
    ) -> Step:
        """``run()`` (the load; answers per_s, done, errors) with the readings around it."""
        database = DATABASE
        await self.admin.execute("SELECT pg_stat_statements_reset()")
        before = await self.reading(database, gateway_pid)
        per_s, done, errors = await run()
        after_load = (time.monotonic(), tree_cpu_s(self.postmaster), reaped_children_cpu_s())
        gateway_after = tree_cpu_s(gateway_pid) if gateway_pid else 0.0
        await asyncio.sleep(settle_s)
        after = await self.reading(database, gateway_pid)
        commits, top = await self.statements(database)
        if kind == "pgbench":  # a transaction each (its END, prepared, is counted once per client)
            commits = done
        wal = lsn_bytes(after.wal_lsn) - lsn_bytes(before.wal_lsn)
        return Step(
            kind,
            workers,
            connections,
            per_s,
            done,
            errors,
            after_load[0] - before.at,
            after_load[1] - before.postgres_s,
            gateway_after - before.gateway_s,
            after_load[2] - before.client_s,
            float(wal),
            after.wal_syncs - before.wal_syncs,
            after.xact_commit - before.xact_commit,
            after.rows - before.rows,
            commits,
            top,
        )


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[Cluster]:
    import asyncpg  # type: ignore[import-untyped]  # no stubs, no py.typed (as in gateway/store/database.py)

    from tests.support.pgcluster import throwaway_postgres

    async with throwaway_postgres(SERVER_SETTINGS) as made:
        admin = await asyncpg.connect(made.url, timeout=10)
        try:
            await admin.execute("CREATE EXTENSION pg_stat_statements")
            yield Cluster(made, admin)
        finally:
            await admin.close()


# --- the loads ------------------------------------------------------------------------------------------


async def callbacks_load(port: int, connections: int, seconds: float) -> tuple[float, int, dict[str, int]]:
    args = argparse.Namespace(seconds=seconds, connections=connections)
    result = await callbacks.measure(port, args)
    return result["per_s"], int(result["done"]), {str(k): v for k, v in result.get("errors", {}).items()}


async def prepare_floor(url: str, clients: int, folder: Path) -> Path:
    """pgbench's tables (a task row per client, and the entries) and its script, in ``folder``."""
    import asyncpg

    conn = await asyncpg.connect(url, timeout=10)
    try:
        await conn.execute(
            "CREATE SCHEMA floor;"
            "CREATE TABLE floor.tasks (id text PRIMARY KEY, state text, progress bigint, version bigint);"
            "CREATE TABLE floor.entries (task_id text, version bigint, event bytea,"
            " PRIMARY KEY (task_id, version))"
        )
        await conn.execute(
            "INSERT INTO floor.tasks SELECT g::text, 'queued', 0, 0 FROM generate_series(0, $1) AS g", clients
        )
    finally:
        await conn.close()
    script = folder / "callback.sql"
    script.write_text(PGBENCH_SCRIPT.replace("{ENTRY}", ENTRY))
    return script


async def pgbench_load(
    cluster: Cluster, script: Path, clients: int, seconds: float
) -> tuple[float, int, dict[str, int]]:
    """pgbench at ``clients`` for ``seconds`` of transactions: its run is longer by the time its clients take
    to connect (pgbench counts it in ``-T``; about a second per 100 on a busy machine), and its tps leaves
    that time out. Its CPU figures include its connections' start."""
    duration = max(1, round(seconds)) + clients // 64
    command = ["pgbench", "-n", "-M", "prepared", "-f", str(script), "-c", str(clients), "-j", "1"]
    command += ["-T", str(duration), "-h", "127.0.0.1", "-p", str(cluster.cluster.port)]
    process = await harness.spawn(
        [*command, "-U", "postgres", DATABASE], stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), duration + 60)
    text = out.decode()
    tps = re.search(r"tps = ([\d.]+) \(without initial connection time\)", text)
    done = re.search(r"number of transactions actually processed: (\d+)", text)
    failed = re.search(r"number of failed transactions: (\d+)", text)
    if process.returncode != 0 or tps is None or done is None or not int(done.group(1)):
        tail = " | ".join((text + err.decode()).strip().splitlines()[-4:])
        return 0.0, 0, {f"pgbench measured nothing (exit {process.returncode}): {tail}"[:300]: 1}
    errors = {"failed": int(failed.group(1))} if failed and int(failed.group(1)) else {}
    return float(tps.group(1)), int(done.group(1)), errors


# --- the workload ---------------------------------------------------------------------------------------


def median_step(steps: list[Step]) -> Step:
    """The step of median callbacks/s (its readings kept together)."""
    ordered = sorted(steps, key=lambda s: s.per_s)
    return ordered[(len(ordered) - 1) // 2]


async def measure_all(sizes: Sizes, say: Any = print) -> dict[str, Any]:
    """For each number of processes, the connections raised step by step until callbacks/s stop rising
    (a step's median under ``RISE`` times the best so far), each step ``repeats`` gateway runs alternating
    with as many pgbench runs; the medians, and what was checked."""
    runs: dict[tuple[str, int, int], list[Step]] = {}
    problems: list[str] = []
    acknowledged = stored = 0
    async with cluster() as pg:
        script = await prepare_floor(pg.url(DATABASE), max(sizes.connections), pg.cluster.base)
        gateway_url = pg.url(DATABASE)
        for workers in sizes.workers:
            env = {"GATEWAY_WORKERS": str(workers)}
            async with harness.gateway(gateway_url, env=env) as server:
                best = 0.0
                for connections in sizes.connections:

                    async def gateway_run(c: int = connections) -> tuple[float, int, dict[str, int]]:
                        return await callbacks_load(server.port, c, sizes.seconds)

                    async def floor_run(c: int = connections) -> tuple[float, int, dict[str, int]]:
                        return await pgbench_load(pg, script, c, sizes.seconds)

                    for repeat in range(sizes.repeats):
                        step = await pg.measure(
                            "gateway", workers, connections, server.pid, gateway_run, sizes.settle_s
                        )
                        acknowledged += step.done
                        runs.setdefault(("gateway", workers, connections), []).append(step)
                        floor = await pg.measure("pgbench", 0, connections, None, floor_run, sizes.settle_s)
                        runs.setdefault(("pgbench", workers, connections), []).append(floor)
                        say(
                            f"  {workers} process(es), {connections} connections, run {repeat + 1}: gateway "
                            f"{step.per_s:,.0f} callbacks/s, pgbench {floor.per_s:,.0f} tps"
                        )
                        for s in (step, floor):
                            if s.errors:
                                problems.append(f"{s.kind} at {connections} connections: errors {s.errors}")
                    median = median_step(runs[("gateway", workers, connections)]).per_s
                    if median < best * RISE:
                        break  # saturated: more connections did not raise callbacks/s
                    best = max(best, median)
        import asyncpg

        conn = await asyncpg.connect(gateway_url, timeout=10)
        try:
            stored = int(await conn.fetchval("SELECT count(*) FROM callbacks"))
        finally:
            await conn.close()
    if stored < acknowledged:
        problems.append(f"{acknowledged:,} callbacks acknowledged, {stored:,} callback ids in the database")
    medians = {key: median_step(steps) for key, steps in runs.items()}
    return {"medians": medians, "problems": problems, "acknowledged": acknowledged, "stored": stored}


def cpu_line(step: Step) -> str:
    """Where the CPU went in a step: per callback (or transaction), and as a share of the machine."""
    capacity = step.seconds * (os.cpu_count() or 1)
    parts = [("PostgreSQL", step.postgres_s), ("gateway", step.gateway_s), ("client", step.client_s)]
    return ", ".join(
        f"{name} {step.per(cpu) * 1e6:,.0f} us ({cpu / capacity:.0%} of the cores)"
        for name, cpu in parts
        if name != "gateway" or step.kind == "gateway"
    )


def db_line(step: Step) -> str:
    commits = step.write_commits
    return (
        f"{step.per(step.wal_bytes):,.0f} WAL bytes and {step.per(step.wal_syncs):.2f} WAL flushes per "
        f"{'callback' if step.kind == 'gateway' else 'transaction'}, {step.xact_commits / step.seconds:,.0f} "
        f"commits/s in pg_stat_database (reads included), {commits / step.seconds:,.0f} write commits/s "
        f"(COMMIT statements), {step.done / commits if commits else float('nan'):.1f} "
        f"{'callbacks' if step.kind == 'gateway' else 'transactions'} and "
        f"{step.rows / commits if commits else float('nan'):.1f} rows per write commit"
    )


async def workload(cfg: Any, servers: Any, report: Report, say: Any = lambda line: None) -> None:
    """Workload 14 of bench/suite.py: sizes from ``cfg.pg_ceiling``; starts its own cluster and gateways."""
    sizes: Sizes = cfg.pg_ceiling
    result = await measure_all(sizes, say=say)
    medians: dict[tuple[str, int, int], Step] = result["medians"]
    gateway_steps = [step for (kind, _, _), step in medians.items() if kind == "gateway"]
    best = max(gateway_steps, key=lambda s: s.per_s)
    floor = medians[("pgbench", best.workers, best.connections)]
    where = f"{best.workers} process{'es' if best.workers > 1 else ''}, {best.connections} connections"
    report.rows.append(
        Row(
            14,
            f"one PostgreSQL: callbacks/s at saturation, {where} (floor: pgbench, UPDATE + INSERT, "
            f"{best.connections} clients)",
            best.per_s,
            floor.per_s,
            "/s",
            "(ceiling)",
            0,
        )
    )
    report.rows.append(
        Row(
            14,
            "one PostgreSQL: its CPU per callback at saturation (floor: per pgbench transaction)",
            best.per(best.postgres_s) * 1e6,
            floor.per(floor.postgres_s) * 1e6,
            "us",
            "(where the CPU goes)",
            0,
        )
    )
    report.rows.append(
        Row(
            14,
            "one PostgreSQL: WAL bytes per callback at saturation (floor: per pgbench transaction)",
            best.per(best.wal_bytes),
            floor.per(floor.wal_bytes),
            "B",
            "",
            0,
        )
    )
    report.figure("pg ceiling callbacks/s", best.per_s)
    report.figure("pg ceiling pgbench tps", floor.per_s)
    report.figure("pg ceiling PostgreSQL CPU per callback", best.per(best.postgres_s))
    report.figure("pg ceiling WAL bytes per callback", best.per(best.wal_bytes))
    report.problems.extend(f"pg ceiling: {p}" for p in result["problems"])
    postgres_us = best.per(best.postgres_s) * 1e6
    cores = os.cpu_count() or 1
    steps = "; ".join(
        f"{w} x {c}: {medians[('gateway', w, c)].per_s:,.0f}/s "
        f"(pgbench {medians[('pgbench', w, c)].per_s:,.0f})"
        for w in sizes.workers
        for c in sizes.connections
        if ("gateway", w, c) in medians
    )
    report.details.append(
        f"past one PostgreSQL: a cluster of the bench's own (autovacuum off as the shared server's, "
        f"pg_stat_statements loaded), gateway processes x callback connections (raised until callbacks/s "
        f"rose less than {RISE - 1:.0%}), median of {sizes.repeats} runs of {sizes.seconds:g} s each, "
        f"alternating with pgbench at as many clients: {steps}. "
        f"{result['acknowledged']:,} callbacks acknowledged, {result['stored']:,} callback ids stored "
        f"(nothing acknowledged lost); no subscriber, so no frame to lose"
    )
    floors = [step for (kind, _, _), step in medians.items() if kind == "pgbench"]
    top_floor = max(floors, key=lambda s: s.per_s)
    report.details.append(
        f"past one PostgreSQL at saturation ({where}): CPU per callback {cpu_line(best)}; {db_line(best)}. "
        f"pgbench's best median: {top_floor.per_s:,.0f} tps at {top_floor.connections} clients (it opens a "
        f"connection per client, the gateway at most 20 per process). "
        f"pgbench at {best.connections} clients: CPU per transaction {cpu_line(floor)}; {db_line(floor)}. "
        f"On paper, PostgreSQL alone on these {cores} cores at {postgres_us:,.0f} us per callback: "
        f"{cores * 1e6 / postgres_us if postgres_us else float('nan'):,.0f} callbacks/s"
    )
    top = "; ".join(f"{q} ({calls:,} calls, {ms:,.0f} ms)" for q, calls, ms in best.statements)
    report.details.append(f"past one PostgreSQL, pg_stat_statements at saturation, by time: {top}")


async def main(args: argparse.Namespace) -> None:
    sizes = SMOKE if args.smoke else FULL
    if args.repeats or args.seconds or args.connections:
        sizes = Sizes(
            workers=tuple(int(w) for w in args.workers.split(",")) if args.workers else sizes.workers,
            connections=tuple(int(c) for c in args.connections.split(","))
            if args.connections
            else sizes.connections,
            seconds=args.seconds or sizes.seconds,
            repeats=args.repeats or sizes.repeats,
            settle_s=sizes.settle_s,
        )
    report = Report()
    await workload(argparse.Namespace(pg_ceiling=sizes), None, report, say=print)
    from bench.lib.report import table

    print(table(report.rows, markdown=False))
    for line in report.details + [f"CHECK {p}" for p in report.problems]:
        print(f"- {line}")


def command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench pg_ceiling", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--workers", default="", help="gateway processes per step, e.g. 1,2")
    parser.add_argument("--connections", default="", help="callback connections per step, e.g. 8,32,128")
    parser.add_argument("--seconds", type=float, default=0.0)
    parser.add_argument("--repeats", type=int, default=0)
    return harness.run_to_the_end(main(parser.parse_args(argv)))
