"""The report of a benchmark run: rows of figures beside their floors, the smoke checks, and
docs/benchmarks.md, apart from the workloads that make them (``bench/suite.py``)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.lib import harness, needs
from bench.lib.needs import Need

DOCS = harness.ROOT / "docs" / "benchmarks.md"
PACKAGES = ("uvicorn", "starlette", "websockets", "sqlalchemy", "asyncpg", "aiosqlite", "httpx", "orjson")


WORKLOADS = {
    1: (
        "callbacks/s",
        "callbacks/s of one gateway process on SQLite and on PostgreSQL (keep-alive connections, each "
        "driving tasks of its own through start and progress 1..100, every callback a real change with a "
        "unique callbackId), beside a bare-driver Starlette handler doing the same transaction per callback "
        "(sqlite3 / asyncpg) and the same handler with no database (what HTTP alone costs here).",
    ),
    2: (
        "fan-out",
        "one task with N subscribers in client processes, callbacks at a fixed rate: the gateway process's "
        "CPU (its CPU-time clock, every thread) per delivered frame, the callbacks' own HTTP and commit "
        "included, beside a raw `websockets` `broadcast()` server sending frames of the same size, each fed "
        "by a publisher WebSocket message. The callbacks cost the gateway what a publisher's message does "
        "not cost the floor (an HTTP request and a database commit each, about 2 ms of CPU): at N = 100 that "
        "is about 20 us per frame, which would hide what fan-out itself costs. So each N is also run with no "
        "subscriber, the same callbacks (same count, same rate) to the gateway and the same messages to the "
        "floor, with the CPU read at the same points (before the first callback or message; after the last "
        "is answered or read, and, with subscribers, once every subscriber has it), and a second row gives "
        "the CPU per frame above that base: (CPU with N - CPU with none) / frames, for each side. And the "
        "frames lost or out of order, checked per subscriber by the client processes (versions 1, 2, 3, ... "
        "after the resume frame; a `conflated` snapshot may jump ahead; a socket the server ends early with "
        "a reason, such as 4008, is counted apart). Subscribers connect 200 at a time per client process; a "
        "subscription refused with `unavailable` (1013, try again) is retried after a backoff, as a client "
        "would, and the retries are counted.",
    ),
    3: (
        "idle memory",
        "the gateway's RSS growth divided by N once N sockets have subscribed and received their resume "
        "frame and a first event frame, beside the raw `websockets` server holding the same sockets (a "
        "hello, then one broadcast message).",
    ),
    4: (
        "callback latency",
        "callback p99 and p50 (and the rate achieved of the 50/s asked, one callback after the other, each "
        "sent when due or as soon as the previous one is answered, for 20 s, three times per N, the Ns "
        "alternated and the latencies pooled: 3,003 callbacks, the p99 their 30th slowest) on one task with "
        "N = 1,000 and 5,000 subscribers, beside the same callbacks with 10 subscribers: the answer should "
        "follow the commit, not the fan-out; where fan-out asks more than the process has, the fan-out is "
        "shed (several entries in one write, or a `conflated` snapshot), not the callbacks. For these runs "
        "the gateway, and the bench process that times its answers, are on one core and the subscriber "
        "processes on the other(s), as clients on other machines would be: `SCHED_IDLE` alone did not keep "
        "them off the gateway's wake-ups (under this kernel's preemption model, PREEMPT_NONE, a client "
        "inside a system call is not preempted until it leaves it; `perf sched timehist` showed the "
        "gateway's threads runnable but waiting 3-5 ms behind one).",
    ),
    5: (
        "reconnect storm",
        "N subscribers with cursors (half a few versions behind: `delta`; half far behind: `snapshot`) "
        "connecting at once (every client process opens all its sockets at the same instant) to tasks with "
        "history: the time until every one has its resume frame (retries after a refusal included), beside "
        "opening N sockets to the raw `websockets` server (the same accept backlog, 2048, as uvicorn's) and "
        "getting one message each.",
    ),
    6: (
        "retention",
        "the database's size under steady churn with `GATEWAY_RETAIN_FINISHED_S=10` "
        "(bench/workloads/retention.py): tasks created, run (three callbacks), given a receipt and drained "
        "in three rounds of ten steps of one second of the gateway's clock, while its retention loop deletes "
        "the tasks a retention old; the size after the third round beside the size after the first (SQLite: "
        "its pages; PostgreSQL: `pg_total_relation_size` of the tables, on a cluster of the bench's own "
        "whose autovacuum is on, its naptime compressed to a second as the retention is, each table's "
        "`autovacuum_vacuum_scale_factor` at 0.02 as docs/deploy.md advises), and the bytes a finished task "
        "costs. Checked besides: no row of a task past the retention is left, tasks nobody drained are kept.",
    ),
    7: (
        "tags",
        "tag subscriptions on `/v1/ws` (bench/workloads/tags.py), on one gateway process run through "
        "bench/programs/counted.py (which counts its store's queries on /metrics; its sweeper off, as no "
        "task reaches its deadline; a socket's first message allowed 64 KiB, as a 200-task cursors map "
        "needs), on a SQLite file. Fan-out: 1,000 tags of 20 tasks (20,000 tasks), one socket per tag "
        "holding its tag subscription, callbacks at 50/s on tasks picked at random (one frame each): the "
        "server's CPU per delivered frame, beside the same tasks followed by one socket per tag holding 20 "
        "task subscriptions (the floor); the same callbacks with no subscriber, before and after, are in the "
        "details (a callback costs far more than the one frame it makes). Subscribe: one tag of 200 tasks, "
        "each a version behind the client's cursor: the store's queries per subscribe and the time to the "
        "last resume frame, beside 200 task subscriptions sent together on one `/v1/ws` (medians of 20, each "
        "on a socket of its own). Reconnect storm: the 1,000 tag subscribers connecting at once with their "
        "cursors maps (every other task a version behind): the time until every one has the resume frames of "
        "its 20 tasks, beside the same subscribers resuming task by task (20 subscribe messages, each with "
        "the task's token). Every subscription's frames are checked per task by its client process (the "
        "listing, one resume frame per task, then versions 1 by 1).",
    ),
    8: (
        "Celery progress()",
        "a Celery task calling `progress()` 10,000 times in a loop (hashing 32 KiB per iteration) in a "
        "`celery worker --pool prefork --concurrency 1` with the integration installed, beside the same task "
        "in a worker without it (the floor), and in one whose gateway is stopped "
        "(bench/workloads/celery_progress.py, on Redis db 11): the task's time from `task_prerun` to "
        "`task_postrun` (the integration's start, progress calls, outcome and its wait for the answer "
        "included), medians of 5 runs taken in turn.",
    ),
    11: (
        "More processes cost no more",
        "`gateway serve --workers 2` beside one process, on PostgreSQL (a database of its own per gateway), "
        "in alternation (1, 2, 1, 2), medians (bench/workloads/workers_cost.py): 64 keep-alive connections "
        "drive callbacks (bench/programs/callback_client.py) for 8 s, after 3 s unmeasured (each process's "
        "pool connections opened and statements prepared): the server's CPU (the parent and every child, "
        "from /proc) per applied callback, the throughput, each process's mean group-commit batch, the bus "
        "messages each process heard per callback, user and system CPU and context switches per callback; "
        "then 1,000 subscribers of one task, spread by the kernel over the processes, 100 callbacks at 20/s: "
        "the server's CPU per delivered frame, every subscriber's frames checked (none lost or out of "
        "order).",
    ),
    9: (
        "20,000 on one process",
        "one `gateway serve` process (on a SQLite file) holding 19,000 idle subscribers of one task, as "
        "workload 3 measures them (RSS growth / N after the resume frame and a first event frame), beside "
        "the raw `websockets` server holding the same sockets; then 19,000 subscribers with cursors "
        "connecting at once to a fresh gateway, as workload 5's storm (10 tasks of 40 versions, half "
        "`delta`, half `snapshot`) but with at most 500 handshakes in flight per client process (a client "
        "process starting thousands at once is slow to send each request, and the gateway closes a "
        "connection silent for 5 s), beside the raw `websockets` server opening the same 19,000 alike. The "
        "subscribers come from client processes of at most 18,000 sockets each, each from a loopback address "
        "of its own (127.0.0.2, ...). 19,000 fits under the gateway's descriptor ceiling (20,000 less "
        "`GATEWAY_FD_RESERVE`, 256): the WebSockets it refused `503 too-many-sockets` are counted.",
    ),
    10: (
        "100,000 over --workers",
        "100,000 subscribers over `gateway serve --workers 6` on a PostgreSQL database of its own "
        "(bench/workloads/hundredk.py; 6 processes, ~16,700 sockets each on average under this machine's "
        "20,000 descriptors per process, each worker accepting on a listening socket of its own in the "
        "port's `SO_REUSEPORT` group, so that the kernel spreads the connections evenly; a worker near its "
        "limit answers 503 and the client retries), 10 on each of 10,000 tasks, from client processes on "
        "loopback source addresses of their own; callbacks at 200/s for 60 s, each on a task picked at "
        "random (drawn before the run, so that each subscriber knows the version it ends at), sent when due "
        "(those of different tasks overlap, as many workers' do). Beside raw `websockets` serving the same "
        "sockets from as many processes (bench/programs/sharded_floor.py: one port shared with "
        "`SO_REUSEPORT`, task -> set of sockets in each, a publisher connection to each process sending "
        "every message to all, as the bus tells every worker). Server CPU per delivered frame: the CPU-time "
        "clocks of the gateway's parent and every worker, summed; a second row above the same callbacks with "
        "no subscriber (10 s of them before the subscribers connect, their CPU per callback scaled to the "
        "run's count; the floor's messages likewise). Callback p99 beside that of the callbacks with no "
        "subscriber. The longest full garbage collection (generation 2) of any gateway process during the "
        "run: each process runs bench/programs/gcwatched.py (the `gateway` command with a `gc.callbacks` "
        "hook writing every full collection to a file per process: `/metrics` reaches one random worker and "
        "gives buckets, not the longest). Reconnect storm: every socket dropped, all 100,000 reconnecting at "
        "once with their cursors (tasks with callbacks one version behind: `delta`; the others `caught-up`), "
        "until every resume frame, beside the floor's time to open its 100,000 the same way; in both, at "
        "most 500 handshakes in flight per client process, as in workload 9. Frames lost or out of order "
        "checked per subscriber in the run and the storm.",
    ),
    12: (
        "latency end to end",
        "one task with N = 10, 1,000 and 10,000 subscribers on one gateway process (SQLite, run through "
        "bench/programs/timed.py, which notes the CLOCK_MONOTONIC time at which each entry's transaction "
        "committed), callbacks one at a time at 20/s, 10/s and 1/s (so that the frames per second stay "
        "within what the client processes, on the other core, read as they come): p99 of the time from just "
        "before a callback's request is sent to the moment a subscriber has read its frame, and from the "
        "entry's commit to that moment, over every (subscriber, version) pair of about 500 subscribers "
        "spread over the client processes (p50 and p95 in the details), beside raw `websockets`' "
        "publish-to-receive at the same N and rate (a publisher connection to the `broadcast()` floor "
        "server, its send time noted just before each frame). At N = 100,000: `gateway serve --workers 6` on "
        "PostgreSQL (the callback committed by one process, its entry reaching the others over the bus), 6 "
        "callbacks at one every 10 s (100,000 frames take the client processes about 10 s to read), beside 6 "
        "raw `websockets` processes on one port (bench/programs/sharded_floor.py), each sent every frame by "
        "the publisher. The request-to-frame time includes the HTTP request and the commit (an fsync), which "
        "the floor does not do. While frames are timed, the servers and the bench are on one core, the "
        "client processes on the other under `SCHED_IDLE`, as in workload 4 (the sockets are opened before, "
        "on both).",
    ),
    13: (
        "across hosts",
        "two gateway hosts and a PostgreSQL host as network namespaces of this machine "
        "(bench/workloads/hosts.py: veth pairs to a bridge), gateway A and gateway B (`gateway serve` "
        "through bench/programs/timed.py, which notes each entry's commit time on CLOCK_MONOTONIC, one clock "
        "for every namespace) on a throwaway cluster of the PostgreSQL host with the LISTEN/NOTIFY bus, N = "
        "10 and 1,000 subscribers on host A (their client processes run there, `ip netns exec`), the "
        "callbacks from the root namespace: the commit-to-frame p50/p99 with the callbacks posted to B (the "
        "entry reaches A's subscribers over the bus) beside the same with the callbacks posted to A (commit "
        "and subscribers on one gateway), each run on a task of its own, about 100 subscribers noting when "
        "they read each frame, and the frames lost or out of order, checked per subscriber. The commit is "
        "the moment the writing gateway has PostgreSQL's answer to its COMMIT: that answer and the NOTIFY "
        "(which carries the frame) leave PostgreSQL together and each crosses one delayed link, so the bus "
        "adds no round trip; what A does not do across hosts is answer the callbacks, whose turn comes "
        "before the fan-out's in a process that does both. The issue asks for `tc netem` 1 ms delay on the "
        "links: netem does not exist in this kernel (nor `fq` or `etf`, so no departure-time pacing; only "
        "`pfifo`, `htb` and `tbf`, none of which delays a packet by a fixed time), so a userspace TCP relay "
        "on the PostgreSQL host stands in for it: every chunk either way between a gateway and PostgreSQL is "
        "carried 1 ms after it was read (2 ms round trip), in order, with no bandwidth limit. Unlike netem "
        "it does not delay TCP's handshake or ACKs, and its own scheduling adds to the delay on a busy "
        "machine (the details give a `SELECT 1` round trip through it). Not root, or no `ip netns`: the row "
        "says the workload was skipped, and why.",
    ),
    14: (
        "past one PostgreSQL",
        "the ceiling of one PostgreSQL here (bench/workloads/pg_ceiling.py), on a cluster of the bench's own "
        "(tests/support/pgcluster.py; PostgreSQL's defaults and `autovacuum = off` as the shared server's, "
        "`pg_stat_statements` loaded): callbacks/s of `gateway serve --workers W` (1, 2) driven by "
        "bench/programs/callback_client.py at C keep-alive connections (16, 64, 256, raised until "
        "callbacks/s rise less than 5%), the best median taken as saturation, beside pgbench at C clients "
        "writing one `UPDATE` of the client's task row and one `INSERT` of an entry per transaction (the "
        "database's own ceiling for that write), the two alternating, 3 runs of 3 s each at each step, "
        "medians. Around each run: the CPU of PostgreSQL's processes, of the gateway's and of the client "
        "(/proc), WAL bytes (`pg_current_wal_lsn`) and flushes (`pg_stat_wal`), commits and rows "
        "(`pg_stat_database`), write commits and each statement's time (`pg_stat_statements`). Checked: "
        "every acknowledged callback's id is in the database.",
    ),
    15: (
        "streams",
        "a task's streams through the HTTP append and the reads (bench/workloads/streams.py), one "
        "`gateway serve` process on a SQLite file and on a PostgreSQL database of its own, beside a bare "
        "Starlette handler (bench/programs/stream_floor.py) that inserts each batch as one row (task, "
        "stream, offset, attempt, seq, the chunks' JSON array) on the same driver with the same durability "
        "(sqlite3 with WAL and synchronous=FULL, asyncpg), one commit per batch, and answers a read with a "
        "bare `SELECT` of the stream's rows and one send. The producers (bench/programs/stream_client.py, a "
        "process of their own) send both the same requests, one keep-alive connection per stream; every "
        "chunk is 20 bytes and unique to its place. Ingest: 100 streams (a task each) x 20 batches/s x 10 "
        "chunks for 30 s (a producer that falls behind sends each batch once the previous one is answered, "
        "and none after 120 s): "
        "the chunks taken and the rate achieved, every stream's text read back and compared with what was "
        "taken, the server's CPU per chunk (its CPU-time clock), rows and commits per second (the gateway's: "
        "its group-commit batches). One stream: batches of 10 chunks, each sent once the previous one is "
        "answered, for 10 s. Storage: after the ingest and a 10,000-chunk stream, `VACUUM`, the stream "
        "tables' and their indexes' bytes (SQLite: `dbstat`; PostgreSQL: `pg_total_relation_size`) per chunk "
        "they hold, the task ids 16 bytes. Resume: the 10,000-chunk stream read from offset 0 following "
        "`nextOffset` until its last chunk, in pages of the default limit (1,000) and of 10,000, beside the "
        "floor's one read; medians of 7 reads each, taken in turn.",
    ),
    16: (
        "streams live",
        "a task's stream `output` followed live (bench/workloads/stream_live.py; `?streams=output:0` on the "
        "single-task socket, one `gateway serve` process on a SQLite file), every subscriber checking its "
        "chunks by offset (none missing, none repeated, every one up to the last). Chunk-to-frame: one "
        "chunk per append at 20/s to 10 subscribers and 10/s to 1,000 (300 and 100 appends): p50 and p99 "
        "of the time from just before an append's request to each timed subscriber's `chunks` frame (about "
        "500 subscribers timed), beside raw `websockets`' publish-to-receive to as many receivers "
        "(workload 12's floor run, frames of a `chunks` frame's size); servers and bench on one core, "
        "clients on the other, as in workload 12. The request-to-frame time includes the append's HTTP "
        "request and commit (an fsync), which the floor does not do. Resume: one subscriber asking a "
        "running task's stream of 10,000 chunks of 20 bytes from offset 0, from its connect to its first "
        "`chunks` frame and to its last chunk, beside a raw `websockets` server answering with a bare "
        "`SELECT` of the stream's rows in the gateway's own SQLite file, their JSON arrays spliced into one "
        "frame (bench/programs/resume_floor.py); medians of 11 runs taken in turn. Memory: 100 ended tasks "
        "with a stream of 4 MiB each (chunks of 1,000 bytes), each read from offset 0 by 10 subscribers at "
        "once: the peak RSS (`VmHWM`) of a gateway process started on the filled database for the reads "
        "alone, beside the same with streams of 0.4 MiB.",
    ),
    17: (
        "batches",
        "a batch's counts and live metadata (bench/workloads/batches.py; one `gateway serve` process on a "
        "SQLite file per side, subscribers on the single-task socket). Children: a parent with 10,000 "
        "children, one subscriber of the parent, each child started and succeeded (two callbacks) with the "
        "children ending at 500/s (driven by bench/programs/paced_callbacks.py, a client process of its own: "
        "each child due at i/500 s, started and succeeded on one of 32 keep-alive connections): the "
        "gateway's CPU (its CPU-time clock) "
        "per child transition, from the first callback until the parent's subscriber has the last "
        "`children` frame, beside the same transitions of as many tasks created without a parent and with no "
        "subscriber; the subscriber and the parent's JSON must end on the exact counts (every child "
        "succeeded). Metadata: 1,000 running tasks, one subscriber each, 1,000 merge patches at 50/s spread "
        "over them in turn (`POST /v1/tasks/{id}/metadata` with the callback token): the gateway's CPU per "
        "delivered `metadata` frame, beside progress callbacks at the same rate on the same tasks, per "
        "delivered `event` frame; every patch and every callback must be delivered.",
    ),
}


@dataclass
class Row:
    workload: int
    measure: str
    figure: float | None
    floor: float | None
    unit: str
    target: str
    digits: int = 1
    ratio: float | None = None  # figure / floor unless given

    def ratio_value(self) -> float | None:
        if self.ratio is not None:
            return self.ratio
        if self.figure is None or self.floor is None or not self.floor:
            return None
        return self.figure / self.floor

    def cells(self) -> tuple[str, str, str, str, str]:
        def number(value: float | None) -> str:
            if value is None or (isinstance(value, float) and math.isnan(value)):
                return "-"
            return f"{value:,.{self.digits}f}" + (f" {self.unit}" if self.unit else "")

        ratio = self.ratio_value()
        return (
            self.measure,
            number(self.figure),
            number(self.floor),
            "-" if ratio is None or math.isnan(ratio) else f"{ratio:.2f}x",
            self.target,
        )


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    details: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # the smoke checks that failed
    failures: list[str] = field(default_factory=list)  # workloads that could not run
    needs: list[Need] = field(default_factory=list)  # per workload: time, memory, sockets

    def figure(self, what: str, value: float | None, positive: bool = True) -> None:
        """A figure must exist: a finite number, positive unless told otherwise."""
        if value is None or not math.isfinite(value) or (positive and value <= 0):
            self.problems.append(f"{what}: no figure ({value})")

    def gateway_logs(self, workload: str) -> None:
        """What the workload's gateways logged, as details (a run should log nothing at warning)."""
        kinds: dict[str, int] = {}
        for summary in harness.GATEWAY_LOGS:
            for kind, count in summary["kinds"].items():
                kinds[kind] = kinds.get(kind, 0) + count
        harness.GATEWAY_LOGS.clear()
        for kind, count in sorted(kinds.items(), key=lambda item: -item[1])[:3]:
            self.details.append(f"{workload}: the gateway logged {count} x `{kind.strip()}`")

    def frames(self, what: str, stats: dict[str, Any]) -> None:
        """No frame lost or out of order, every subscriber connected and complete."""
        for key in (
            "lost",
            "out_of_order",
            "failed",
            "incomplete",
            "unexpected",
            "resume_mismatch",
            "bad_close",
        ):
            if stats.get(key):
                self.problems.append(f"{what}: {key} = {stats[key]} {stats.get('errors') or ''}".rstrip())
        if stats.get("timed_out"):
            why = stats["timed_out"]
            reason = f": {why}" if isinstance(why, str) else ""
            self.problems.append(f"{what}: the subscribers did not all finish in time{reason}")


def frames_summary(stats: dict[str, Any]) -> str:
    text = (
        f"{stats['deliveries']:,} frames to {stats['connected']:,}/{stats['subscribers']:,} subscribers, "
        f"{stats['gaps']} gaps ({stats['missing']} versions), {stats['reorders']} reorders, "
        f"{stats['tail_missing']} versions missing at the end, {stats['conflated']} conflated snapshots"
    )
    if stats.get("cut"):
        text += (
            f", {stats['cut']} sockets ended early by the server with a reason "
            f"(close codes {stats['closes']}; {stats['cut_missing']} versions not sent to them)"
        )
    if stats.get("retries"):
        text += f", {stats['retries']} subscribe attempts refused or failed and retried"
    if stats.get("failed"):
        text += f", {stats['failed']} failed to connect"
    if stats.get("errors"):
        text += f" ({'; '.join(stats['errors'][:3])})"
    if stats.get("resume_mismatch"):
        text += f", {stats['resume_mismatch']} whose first frame was not the resume frame expected"
    return text


def table(rows: list[Row], markdown: bool) -> str:
    header = ("measure", "figure", "floor", "ratio", "target")
    cells = [r.cells() for r in rows]
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---", "--:", "--:", "--:", "---"]) + "|"]
        lines += ["| " + " | ".join(c) + " |" for c in cells]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in column) for column in zip(header, *cells, strict=True)]
    align = ["<", ">", ">", ">", "<"]

    def line(values: tuple[str, ...]) -> str:
        return "  ".join(f"{v:{a}{w}}" for v, a, w in zip(values, align, widths, strict=True)).rstrip()

    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *(line(c) for c in cells)])


PROBE_ADDITIONS = 10_000_000


def cpu_probe() -> tuple[float, float]:
    """CPU and wall seconds of a pure-Python loop of :data:`PROBE_ADDITIONS` additions: how fast this shared
    machine's core is now (a run on a day it is several times slower takes that much longer, its ratios
    alike); wall above CPU is time the process waited for a core."""
    t0, w0 = time.process_time(), time.perf_counter()
    total = 0
    for i in range(PROBE_ADDITIONS):
        total += i
    return time.process_time() - t0, time.perf_counter() - w0


Probe = tuple[float, float]


def machine(pg_version: str, probes: tuple[Probe, Probe] | None = None) -> list[tuple[str, str]]:
    memory = "?"
    with contextlib.suppress(OSError):
        for text in Path("/proc/meminfo").read_text().splitlines():
            if text.startswith("MemTotal:"):
                memory = f"{int(text.split()[1]) / 1024 / 1024:.1f} GiB"
    model = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                model = text.split(":", 1)[1].strip()
                break
    versions = []
    for name in PACKAGES:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} (not installed)")
    commit = "?"
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        commit = subprocess.run(
            ["git", "-C", str(harness.ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(harness.ROOT), "status", "--porcelain", "--", "gateway", "bench"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        if dirty:
            commit += " (with uncommitted changes to gateway/ or bench/)"
    return [
        (
            "cores",
            f"{os.cpu_count()} ({model}); shared and noisy: every figure is beside a floor of the same run",
        ),
        ("memory", memory),
        ("kernel", f"{platform.system()} {platform.release()}"),
        ("Python", f"{platform.python_implementation()} {platform.python_version()}"),
        ("packages", ", ".join(versions)),
        ("PostgreSQL", pg_version),
        ("file descriptors", f"soft limit {harness.raise_nofile(0)} (raised by the bench)"),
        *(
            [
                (
                    "CPU speed",
                    f"a pure-Python loop of {PROBE_ADDITIONS:,} additions took {probes[0][0]:.2f} s of CPU "
                    f"({probes[0][1]:.2f} s wall) at the run's start, {probes[1][0]:.2f} s "
                    f"({probes[1][1]:.2f} s) at its end (this shared machine's speed varies from day to day: "
                    "runs of different days compare by their ratios, and by this)",
                )
            ]
            if probes is not None
            else []
        ),
        ("commit", commit),
    ]


# Under the table in docs/benchmarks.md.
TABLE_NOTE = (
    "The fan-out rows with the callbacks' own CPU included count each callback's HTTP request and commit "
    "(about 2 ms of CPU), which the floor's publisher message does not cost it: at N=100 that is most of a "
    "frame's figure. The rows above the same callbacks with no subscriber leave it out. The p99 at N=5,000 "
    "has no ratio target: there fan-out is shed so that callbacks keep their rate."
)


def write_docs(report: Report, procs: int, facts: list[tuple[str, str]], elapsed: float) -> None:
    """docs/benchmarks.md from a full run: the machine, how to reproduce, the table, the workloads."""
    lines = [
        "# Benchmarks",
        "",
        "Generated by `.venv/bin/python -m bench` (do not edit by hand); "
        f"run {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {elapsed:.0f} s.",
        "",
        "## The machine",
        "",
        *(f"- {name}: {value}" for name, value in facts),
        "",
        "## How to reproduce",
        "",
        "```sh",
        "python3 -m venv .venv && .venv/bin/pip install -e .  # and py-spy for BENCH_PROFILE",
        "# PostgreSQL at 127.0.0.1:5432, user postgres, trust (or GATEWAY_TEST_PG_URL / --pg-admin-url)",
        f".venv/bin/python -m bench          # every workload, this file (~{elapsed / 60:.0f} min)",
        ".venv/bin/python -m bench --smoke  # every workload tiny: figures and frame order checked (CI)",
        "```",
        "",
        "The gateway runs as a user runs it (`gateway serve`, as `python -m gateway.cli serve --port P "
        "--database-url ...`) with `GATEWAY_SECRET` set and `GATEWAY_LOG_LEVEL=warning`, in open mode on "
        "loopback, on a SQLite file of its own (workloads 2 to 5) or a PostgreSQL database made for the run "
        "and dropped after it. The subscribers are `websockets` clients in "
        f"{procs} separate processes (more where one would hold over 18,000 sockets; each connects from a "
        "loopback address of its own, 127.0.0.2 and up) under Linux's `SCHED_IDLE` policy (on this machine "
        "they stand for clients on other machines: they take only the CPU time the server under test, "
        "gateway or floor alike, does not want; for the latency runs they also get cores of their own, see "
        "workload 4). The floors are measured in the same run, one after the other on the same machine; a "
        "ratio is figure / floor. Targets are the performance issue's; they are printed, never asserted. "
        "`--smoke` runs are too short for their figures to be compared with the targets.",
        "`python -m bench fanout` and `python -m bench callbacks` run single workloads with more options; "
        "`python -m bench expiry` (not part of this run; PostgreSQL, a million tasks by default) times a "
        "sweep pass among a million tasks. `python -m bench checks` (not part of this run either; CI runs it "
        "after the tests) holds the bounds the project promises (leases and expiry within 1 s under load, "
        "the database within 1.2x under churn, ...), each figure beside its target.",
        "",
        "## Results",
        "",
        table(report.rows, markdown=True),
        "",
        TABLE_NOTE,
        "",
        *(f"- {d}" for d in report.details),
        "",
        "## What the run needs",
        "",
        "Per workload: its time; at its peak, the sum of the RSS of the bench process and every process "
        "under it (gateways, floors, client processes, workers; not PostgreSQL's server), the machine's used "
        "memory (MemTotal - MemAvailable) and the TCP sockets open on the machine (both ends of each "
        "loopback connection), sampled every half second.",
        "",
        needs.table(report.needs),
        "",
        "## What each workload measures",
        "",
        *(f"{i}. **{name}**: {text}" for i, (name, text) in WORKLOADS.items()),
        "",
    ]
    if report.failures:
        lines += ["## Workloads that did not run", "", *(f"- {f}" for f in report.failures), ""]
    DOCS.write_text("\n".join(lines))
