"""What every benchmark needs: processes that die with the bench, databases dropped however it ends, the
gateway started as a user starts it, the raw ``websockets`` floor server, /proc readings, and the subscriber
client processes (``bench/programs/subscribers.py``) driven over their stdin and stdout.

Every process is started through :func:`spawn`: it is killed by the kernel if the bench dies (Linux
``PR_SET_PDEATHSIG``), and :func:`kill_all` ends whatever is still running. Every PostgreSQL database is
made through :func:`pg_database`: dropped at the end of its block, and by :func:`drop_leftover_databases`
if the block never got to run its end (call it after the event loop stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import itertools
import json
import math
import os
import re
import resource
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

TICKS = os.sysconf("SC_CLK_TCK")
SECRET = "bench-secret-0123456789abcdef0123456789"
PG_ADMIN = os.environ.get("GATEWAY_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
ROOT = Path(__file__).resolve().parents[2]  # the checkout: bench/lib/harness.py
# uvicorn's accept backlog (its default); the floor server gets the same, so that a storm of connections
# meets the same kernel queue on both sides.
BACKLOG = 2048

# --- processes ---------------------------------------------------------------------------------------

_processes: set[asyncio.subprocess.Process] = set()

try:
    _libc: Any = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover  (not Linux)
    _libc = None


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the bench's process ends, however it ends."""
    if _libc is not None:
        _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def program(name: str, *args: str) -> list[str]:
    """The command that runs ``bench/programs/<name>.py`` (a module of this package: started through
    :func:`spawn`, from the checkout, where ``bench`` is importable)."""
    return [sys.executable, "-m", f"bench.programs.{name}", *args]


async def spawn(command: Sequence[str], **options: Any) -> asyncio.subprocess.Process:
    """``command`` in a process of its own, run from the checkout (so that ``python -m bench.programs...``
    finds the package), killed if the bench dies."""
    options.setdefault("cwd", ROOT)
    process = await asyncio.create_subprocess_exec(*command, preexec_fn=_die_with_parent, **options)
    _processes.add(process)
    return process


async def stop(process: asyncio.subprocess.Process, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; waits for the process to be gone."""
    try:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
            try:
                await asyncio.wait_for(process.wait(), grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await asyncio.wait_for(process.wait(), 5)
    finally:
        _processes.discard(process)


def kill_all() -> None:
    """Kill every process :func:`spawn` started that is still running (synchronous: for the very end)."""
    for process in list(_processes):
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(process.pid, 0)
        _processes.discard(process)


def run_to_the_end(main: Coroutine[Any, Any, int | None]) -> int:
    """``asyncio.run(main)`` for a command of the bench (its exit status: ``main``'s, 0 for None); however it
    ends, every process :func:`spawn` started is killed and every database :func:`pg_database` made is
    dropped."""
    try:
        return asyncio.run(main) or 0
    finally:
        kill_all()
        for name in drop_leftover_databases():
            print(f"dropped leftover database {name}", file=sys.stderr)


def raise_nofile(wanted: int) -> int:
    """Raise the soft file-descriptor limit towards ``wanted`` (children inherit it); returns the limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return soft
    if hard != resource.RLIM_INFINITY and hard < wanted:
        with contextlib.suppress(ValueError, OSError):  # only a privileged process may raise its hard limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, wanted))
            return wanted
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """The CPU time process ``pid`` has used so far (every thread, ended ones included), in seconds: read
    from its CPU-time clock (Linux ``clock_getcpuclockid``: nanoseconds), else utime + stime from
    /proc/PID/stat (clock ticks: 10 ms, too coarse for a difference of two short runs)."""
    if _libc is not None:
        clock = ctypes.c_int()
        if _libc.clock_getcpuclockid(pid, ctypes.byref(clock)) == 0:
            with contextlib.suppress(OSError):
                return time.clock_gettime_ns(clock.value) / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


@contextlib.asynccontextmanager
async def profiled(pid: int, name: str) -> AsyncIterator[None]:
    """With ``BENCH_PROFILE=DIR`` in the environment, py-spy samples process ``pid`` (Python frames holding
    the GIL, 250 Hz) for the block's duration into ``DIR/NAME.raw`` (py-spy's raw format: one stack and
    its count a line); without it, nothing. py-spy must be installed (``pip install py-spy``)."""
    folder = os.environ.get("BENCH_PROFILE")
    if not folder:
        yield
        return
    os.makedirs(folder, exist_ok=True)
    out = os.path.join(folder, f"{name}.raw")
    # The venv's py-spy when the bench runs from a venv, else the one on PATH.
    spy_path = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or "py-spy"
    command = [spy_path, "record", "--pid", str(pid)]
    command += ["--rate", "250", "--gil", "--nonblocking", "--format", "raw", "--output", out]
    spy = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        yield
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(spy.wait(), 30)
        print(f"profile of pid {pid}: {out}", file=sys.stderr)


# Cores for a latency measurement (workload 4): the server under test, with the process that times its
# answers, on the first; the subscriber processes on the others. The subscribers stand for clients on other
# machines. SCHED_IDLE alone (see subscribers.py) does not keep them off the server's wake-ups here: under
# this kernel's preemption model (PREEMPT_NONE, 250 Hz) a client inside a system call is not preempted
# until it leaves it, and `perf sched timehist` showed the gateway's threads runnable but waiting 3-5 ms
# behind one. ``None`` where there is one core, or the process may not choose.
def split_cores() -> tuple[set[int], set[int]] | None:
    try:
        cores = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if len(cores) < 2:
        return None
    return {cores[0]}, set(cores[1:])


def set_cores(pid: int, cores: set[int]) -> dict[int, set[int]]:
    """Every thread of ``pid`` on ``cores`` (threads it starts later inherit it); their cores before."""
    before: dict[int, set[int]] = {}
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            before[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cores)
    return before


@contextlib.contextmanager
def on_cores(pids: Sequence[int], cores: set[int] | None) -> Iterator[None]:
    """The processes ``pids`` (every thread) on ``cores`` for the block, then back (``None``: unchanged)."""
    if cores is None:
        yield
        return
    before: dict[int, set[int]] = {}
    for pid in dict.fromkeys(pids):  # each once: a second pass would keep the new cores as the old
        before.update(set_cores(pid, cores))
    try:
        yield
    finally:
        for tid, cores_before in before.items():
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, cores_before)


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


# --- PostgreSQL --------------------------------------------------------------------------------------

_databases: set[tuple[str, str]] = set()


@contextlib.asynccontextmanager
async def pg_database(admin_url: str = PG_ADMIN, prefix: str = "gw_bench") -> AsyncIterator[str]:
    """A database of the run's own, dropped at the end. Its name carries this process's id
    (``{prefix}_p{pid}_{random}``), so that :func:`drop_stale_databases` can tell one whose bench was
    killed (SIGKILL leaves no chance to drop it) from one a running bench uses."""
    import asyncpg  # type: ignore[import-untyped]  # no stubs, no py.typed (as in gateway/store/database.py)

    name = f"{prefix}_p{os.getpid()}_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(admin_url, timeout=5)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        _databases.add((admin_url, name))
        try:
            yield admin_url.rsplit("/", 1)[0] + "/" + name
        finally:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            _databases.discard((admin_url, name))
    finally:
        await admin.close()


STALE = re.compile(r"^gw_bench\w*_p(\d+)_[0-9a-f]{8}$")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def drop_stale_databases(admin_url: str = PG_ADMIN) -> list[str]:
    """Drop the databases of benches that died without dropping them: named by :func:`pg_database`, by a
    process of this machine that is gone. (PostgreSQL is on loopback: the process ids are this host's.)"""
    import asyncpg

    admin = await asyncpg.connect(admin_url, timeout=5)
    dropped = []
    try:
        for (name,) in await admin.fetch("SELECT datname FROM pg_database WHERE datname LIKE 'gw\\_bench%'"):
            match = STALE.match(name)
            if match and not alive(int(match.group(1))):
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                dropped.append(name)
    finally:
        await admin.close()
    return dropped


def drop_leftover_databases() -> list[str]:
    """Drop the databases whose block did not end (the loop was stopped under it). Synchronous."""
    if not _databases:
        return []
    import asyncpg

    async def drop() -> list[str]:
        dropped = []
        for admin_url, name in list(_databases):
            with contextlib.suppress(Exception):
                admin = await asyncpg.connect(admin_url, timeout=5)
                try:
                    await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
                    dropped.append(name)
                    _databases.discard((admin_url, name))
                finally:
                    await admin.close()
        return dropped

    return asyncio.run(drop())


async def postgres_version(admin_url: str = PG_ADMIN) -> str:
    import asyncpg

    conn = await asyncpg.connect(admin_url, timeout=5)
    try:
        return str(await conn.fetchval("SHOW server_version"))
    finally:
        await conn.close()


# --- servers -----------------------------------------------------------------------------------------


@dataclass
class Server:
    port: int
    process: asyncio.subprocess.Process

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}"


def gateway_env(bus: str | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(GATEWAY_SECRET=SECRET, GATEWAY_LOG_LEVEL="warning")
    # The benches open thousands of sockets from loopback and drive single tasks flat out: the limits
    # for strangers (connections per address, callbacks per second per task) are not what they measure.
    env.update(GATEWAY_MAX_CONNECTIONS_PER_ADDRESS="0", GATEWAY_CALLBACK_RATE_PER_S="0")
    if bus is not None:
        env["GATEWAY_BUS_URL"] = bus
    env.update(extra or {})
    return env


def gateway_command(port: int, database_url: str, *, counted: bool = False, timed: bool = False) -> list[str]:
    """``gateway serve`` as a user runs it (this interpreter's, so that the venv's gateway runs, or that of
    ``BENCH_GATEWAY_PYTHON``); ``counted``:
    through bench/programs/counted.py, which counts the store's queries on /metrics and changes nothing
    else; ``timed``: through bench/programs/timed.py, which writes each entry's commit time to the file named
    by ``BENCH_COMMIT_TIMES`` in its environment and changes nothing else."""
    command = [sys.executable, "-m", "gateway.cli"]
    if os.environ.get("BENCH_GATEWAY_PYTHON"):
        # Another checkout's venv (``.venv/bin/python`` of a clone at another commit), to compare commits in
        # one sitting with the same bench: ``-P`` keeps the bench's folder off its path, so that it imports
        # its own gateway. Plain ``gateway serve`` only.
        command = [os.environ["BENCH_GATEWAY_PYTHON"], "-P", "-m", "gateway.cli"]
    if counted or timed:
        command = program("counted" if counted else "timed")
    return [*command, "serve", "--port", str(port), "--database-url", database_url]


async def wait_port(
    port: int, timeout_s: float = 30.0, process: asyncio.subprocess.Process | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.returncode is not None:
            raise RuntimeError(f"the server on port {port} exited with {process.returncode}")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout_s:.0f} s")


async def wait_http(
    url: str, timeout_s: float = 30.0, process: asyncio.subprocess.Process | None = None
) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=5) as http:
        while time.monotonic() < deadline:
            if process is not None and process.returncode is not None:
                raise RuntimeError(f"the gateway exited with {process.returncode} before it answered")
            try:
                if (await http.get(url + "/healthz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"the gateway at {url} did not answer /healthz in {timeout_s:.0f} s")


# What the gateways of this run logged (at warning and above), one summary per process that logged.
GATEWAY_LOGS: list[dict[str, Any]] = []


@contextlib.asynccontextmanager
async def gateway(
    database_url: str | None = None,
    *,
    bus: str | None = None,
    env: dict[str, str] | None = None,
    counted: bool = False,
    timed: bool = False,
) -> AsyncIterator[Server]:
    """``gateway serve`` on a free loopback port, on ``database_url`` or a SQLite file of its own
    (``counted``, ``timed``: see :func:`gateway_command`). Its log goes to a file; what it logged is summed
    up in :data:`GATEWAY_LOGS` and on stderr once it stopped."""
    with tempfile.TemporaryDirectory(prefix="gw-bench-") as tmp:
        port = free_port()
        url = database_url or f"sqlite:///{tmp}/bench.db"
        log_path = Path(tmp) / "gateway.log"
        with log_path.open("wb") as log:
            process = await spawn(
                gateway_command(port, url, counted=counted, timed=timed),
                env=gateway_env(bus, env),
                stderr=log,
            )
        try:
            await wait_http(f"http://127.0.0.1:{port}", process=process)
            yield Server(port, process)
        finally:
            await stop(process)
            summarize_log(port, log_path.read_text(errors="replace"))


def summarize_log(port: int, text: str) -> None:
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return
    heads = [line for line in lines if line.split(":", 1)[0] in ("ERROR", "WARNING", "CRITICAL")]
    kinds: dict[str, int] = {}
    for line in heads:
        kinds[line[:90]] = kinds.get(line[:90], 0) + 1
    summary = {"port": port, "lines": len(lines), "messages": len(heads), "kinds": kinds}
    GATEWAY_LOGS.append(summary)
    print(f"gateway on port {port} logged {len(lines)} lines ({len(heads)} messages):", file=sys.stderr)
    for kind, count in list(kinds.items())[:5]:
        print(f"  {count} x {kind}", file=sys.stderr)


# The floor: a raw ``websockets`` server (bench/programs/floor.py).


@contextlib.asynccontextmanager
async def floor_server() -> AsyncIterator[Server]:
    port = free_port()
    process = await spawn(program("floor", str(port), str(BACKLOG)), stdout=asyncio.subprocess.PIPE)
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 30)
        if line.strip() != b"ready":
            raise RuntimeError(f"the floor server did not start: {line!r}")
        yield Server(port, process)
    finally:
        await stop(process)


# --- subscriber processes ----------------------------------------------------------------------------

# Summed across client processes.
COUNTS = (
    "subscribers",
    "connected",
    "failed",
    "resume_mismatch",
    "deliveries",
    "gaps",
    "missing",
    "reorders",
    "conflated",
    "unexpected",
    "incomplete",
    "tail_missing",
    "cut",
    "cut_missing",
    "bad_close",
    "retries",
)


def spec_argument(spec: dict[str, Any]) -> str:
    """A client process's spec as its argument: JSON, or ``@FILE`` holding it where it is too long for one
    (Linux takes at most 128 KiB per argument: 100,000 subscribers over 10,000 task urls are more)."""
    text = json.dumps(spec)
    if len(text) < 100_000:
        return text
    with tempfile.NamedTemporaryFile("w", prefix="gw-bench-spec-", suffix=".json", delete=False) as out:
        out.write(text)
    return "@" + out.name


def merge_stats(parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    total: dict[str, Any] = {key: 0 for key in COUNTS}
    total["resume"] = {}
    total["closes"] = {}
    total["errors"] = []
    total["received"] = {}
    for part in parts:
        for version, times in part.get("received", {}).items():
            total["received"].setdefault(int(version), []).extend(times)
        for key in COUNTS:
            total[key] += part.get(key, 0)
        for group in ("resume", "closes"):
            for kind, n in part.get(group, {}).items():
                total[group][kind] = total[group].get(kind, 0) + n
        total["errors"] += [e for e in part.get("errors", []) if e not in total["errors"]]
    total["errors"] = total["errors"][:5]
    total["lost"] = total["missing"] + total["tail_missing"]
    total["out_of_order"] = total["reorders"]
    return total


# A step of many thousand sockets (opening them, a storm, every frame delivered): its time bound is
# SOCKET_BOUND_S a socket (100,000: 50 minutes), and it fails once no subscriber moved on for STALL_S. On a
# quiet day 100,000 open here in about 3 minutes; on a day this shared machine ran 3 times slower, past the
# 10 ms a socket the bound used to be.
SOCKET_BOUND_S = 0.03
STALL_S = 300.0  # past a handshake's own time bound (subscribers.OPEN_TIMEOUT_S, 120 s) and its retry


def socket_bound(n: int, at_least: float) -> float:
    """The time bound of a step of ``n`` sockets (see :data:`SOCKET_BOUND_S`)."""
    return float(max(at_least, n * SOCKET_BOUND_S))


# Sockets one client process holds at most: a process may open ~19,700 under this machine's limit of 20,000
# descriptors (``ulimit -n``, hard), and a client process past ~18,000 is slow to read them anyway.
PER_PROCESS = 18_000

# Loopback source addresses handed to client processes in turn (127.0.0.2, 127.0.0.3, ...: Linux routes
# all of 127/8 to loopback with no setup), so that no (source, destination) pair runs out of ephemeral ports
# (32768-60999: ~28,000) however many sockets a run opens to one server.
_sources = itertools.count()


def next_source() -> str:
    return str(ipaddress.IPv4Address("127.0.0.2") + next(_sources) % 16_000_000)


def loopback(url: str) -> bool:
    try:
        return ipaddress.ip_address(urlsplit(url).hostname or "").is_loopback
    except ValueError:
        return urlsplit(url).hostname == "localhost"


class Clients:
    """Subscriber sockets spread over client processes (``bench/programs/subscribers.py``), each of which
    checks, per subscriber, that versions arrive as last+1 (a ``conflated`` snapshot may jump ahead).

    ``groups``: ``(url, count, expected resume frame type or None)``; every process gets its share of each.
    ``procs``: client processes, at least (more if a process would hold over :data:`PER_PROCESS` sockets).
    Where every url is on loopback, each process connects from a loopback address of its own
    (:func:`next_source`).
    ``stream``: read the frames after the resume frame, up to ``final`` (the version at which a subscriber
    is complete; if not known yet, given later with :meth:`final`); without it a subscriber is complete
    once it has its resume frame.
    ``hold``: a complete subscriber keeps its socket until :meth:`close`.
    ``concurrency``: handshakes in flight per process (0: all at once).
    ``timed_every``: every K-th subscriber of each process notes when it read each frame; :meth:`done`'s
    ``received`` gives those times by version (``time.monotonic_ns()``), 0: none.
    ``prefix``: what runs each client process (``ip netns exec NS``: in a network namespace).
    ``stall_s``: a step (:meth:`expect`) also fails once no subscriber moved on for this long.
    ``chunks``: a stream's name: each subscriber follows its ``chunks`` frames by offset, not the task's
    versions (``final``: the last chunk's offset; see subscribers.py).
    """

    def __init__(
        self, processes: list[asyncio.subprocess.Process], started: float, stall_s: float | None = None
    ) -> None:
        self.processes = processes
        self.started = started
        self.stall_s = stall_s
        # Each process's latest progress line (its subscribers with a resume frame, the frames they read,
        # its subscribers complete), and when any of them last moved (time.monotonic()).
        self.progress: dict[int, tuple[int, int, int]] = {}
        self.moved = started
        # Lines read by an expect that then failed (a stall, a timeout): the next expect returns them.
        self._early: dict[int, dict[str, Any]] = {}

    @classmethod
    async def start(
        cls,
        groups: Sequence[tuple[str, int, str | None]],
        *,
        procs: int,
        stream: bool = False,
        final: int | None = None,
        hold: bool = False,
        concurrency: int = 200,
        expect_close: int | None = None,
        timeout_s: float = 180.0,
        cores: set[int] | None = None,
        timed_every: int = 0,
        prefix: Sequence[str] = (),
        stall_s: float | None = None,
        chunks: str | None = None,
    ) -> Clients:
        total = sum(count for _, count, _ in groups)
        procs = max(1, min(max(procs, math.ceil(total / PER_PROCESS)), total))
        spread = all(loopback(url) for url, _, _ in groups)
        shares: list[list[tuple[str, int, str | None]]] = [[] for _ in range(procs)]
        # A group's remainder goes to the processes after the last one that had one: the processes' totals
        # differ by at most one (always to the first ones, 10 a task over 6 processes gave the first four
        # 2 of each task and 20,000 sockets, over their descriptor limit).
        first = 0
        for url, count, expect in groups:
            for k in range(procs):
                i = (first + k) % procs
                n = count // procs + (1 if k < count % procs else 0)
                if n:
                    shares[i].append((url, n, expect))
            first = (first + count % procs) % procs
        processes = []
        try:
            for share in shares:
                spec = {
                    "groups": share,
                    "final": final,
                    "stream": stream,
                    "hold": hold,
                    "concurrency": concurrency,
                    "expect_close": expect_close,
                    "timeout_s": timeout_s,
                    "cores": sorted(cores) if cores else None,
                    "source": next_source() if spread else None,
                    "timed_every": timed_every,
                    "chunks": chunks,
                }
                processes.append(
                    await spawn(
                        [*prefix, *program("subscribers", spec_argument(spec))],
                        stdin=asyncio.subprocess.PIPE,
                        stdout=asyncio.subprocess.PIPE,
                        limit=2**20,
                    )
                )
            clients = cls(processes, time.monotonic(), stall_s)
            await clients.expect("loaded", 60)
            return clients
        except BaseException:
            for process in processes:
                await stop(process, 2)
            raise

    async def _line(self, process: asyncio.subprocess.Process, state: str) -> dict[str, Any]:
        assert process.stdout is not None
        while True:
            raw = await process.stdout.readline()
            if not raw:
                raise RuntimeError(f"a client process ended (exit {await process.wait()}) before {state!r}")
            message: dict[str, Any] = json.loads(raw)
            if message.get("state") != "progress":
                break
            counts = (message["ready"], message["frames"], message["done"])
            if self.progress.get(process.pid) != counts:
                self.progress[process.pid] = counts
                self.moved = time.monotonic()
        if message.get("state") != state:
            raise RuntimeError(f"a client process said {message} where {state!r} was expected")
        return message

    async def expect(self, state: str, timeout_s: float) -> list[dict[str, Any]]:
        """The next line of every process, which must be ``state``, within ``timeout_s``; with the clients'
        ``stall_s``, also failing once no subscriber of any process got its resume frame, a frame or
        completed for that long (the processes say how many every ``subscribers.PROGRESS_S``): a slow
        machine gets all the time it makes progress in, a stuck step fails early. The lines of processes
        that had answered when it failed are kept for the next ``expect`` of the same state."""
        stall_s = self.stall_s
        readers = {
            process.pid: asyncio.ensure_future(self._line(process, state))
            for process in self.processes
            if self._early.get(process.pid, {}).get("state") != state
        }
        now = time.monotonic()
        deadline, self.moved = now + timeout_s, now
        try:
            while pending := [r for r in readers.values() if not r.done()]:
                now = time.monotonic()
                left = deadline - now if stall_s is None else min(deadline, self.moved + stall_s) - now
                if left <= 0:
                    stalled = stall_s is not None and now < deadline
                    raise TimeoutError(
                        f"no client process progressed for {stall_s:.0f} s ({self.progress})"
                        if stalled
                        else f"client processes not {state!r} within {timeout_s:.0f} s ({self.progress})"
                    )
                done, _ = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_EXCEPTION)
                for reader in done:
                    reader.result()  # a process that ended or said something else: fail now
            lines = [
                readers[p.pid].result() if p.pid in readers else self._early.pop(p.pid)
                for p in self.processes
            ]
            readers.clear()
            return lines
        finally:  # failed: the lines read are kept, the reads still waiting cancelled
            for pid, reader in readers.items():
                if not reader.done():
                    reader.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await reader
                elif not reader.cancelled() and reader.exception() is None:
                    self._early[pid] = reader.result()

    async def tell(self, command: str) -> None:
        for process in self.processes:
            assert process.stdin is not None
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                process.stdin.write(command.encode() + b"\n")
        for process in self.processes:
            assert process.stdin is not None
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                await process.stdin.drain()

    async def connect(self, timeout_s: float) -> list[dict[str, Any]]:
        """Tell every process to connect now; returns their "ready" lines (``t``: the monotonic time at
        which the process's last subscriber had its resume frame)."""
        await self.tell("go")
        return await self.expect("ready", timeout_s)

    async def final(self, version: int) -> None:
        """The version at which every streaming subscriber is complete."""
        await self.tell(f"final {version}")

    async def done(self, timeout_s: float) -> dict[str, Any]:
        """Wait until every subscriber is complete (or, past ``timeout_s`` or a stall: see :meth:`expect`,
        stop them); merged counts."""
        try:
            parts = await self.expect("done", timeout_s)
        except TimeoutError as exc:
            await self.tell("stop")
            parts = await self.expect("done", 30)
            merged = merge_stats([p["stats"] for p in parts])
            merged["timed_out"] = str(exc) or True
            return merged
        return merge_stats([p["stats"] for p in parts])

    async def close(self) -> None:
        """Tell held sockets to close; wait for the processes to exit, and kill those that have not within
        30 s. Never raises: a process still exiting 60 s after its SIGKILL (the kernel closing its thousands
        of sockets on a busy machine) is left to :func:`kill_all`, and the others are stopped all the same
        (one that timed out used to leave the rest running through the next workloads)."""
        await self.tell("stop")
        waits = [asyncio.ensure_future(process.wait()) for process in self.processes]
        await asyncio.wait(waits, timeout=30)
        for process in self.processes:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
        await asyncio.wait(waits, timeout=60)
        for process, wait in zip(self.processes, waits, strict=True):
            if wait.done():
                _processes.discard(process)
            else:
                wait.cancel()
                print(f"client process {process.pid} has not exited 60 s after SIGKILL", file=sys.stderr)


def listen_overflows() -> int | None:
    """The kernel's count of connections dropped because an accept queue was full (system-wide)."""
    try:
        lines = [line.split() for line in Path("/proc/net/netstat").read_text().splitlines()]
    except OSError:
        return None
    for names, values in zip(lines[::2], lines[1::2], strict=False):
        if names and names[0] == "TcpExt:" and "ListenOverflows" in names:
            return int(values[names.index("ListenOverflows")])
    return None
