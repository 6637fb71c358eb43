"""Workload 15 of ``bench/suite.py``: streams (protocol.md, Streams), through the HTTP append and the reads,
on SQLite and on PostgreSQL, each figure beside its floor of the same run.

The floor is bench/programs/stream_floor.py: uvicorn + Starlette, a bare handler that inserts each batch as
one row on the gateway's driver with its durability (sqlite3, WAL and synchronous=FULL; asyncpg), one commit
per batch, and answers a read with a bare ``SELECT`` of the stream's rows and one send. The producers are
bench/programs/stream_client.py (a process of their own, one keep-alive connection per stream), the same
requests to both; every chunk is ``stream_client.CHUNK_BYTES`` (20) bytes and unique to its place.

1. Ingest: ``streams`` tasks of one stream each, every stream sent a batch of ``chunks`` chunks ``rate``
   times a second for ``seconds``: the batches taken of those asked (and the time it took: a server that
   falls behind is sent each batch once the previous one is answered), every stream's text read back
   (``GET .../text``) and compared with what was sent; the server's CPU (its CPU-time clock) per chunk
   taken, beside the floor's; rows and commits a second (the gateway's commits: its group-commit batches).
2. One stream as fast as one producer goes: batches of ``single_batch`` chunks appended one after the
   other (each sent once the previous one is answered, as a buffered producer whose buffer fills while its
   request is in flight) for ``single_seconds``: chunks a second taken.
3. Storage: once the ingest and the resume stream are in, bytes on disk per chunk after ``VACUUM``: the
   streams tables and their indexes (SQLite: their pages, from ``dbstat``; PostgreSQL:
   ``pg_total_relation_size``), divided by the chunks they hold, beside the chunk's own bytes (+ 8 B the
   target).
4. Resume read: a stream of ``resume_chunks`` chunks (appended in batches of ``chunks``) read from offset 0
   through the page reads (``GET .../streams/{name}?offset=N``, the default limit, following
   ``nextOffset``) until its last chunk, beside the floor's bare ``SELECT`` of its rows and one send: the
   median of ``resume_runs`` reads each, taken in turn.

    python -m bench streams [--smoke] [--only sqlite,postgresql]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib import harness
from bench.lib.report import Report, Row
from bench.programs.stream_client import CHUNK_BYTES, batch
from bench.workloads.fanout import metric

NUMBER = 15
STREAM = "output"
BACKENDS = ("sqlite", "postgresql")
NAMES = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}
TABLES = ("streams", "stream_batches")  # the gateway's
FLOOR_TABLES = ("batches",)
MAX_LIMIT = 10_000  # the most chunks a page read takes (protocol.md)
# The ingest sends no batch past this many times its length (a server far behind ends it there: its chunks
# taken say how far it got), and the resume stream's fill none past this.
INGEST_BOUND = 4
FILL_BOUND_S = 300.0


@dataclass(frozen=True)
class Sizes:
    streams: int
    rate: float  # batches a second per stream
    chunks: int  # chunks a batch
    seconds: float
    single_batch: int
    single_seconds: float
    resume_chunks: int
    resume_runs: int


FULL = Sizes(
    streams=100,
    rate=20.0,
    chunks=10,
    seconds=30.0,
    single_batch=10,
    single_seconds=10.0,
    resume_chunks=10_000,
    resume_runs=7,
)
SMOKE = Sizes(
    streams=5,
    rate=20.0,
    chunks=10,
    seconds=0.5,
    single_batch=10,
    single_seconds=0.3,
    resume_chunks=200,
    resume_runs=1,
)


# --- the servers -------------------------------------------------------------------------------------


@dataclass
class Side:
    """A server under test (the gateway, or the floor) and what is needed to read its database."""

    label: str  # "gateway" or "floor"
    backend: str
    port: int
    pid: int
    url: str  # its database: a SQLite file's path, or a PostgreSQL URL
    tables: tuple[str, ...]


@contextlib.asynccontextmanager
async def database(backend: str) -> AsyncIterator[str]:
    """A SQLite file's path in a directory of its own, or a PostgreSQL database made for the run."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="gw-bench-streams-") as tmp:
            yield str(Path(tmp) / "streams.db")
    else:
        async with harness.pg_database(harness.PG_ADMIN, "gw_bench_streams") as url:
            yield url


@contextlib.asynccontextmanager
async def gateway(backend: str) -> AsyncIterator[Side]:
    async with database(backend) as path:
        url = f"sqlite:///{path}" if backend == "sqlite" else path
        async with harness.gateway(url) as server:
            yield Side("gateway", backend, server.port, server.pid, path, TABLES)


@contextlib.asynccontextmanager
async def floor(backend: str) -> AsyncIterator[Side]:
    async with database(backend) as path:
        port = harness.free_port()
        process = await harness.spawn(harness.program("stream_floor", backend, path, str(port)))
        try:
            await harness.wait_port(port, process=process)
            yield Side("floor", backend, port, process.pid, path, FLOOR_TABLES)
        finally:
            await harness.stop(process)


# --- the producers -----------------------------------------------------------------------------------


def task_id(run: str, index: int) -> str:
    """A stream's task id: 16 bytes (it is in every row's key, so the storage figure depends on it)."""
    return f"s-{run}-{index:05d}"


TASK_ID_BYTES = len(task_id("0" * 8, 0))


async def producers(side: Side, count: int, first_index: int) -> list[dict[str, Any]]:
    """``count`` streams to append to, each on a task of its own (created and started on the gateway; the
    floor takes any task id and credential)."""
    run = uuid.uuid4().hex[:8]
    made = [
        {"task": task_id(run, first_index + k), "token": "none", "attempt": 1, "stream": STREAM}
        for k in range(count)
    ]
    for k, producer in enumerate(made):
        producer["index"] = first_index + k
    if side.label == "floor":
        return made
    import httpx

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{side.port}", timeout=60) as http:
        for producer in made:
            answer = await http.post(
                "/v1/tasks", json={"id": producer["task"], "ttlMs": 3_600_000, "maxAttempts": 1}
            )
            answer.raise_for_status()
            token = answer.json()["callbackToken"]
            started = await http.post(
                f"/v1/tasks/{producer['task']}/callbacks",
                json={"callbackId": f"{producer['task']}-start", "event": {"type": "start", "worker": "w"}},
                headers={"Authorization": f"Bearer {token}"},
            )
            started.raise_for_status()
            producer["token"] = token
            producer["attempt"] = started.json()["task"]["attempts"]
    return made


async def produce(
    side: Side, made: list[dict[str, Any]], *, chunks: int, rate: float, batches: int, seconds: float
) -> dict[str, Any]:
    """Run the producers (bench/programs/stream_client.py) against ``side``; their JSON line."""
    spec = {"producers": made, "chunks": chunks, "rate": rate, "batches": batches, "seconds": seconds}
    client = await harness.spawn(
        harness.program("stream_client", str(side.port), json.dumps(spec)), stdout=asyncio.subprocess.PIPE
    )
    try:
        out, _ = await asyncio.wait_for(client.communicate(), seconds + 60)
    finally:
        await harness.stop(client, 5)
    result: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return result


async def commits(side: Side) -> float:
    """The gateway's group-commit batches so far (the floor commits once per batch: nan here)."""
    if side.label != "gateway":
        return float("nan")
    reader, writer = await asyncio.open_connection("127.0.0.1", side.port)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, body = await read_answer(reader)
    finally:
        writer.close()
    return metric(body.decode(), "gateway_callback_batches") if status == 200 else float("nan")


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    return int(head[9:12]), await reader.readexactly(length)


async def get(side: Side, path: str, token: str = "none") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", side.port)
    try:
        writer.write(
            f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\r\n".encode()
        )
        return await read_answer(reader)
    finally:
        writer.close()


# --- 1. ingest ---------------------------------------------------------------------------------------


async def ingest(side: Side, sizes: Sizes) -> dict[str, Any]:
    made = await producers(side, sizes.streams, 0)
    batches = round(sizes.rate * sizes.seconds)
    commits_before, cpu_before = await commits(side), harness.cpu_seconds(side.pid)
    bound = sizes.seconds * INGEST_BOUND
    result = await produce(side, made, chunks=sizes.chunks, rate=sizes.rate, batches=batches, seconds=bound)
    cpu = harness.cpu_seconds(side.pid) - cpu_before
    result["commits"] = await commits(side) - commits_before
    taken = sum(result["taken"].values())
    result["taken_batches"] = taken
    result["taken_chunks"] = taken * sizes.chunks
    result["cpu_us_per_chunk"] = cpu / max(1, result["taken_chunks"]) * 1e6
    result["rows_per_s"] = taken / result["elapsed"]
    result["commits_per_s"] = result["commits"] / result["elapsed"]
    result["chunks_per_s"] = result["taken_chunks"] / result["elapsed"]
    if side.label == "gateway":
        result["wrong"] = await read_back(side, made, result["taken"], sizes.chunks)
    return result


async def read_back(side: Side, made: list[dict[str, Any]], taken: dict[str, int], chunks: int) -> list[str]:
    """The streams whose text, read back, is not what was taken (each a line saying how)."""
    wrong = []
    import httpx

    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{side.port}", timeout=60) as http:
        for producer in made:
            task = producer["task"]
            expected = "".join(
                "".join(batch(producer["index"], seq, chunks)) for seq in range(taken.get(task, 0))
            )
            answer = await http.get(f"/v1/tasks/{task}/streams/{STREAM}/text")
            if answer.status_code != 200 or answer.text != expected:
                wrong.append(
                    f"{task}: read back {answer.status_code}, {len(answer.text):,} characters, "
                    f"{len(expected):,} taken; equal: {answer.text == expected}"
                )
    return wrong


# --- 2. one stream -----------------------------------------------------------------------------------


async def single(side: Side, sizes: Sizes) -> dict[str, Any]:
    made = await producers(side, 1, 10_000)
    result = await produce(
        side, made, chunks=sizes.single_batch, rate=0, batches=0, seconds=sizes.single_seconds
    )
    result["chunks_per_s"] = sum(result["taken"].values()) * sizes.single_batch / result["elapsed"]
    return result


# --- 4. resume read ----------------------------------------------------------------------------------


async def resume_stream(side: Side, sizes: Sizes) -> dict[str, Any]:
    """A stream of ``resume_chunks`` chunks, in batches of ``chunks``."""
    made = await producers(side, 1, 20_000)
    batches = sizes.resume_chunks // sizes.chunks
    result = await produce(side, made, chunks=sizes.chunks, rate=0, batches=batches, seconds=FILL_BOUND_S)
    if sum(result["taken"].values()) != batches or result["errors"]:
        raise RuntimeError(f"the resume stream was not all taken: {result}")
    return made[0]


async def read_from_zero(
    side: Side, task: str, total: int, limit: int | None = None
) -> tuple[float, int, int]:
    """Read the stream from offset 0 to its last chunk, on one keep-alive connection: the gateway page by
    page (``limit`` chunks a page, or its default), the floor in one answer. The seconds, the chunks read,
    the requests."""
    reader, writer = await asyncio.open_connection("127.0.0.1", side.port)
    try:
        started = time.perf_counter()
        offset, got, requests = 0, 0, 0
        while got < total:
            path = f"/v1/tasks/{task}/streams/{STREAM}"
            if side.label == "gateway":
                path += f"?offset={offset}" + (f"&limit={limit}" if limit else "")
            writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            status, body = await read_answer(reader)
            requests += 1
            if status != 200:
                raise RuntimeError(f"{side.label}: GET {path} answered {status}: {body[:200]!r}")
            page = json.loads(body)
            got += len(page["chunks"])
            offset = page["nextOffset"]
            if not page["chunks"]:
                break
        return time.perf_counter() - started, got, requests
    finally:
        writer.close()


# --- 3. storage --------------------------------------------------------------------------------------


async def storage(side: Side) -> tuple[int, int, str]:
    """The bytes on disk of ``side``'s stream tables and their indexes after VACUUM, the chunks they hold,
    and the bytes by relation (a line)."""
    if side.backend == "sqlite":
        db = sqlite3.connect(side.url, isolation_level=None, timeout=30)
        try:
            db.execute("VACUUM")
            marks = ", ".join("?" * len(side.tables))
            # Each table's pages and its indexes' (a WITHOUT ROWID table is its key's tree).
            parts = db.execute(
                "SELECT name, sum(pgsize) FROM dbstat WHERE name IN "
                f"(SELECT name FROM sqlite_schema WHERE tbl_name IN ({marks})) GROUP BY name ORDER BY name",
                side.tables,
            ).fetchall()
            rows = db.execute(f"SELECT chunks FROM {side.tables[-1]}").fetchall()
        finally:
            db.close()
    else:
        import asyncpg  # type: ignore[import-untyped]  # no stubs, no py.typed (as gateway/store/database.py)

        conn = await asyncpg.connect(side.url, timeout=10)
        try:
            parts = []
            for table in side.tables:
                await conn.execute(f"VACUUM {table}")
                total, heap, indexes = await conn.fetchrow(
                    "SELECT pg_total_relation_size($1), pg_relation_size($1), pg_indexes_size($1)", table
                )
                parts += [(f"{table} (heap)", heap), (f"{table} (indexes)", indexes)]
                parts.append(
                    (f"{table} (the rest: TOAST, free space and visibility maps)", total - heap - indexes)
                )
            rows = await conn.fetch(f"SELECT chunks FROM {side.tables[-1]}")
        finally:
            await conn.close()
    chunks = sum(len(json.loads(bytes(row[0]))) for row in rows)
    size = sum(int(part) for _, part in parts)
    return size, chunks, ", ".join(f"{name} {int(part):,} B" for name, part in parts)


# --- a side's run, and the workload --------------------------------------------------------------------


async def run_side(side: Side, sizes: Sizes) -> dict[str, Any]:
    result: dict[str, Any] = {"ingest": await ingest(side, sizes)}
    resume = await resume_stream(side, sizes)
    result["storage"] = await storage(side)
    # In turn: the pages of the default limit, and pages of the most a read takes (the floor: one answer).
    times: dict[int | None, list[float]] = {None: [], MAX_LIMIT: []}
    for _ in range(sizes.resume_runs):
        for limit, taken in times.items():
            seconds, got, requests = await read_from_zero(side, resume["task"], sizes.resume_chunks, limit)
            if got != sizes.resume_chunks:
                raise RuntimeError(f"{side.label}: read {got} chunks of {sizes.resume_chunks} from offset 0")
            taken.append(seconds)
            result[f"resume_requests_{limit}"] = requests
    result["resume_s"] = statistics.median(times[None])
    result["resume_max_s"] = statistics.median(times[MAX_LIMIT])
    result["single"] = await single(side, sizes)
    return result


async def measure(backend: str, sizes: Sizes) -> tuple[dict[str, Any], dict[str, Any]]:
    async with gateway(backend) as side, harness.profiled(side.pid, f"streams-gateway-{backend}"):
        gw = await run_side(side, sizes)
    async with floor(backend) as side:
        fl = await run_side(side, sizes)
    return gw, fl


def add_rows(backend: str, sizes: Sizes, gw: dict[str, Any], fl: dict[str, Any], report: Report) -> None:
    name = NAMES[backend]
    g, f = gw["ingest"], fl["ingest"]
    asked = sizes.streams * round(sizes.rate * sizes.seconds)
    shape = f"{sizes.streams} streams x {sizes.rate:g} batches/s x {sizes.chunks} chunks of {CHUNK_BYTES} B"
    g_bytes, g_chunks, g_parts = gw["storage"]
    f_bytes, f_chunks, f_parts = fl["storage"]
    ingest = f"streams ingest, {name}"
    resume = f"resume read of {sizes.resume_chunks:,} chunks from offset 0, {name}: until the last chunk"
    report.rows += [
        Row(
            NUMBER,
            f"{ingest}: chunks taken of {asked * sizes.chunks:,} asked ({shape}, {sizes.seconds:g} s)",
            g["taken_chunks"],
            f["taken_chunks"],
            "",
            "all",
            0,
        ),
        Row(
            NUMBER,
            f"{ingest}: chunks/s taken of {sizes.streams * sizes.rate * sizes.chunks:,.0f}/s asked",
            g["chunks_per_s"],
            f["chunks_per_s"],
            "/s",
            "as asked",
            0,
        ),
        Row(
            NUMBER,
            f"{ingest}: server CPU per chunk (floor: bare-driver handler, a row and a commit per batch)",
            g["cpu_us_per_chunk"],
            f["cpu_us_per_chunk"],
            "us",
            "<= 1.3x",
            1,
        ),
        Row(NUMBER, f"{ingest}: rows/s", g["rows_per_s"], f["rows_per_s"], "/s", "", 0),
        Row(
            NUMBER,
            f"{ingest}: commits/s (floor: one per row)",
            g["commits_per_s"],
            f["rows_per_s"],
            "/s",
            "",
            0,
        ),
        Row(
            NUMBER,
            f"one stream as fast as one producer goes, {name}: chunks/s taken (batches of "
            f"{sizes.single_batch}, each sent once the previous one is answered)",
            gw["single"]["chunks_per_s"],
            fl["single"]["chunks_per_s"],
            "/s",
            ">= 3,000/s",
            0,
        ),
        Row(
            NUMBER,
            f"streams storage, {name}: bytes on disk per chunk after VACUUM, {sizes.chunks} chunks a batch "
            "(floor: the chunk's bytes)",
            g_bytes / max(1, g_chunks),
            float(CHUNK_BYTES),
            "B",
            f"<= {CHUNK_BYTES + 8} B (chunk + 8 B)",
            1,
        ),
        Row(
            NUMBER,
            f"{resume}, pages of the default limit (floor: a bare SELECT of its rows and one send)",
            gw["resume_s"] * 1e3,
            fl["resume_s"] * 1e3,
            "ms",
            "<= 2x",
            1,
        ),
        Row(
            NUMBER,
            f"{resume}, pages of {MAX_LIMIT:,} (floor: the same)",
            gw["resume_max_s"] * 1e3,
            fl["resume_s"] * 1e3,
            "ms",
            "<= 2x",
            1,
        ),
    ]
    for label, value in (
        ("ingest CPU per chunk gateway", g["cpu_us_per_chunk"]),
        ("ingest CPU per chunk floor", f["cpu_us_per_chunk"]),
        ("one stream chunks/s gateway", gw["single"]["chunks_per_s"]),
        ("one stream chunks/s floor", fl["single"]["chunks_per_s"]),
        ("storage per chunk gateway", g_bytes / max(1, g_chunks)),
        ("resume gateway", gw["resume_s"]),
        ("resume floor", fl["resume_s"]),
    ):
        report.figure(f"streams {name} {label}", value)
    for label, result in (("gateway", g), ("floor", f)):
        # A batch not taken is one refused (an answer other than 200 ends its producer), or one not sent
        # within the run's bound by a server far behind; the gateway must take them all.
        short = label == "gateway" and result["taken_batches"] < result["asked"]
        if short or result["errors"] or result["misplaced"]:
            report.problems.append(
                f"{ingest} {label}: {result['asked'] - result['taken_batches']} batches of {result['asked']} "
                f"not taken, answers other than 200: {result['errors']}, {result['misplaced']} at another "
                "offset than the stream's next"
            )
    for line in g.get("wrong", []):
        report.problems.append(f"{ingest}: read back differs: {line}")
    for label, result in (("gateway", gw["single"]), ("floor", fl["single"])):
        if result["errors"] or result["misplaced"]:
            report.problems.append(
                f"one stream {name} {label}: answers other than 200: {result['errors']}, "
                f"{result['misplaced']} at another offset than the stream's next"
            )
    report.details.append(
        f"streams {name}: ingest of {sizes.seconds:g} s of batches took {g['elapsed']:.1f} s (floor "
        f"{f['elapsed']:.1f} s; a producer that falls behind sends each batch once the previous one is "
        f"answered, and none past {INGEST_BOUND}x the run's length), {g['retries']} batches sent again "
        f"after 503/429 (floor {f['retries']}); the gateway's mean group commit "
        f"{g['taken_batches'] / max(1, g['commits']):.1f} batches; every stream's text read back equal "
        f"to what was taken: {not g.get('wrong')} | one stream: "
        f"{sum(gw['single']['taken'].values()):,} batches in {gw['single']['elapsed']:.1f} s (floor "
        f"{sum(fl['single']['taken'].values()):,}) | storage (task ids of {TASK_ID_BYTES} B): gateway "
        f"{g_bytes:,} B for {g_chunks:,} chunks ({g_parts}); floor (a row per batch: task, stream, offset, "
        f"attempt, seq, the chunks' JSON array) {f_bytes / max(1, f_chunks):.1f} B per chunk ({f_parts}) | "
        f"resume: the gateway in {gw['resume_requests_None']} page reads of the default limit, or "
        f"{gw['resume_requests_10000']} of {MAX_LIMIT:,}, medians of {sizes.resume_runs} reads of each"
    )


async def workload(cfg: Any, servers: Any, report: Report) -> None:
    sizes: Sizes = cfg.streams
    for backend in BACKENDS:
        gw, fl = await measure(backend, sizes)
        add_rows(backend, sizes, gw, fl, report)


async def main(args: argparse.Namespace) -> None:
    from bench.lib.report import table

    sizes = SMOKE if args.smoke else FULL
    report = Report()
    for backend in args.only.split(","):
        gw, fl = await measure(backend, sizes)
        add_rows(backend, sizes, gw, fl, report)
    print(table(report.rows, markdown=False))
    for detail in report.details:
        print(f"- {detail}")
    for problem in report.problems:
        print(f"CHECK {problem}")


def command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench streams", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--only", default=",".join(BACKENDS))
    return harness.run_to_the_end(main(parser.parse_args(argv)))
