"""Workload 13, across hosts: two gateway hosts and a PostgreSQL host as network namespaces of this machine.

Three namespaces (``gwh-<pid>-<tag>-a``, ``-b``, ``-pg``), each with a veth pair to a bridge in the root
namespace, on a /24 of their own. The PostgreSQL host runs a throwaway cluster (tests/support/pgcluster.py's
initdb and pg_ctl, as the ``postgres`` user) on its loopback and, on its bridge address, the link's delay:
``tc qdisc ... netem`` does not exist in this kernel (neither do ``fq`` or ``etf``, so no departure-time
pacing either: the only qdiscs here are ``pfifo``, ``htb`` and ``tbf``, none of which delays a packet by a
fixed time), so a userspace TCP relay (bench/programs/relay.py) stands in for netem: it carries each
chunk it reads after ``delay_ms`` (1 ms) in each direction, in order, with no bandwidth limit. Only the
links from a gateway host to the PostgreSQL host are delayed (2 ms round trip); the callbacks come from the
root namespace over the bridge, and the subscribers sit on gateway host A, so neither is.

Gateway A and gateway B (``gateway serve`` through bench/programs/timed.py, which writes down each entry's
commit time on ``CLOCK_MONOTONIC``, one clock for every namespace of a machine) run on that PostgreSQL with
the LISTEN/NOTIFY bus. The subscribers (bench/programs/subscribers.py via ``harness.Clients``, which checks
per subscriber that versions arrive 1 by 1, and in which every K-th subscriber notes when it read each frame)
run in namespace A (``ip netns exec``). At each N, two runs, each on a task of its own: the callbacks
posted to gateway A (same host: the commit and the subscribers on one gateway), then to gateway B (across
hosts: the entry reaches A over the bus). Figure: commit-to-frame p99 across hosts, beside the same-host p99.

    python -m bench --only 13          (as root; or --smoke)

Everything it makes (namespaces, veths, the bridge, the cluster, processes) is removed at the end, however
the run ends; a run killed with SIGKILL leaves them, and the next run removes those of a process that is
gone. Not root, or no ``ip netns``: the workload says it is skipped, and why.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from bench.lib import harness
from bench.lib.harness import Clients, alive, percentile
from bench.lib.report import Report, Row, frames_summary

API_KEY = "bench-hosts-key-0123456789abcdef"
GATEWAY_PORT = 8000
PG_PORT = 5432  # the cluster's, on the PostgreSQL host's loopback
RELAY_PORT = 6432  # the relay's, on the PostgreSQL host's bridge address
NAME = re.compile(r"^gwh-(\d+)-([0-9a-f]{6})-(a|b|pg)$")


@dataclass(frozen=True)
class Run:
    subscribers: int  # on gateway A, checked for order by harness.Clients
    callbacks: int  # posted to A (same host), then as many to B (across hosts)
    rate: float

    @property
    def timed_every(self) -> int:
        """About 100 subscribers note when they read each frame (every K-th of a client process)."""
        return max(1, self.subscribers // 100)


@dataclass(frozen=True)
class Sizes:
    runs: tuple[Run, ...]
    delay_ms: float  # each way, between a gateway host and the PostgreSQL host
    procs: int
    timeout_s: float


# N = 10: the bus's hop, little fan-out; N = 1,000: with the fan-out of one process (10,000 frames/s).
FULL = Sizes(runs=(Run(10, 200, 20.0), Run(1000, 200, 10.0)), delay_ms=1.0, procs=2, timeout_s=120.0)
SMOKE = Sizes(runs=(Run(20, 40, 100.0),), delay_ms=1.0, procs=1, timeout_s=30.0)


# --- the network -------------------------------------------------------------------------------------


def ip(*args: str, check: bool = True) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result.stdout


def remove_namespace(ns: str) -> None:
    """Kill whatever runs in ``ns`` (its processes were ours: this run's or a dead run's), then delete it."""
    for pid in ip("netns", "pids", ns, check=False).split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    ip("netns", "del", ns, check=False)


def remove_stale() -> list[str]:
    """Remove the namespaces and bridges a killed run of this workload left (named by a process now gone)."""
    removed = []
    for line in ip("netns", "list", check=False).splitlines():
        match = NAME.match(line.split(" ")[0]) if line else None
        if match and not alive(int(match.group(1))):
            remove_namespace(match.group(0))
            ip("link", "del", f"gh{match.group(2)}br", check=False)
            for base in Path(tempfile.gettempdir()).glob(f"gw-hosts-*-{match.group(1)}-{match.group(2)}-*"):
                shutil.rmtree(base, ignore_errors=True)
            removed.append(match.group(0))
    return removed


class Net:
    """The bridge ``gh<tag>br`` in the root namespace (address .254) and hosts ``a`` (.1), ``b`` (.2) and
    ``pg`` (.3), each a namespace joined to it by a veth pair."""

    HOSTS: ClassVar[dict[str, int]] = {"a": 1, "b": 2, "pg": 3}

    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)
        self.bridge = f"gh{self.tag}br"
        self.subnet = self._free_subnet()
        self.made: list[str] = []

    @staticmethod
    def _free_subnet() -> str:
        used = ip("-4", "-o", "addr", check=False)
        while True:
            subnet = f"10.{secrets.choice(range(200, 250))}.{secrets.randbelow(256)}"
            if f" {subnet}." not in used:
                return subnet

    def ns(self, host: str) -> str:
        return f"gwh-{os.getpid()}-{self.tag}-{host}"

    def addr(self, host: str) -> str:
        return f"{self.subnet}.{self.HOSTS[host]}"

    def exec(self, host: str) -> list[str]:
        """The prefix that runs a command on ``host``."""
        return ["ip", "netns", "exec", self.ns(host)]

    def up(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        self.made.append(self.bridge)
        ip("addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for host in self.HOSTS:
            ns, veth = self.ns(host), f"gh{self.tag}{host[0]}"
            ip("netns", "add", ns)
            self.made.append(ns)
            ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}n", "netns", ns)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", f"{veth}n")
            ip("-n", ns, "link", "set", f"{veth}n", "up")

    def down(self) -> None:
        for name in reversed(self.made):
            if name == self.bridge:
                ip("link", "del", name, check=False)
            else:
                remove_namespace(name)
        self.made.clear()


# --- the PostgreSQL host -----------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def postgres(net: Net) -> AsyncIterator[None]:
    """A throwaway cluster on the PostgreSQL host's loopback (tests/support/pgcluster.py, run in its
    namespace)."""
    from tests.support import pgcluster

    bindir, prefix = pgcluster.postgres_bindir(), pgcluster.run_as()
    base = Path(tempfile.mkdtemp(prefix=f"gw-hosts-pg-{os.getpid()}-{net.tag}-"))
    try:
        if prefix:
            owner = pwd.getpwnam("postgres")
            os.chown(base, owner.pw_uid, owner.pw_gid)
        cluster = pgcluster.ThrowawayPostgres(bindir, base, PG_PORT, [*net.exec("pg"), *prefix])
        await cluster.initdb()
        try:
            await cluster.start()
            yield
        finally:
            if cluster.up or (cluster.data / "postmaster.pid").exists():
                with contextlib.suppress(Exception):
                    await cluster.stop("immediate")
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def spawn_ready(command: list[str], what: str, **options: Any) -> asyncio.subprocess.Process:
    process = await harness.spawn(command, stdout=asyncio.subprocess.PIPE, **options)
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 30)
    if line.strip() != b"ready":
        await harness.stop(process, 2)
        raise RuntimeError(f"{what} did not start: {line!r}")
    return process


# --- the gateway hosts -------------------------------------------------------------------------------


@dataclass
class Gateway:
    host: str
    url: str  # http://address:port
    process: asyncio.subprocess.Process
    commits: Path  # bench/programs/timed.py's file: "<monotonic ns> <version> <task id>" a line

    def commit_times(self, task_id: str) -> dict[int, int]:
        times = {}
        for line in self.commits.read_text().splitlines():
            ns, version, task = line.split(" ", 2)
            if task == task_id:
                times[int(version)] = int(ns)
        return times


@contextlib.asynccontextmanager
async def gateway(net: Net, host: str, database_url: str, tmp: Path) -> AsyncIterator[Gateway]:
    address = net.addr(host)
    commits, log_path = tmp / f"commits-{host}", tmp / f"gateway-{host}.log"
    command = [*net.exec(host), *harness.program("timed", "serve")]
    command += ["--host", address, "--port", str(GATEWAY_PORT), "--database-url", database_url]
    env = harness.gateway_env("postgres", {"GATEWAY_API_KEY": API_KEY, "BENCH_COMMIT_TIMES": str(commits)})
    with log_path.open("wb") as log:
        process = await harness.spawn(command, env=env, stderr=log)
    url = f"http://{address}:{GATEWAY_PORT}"
    try:
        await harness.wait_http(url, process=process)
        yield Gateway(host, url, process, commits)
    finally:
        await harness.stop(process)
        harness.summarize_log(GATEWAY_PORT, log_path.read_text(errors="replace"))


# --- the workload ------------------------------------------------------------------------------------


@dataclass
class Case:
    """One run's task, on gateway ``reader``, with its subscribers and timed subscribers connected."""

    reader: Gateway
    task_id: str
    made: dict[str, Any]
    final: int
    clients: Clients


async def prepare(
    stack: contextlib.AsyncExitStack, net: Net, reader: Gateway, run: Run, sizes: Sizes
) -> Case:
    """A task on ``reader`` and its subscribers (both kinds) on ``reader``'s host, connected."""
    import httpx

    from bench.workloads import fanout

    task_id = f"hosts-{uuid.uuid4().hex[:8]}"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=reader.url, timeout=60, headers=headers) as http:
        made = await fanout.create_task(http, task_id, fanout.attempts_for(run.callbacks))
    start = made["task"]["version"]
    final = start + len(fanout.plan(run.callbacks))
    ws = reader.url.replace("http://", "ws://")
    url = f"{ws}/v1/tasks/{task_id}/ws?cursor={start}&token={made['subscribeToken']}"
    clients = await Clients.start(
        [(url, run.subscribers, "caught-up")],
        procs=sizes.procs,
        stream=True,
        final=final,
        expect_close=1000,
        timeout_s=sizes.timeout_s,
        prefix=net.exec(reader.host),
        timed_every=run.timed_every,
    )
    stack.push_async_callback(clients.close)
    await clients.connect(sizes.timeout_s)
    return Case(reader, task_id, made, final, clients)


async def drive(case: Case, writer: Gateway, run: Run, sizes: Sizes) -> dict[str, Any]:
    """The callbacks of ``case``'s task posted to ``writer`` (from this namespace): commit-to-frame times at
    the timed subscribers, and the subscribers' counts."""
    import httpx

    from bench.workloads import fanout

    side = "same-host" if writer is case.reader else "across-hosts"
    async with (
        harness.profiled(case.reader.process.pid, f"hosts-{run.subscribers}-{side}-gateway-a"),
        httpx.AsyncClient(base_url=writer.url, timeout=60) as http,
    ):
        token, events = case.made["callbackToken"], fanout.plan(run.callbacks)
        posted = await fanout.post_callbacks(http, case.task_id, token, events, run.rate)
        stats = await case.clients.done(sizes.timeout_s)
    commits = writer.commit_times(case.task_id)
    received: dict[int, list[int]] = stats.pop("received", {})
    latencies = [(ns - commits[v]) / 1e6 for v, times in received.items() if v in commits for ns in times]
    return {
        **stats,
        "latencies_ms": latencies,
        "timed": sum(len(times) for times in received.values()),
        "untimed": sum(len(times) for v, times in received.items() if v not in commits),
        "posted": posted["posted"],
        "callback_p99_ms": posted["callback_p99_ms"],
    }


def why_not() -> str | None:
    """Why this machine cannot run the workload (None: it can)."""
    if os.geteuid() != 0:
        return "not root: network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    from tests.support import pgcluster

    try:
        pgcluster.check()
    except pgcluster.ClusterUnavailable as exc:
        return f"no PostgreSQL cluster can be made here: {exc}"
    return None


async def workload(cfg: Any, servers: Any, report: Report) -> None:
    sizes: Sizes = cfg.hosts
    reason = why_not()
    net = None
    if reason is None:
        for name in remove_stale():
            print(f"removed namespace {name}, left by a run that was killed", file=sys.stderr)
        try:
            net = Net()
            net.up()
        except RuntimeError as exc:
            reason = f"cannot make network namespaces here ({exc})"
            if net is not None:
                net.down()
            net = None
    if net is None:
        report.rows.append(Row(13, f"across hosts: skipped ({reason})", None, None, "", "-"))
        report.details.append(f"across hosts: skipped: {reason}")
        return
    try:
        results = await measure(net, sizes)
    finally:
        net.down()
    add_rows(report, sizes, results)


async def round_trips(database_url: str, count: int = 50) -> list[float]:
    """``SELECT 1`` through the relay from the root namespace (over the bridge, undelayed): what a round trip
    to the PostgreSQL host costs, in ms (2 x the delay, plus the relay's own scheduling)."""
    import asyncpg  # type: ignore[import-untyped]  # no stubs, no py.typed (as in gateway/store/database.py)

    conn = await asyncpg.connect(database_url, timeout=10)
    try:
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            await conn.fetchval("SELECT 1")
            times.append((time.perf_counter() - t0) * 1000)
        return times
    finally:
        await conn.close()


async def measure(net: Net, sizes: Sizes) -> dict[str, dict[str, Any]]:
    relay_cmd = [*net.exec("pg"), *harness.program("relay", net.addr("pg"), str(RELAY_PORT), str(PG_PORT))]
    relay_cmd.append(str(sizes.delay_ms))
    database_url = f"postgresql://postgres@{net.addr('pg')}:{RELAY_PORT}/postgres"
    results: dict[str, dict[str, Any]] = {}
    phases: dict[str, float] = {}
    t0 = time.monotonic()

    def phase(name: str) -> None:
        nonlocal t0
        phases[name], t0 = time.monotonic() - t0, time.monotonic()

    # Whatever fails half-way (a gather whose other half is still starting) is ended by Net.down, which
    # kills every process left in the namespaces.
    async with contextlib.AsyncExitStack() as stack:
        prefix = f"gw-hosts-run-{os.getpid()}-{net.tag}-"  # a killed run's: removed by remove_stale
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
        await stack.enter_async_context(postgres(net))
        relay = await spawn_ready(relay_cmd, "the delaying relay")
        stack.push_async_callback(harness.stop, relay, 2)
        phase("PostgreSQL host")
        a, b = await asyncio.gather(
            stack.enter_async_context(gateway(net, "a", database_url, tmp)),
            stack.enter_async_context(gateway(net, "b", database_url, tmp)),
        )
        phase("gateways")
        results["link"] = {"rtt_ms": await round_trips(database_url)}
        for run in sizes.runs:
            # Both tasks' subscribers connect together (their processes' start is most of a smoke run's
            # time) and stay until the end; the callbacks of one are posted after the other's are done.
            async with contextlib.AsyncExitStack() as clients:
                same, across = await asyncio.gather(
                    prepare(clients, net, a, run, sizes), prepare(clients, net, a, run, sizes)
                )
                phase(f"N={run.subscribers} subscribers")
                results[f"{run.subscribers} same host"] = await drive(same, a, run, sizes)
                results[f"{run.subscribers} across hosts"] = await drive(across, b, run, sizes)
            phase(f"N={run.subscribers} callbacks")
    phase("stopping")
    results["phases"] = phases
    return results


def add_rows(report: Report, sizes: Sizes, results: dict[str, dict[str, Any]]) -> None:
    rtt = results["link"]["rtt_ms"]
    report.details.append(
        f"across hosts: the link's stand-in (a TCP relay delaying each chunk {sizes.delay_ms:g} ms each way; "
        f"tc netem is not in this kernel): a `SELECT 1` round trip to the PostgreSQL host through it took "
        f"p50 {percentile(rtt, 0.5):.2f} ms, p99 {percentile(rtt, 0.99):.2f} ms ({len(rtt)} of them); "
        f"subscribers in {sizes.procs} client processes on host A; time taken: "
        + ", ".join(f"{name} {took:.1f} s" for name, took in results["phases"].items())
    )
    for run in sizes.runs:
        n = run.subscribers
        same, across = results[f"{n} same host"], results[f"{n} across hosts"]
        for q in (0.5, 0.99):
            report.rows.append(
                Row(
                    13,
                    f"across hosts N={n:,}: commit-to-frame p{q * 100:g}, commit on B, frame at A's "
                    f"subscriber (floor: commit and subscriber on A; {sizes.delay_ms:g} ms each way to "
                    "PostgreSQL)",
                    percentile(across["latencies_ms"], q),
                    percentile(same["latencies_ms"], q),
                    "ms",
                    "(reported beside the same-host figure)",
                    2,
                )
            )
        report.rows.append(
            Row(
                13,
                f"across hosts N={n:,}: frames lost + out of order (floor: same host)",
                across["lost"] + across["out_of_order"],
                same["lost"] + same["out_of_order"],
                "",
                "0",
                0,
                ratio=float("nan"),
            )
        )
        for name, result in (("same host", same), ("across hosts", across)):
            what = f"across hosts N={n} {name}"
            report.figure(f"{what} commit-to-frame p99", percentile(result["latencies_ms"], 0.99))
            report.frames(what, result)
            if result["untimed"]:
                report.problems.append(f"{what}: {result['untimed']} frames read with no commit time")
            times = result["latencies_ms"]
            who = "every subscriber" if run.timed_every == 1 else f"every {run.timed_every}th subscriber"
            report.details.append(
                f"across hosts N={n:,}, {name}: {result['posted']} callbacks at {run.rate:g}/s, "
                f"{len(times):,} frames timed ({who} of a client process notes when it read each), "
                f"commit-to-frame p50 {percentile(times, 0.5):.2f} ms, p99 "
                f"{percentile(times, 0.99):.2f} ms, max {max(times, default=0):.2f} ms; callback p99 "
                f"{result['callback_p99_ms']:.1f} ms; {frames_summary(result)}"
            )
