"""Processes for the tests that run the gateway as it is deployed, and the clients that outlive them.

- :func:`gateway_processes` and :func:`spawn_gateway`: ``gateway serve`` as subprocesses (several on one
  database, or one with ``--workers N``), each one's output in a file under the test's ``tmp_path``;
- :class:`RoundRobinBalancer`: a loopback TCP load balancer in front of several gateways;
- :func:`throwaway_postgres`: a PostgreSQL cluster of the test's own that it may stop and start (never this
  machine's shared one; tests/support/pgcluster.py makes it);
- :class:`ResumingSubscriber` and :class:`CallbackPoster`: a subscriber that reconnects by itself with its
  cursor, and a worker that posts each callback again, same id and body, until it is answered.

Every process a helper starts is stopped when its block ends, failure or not; when a block ends with an
exception, the tail of each process's output is printed (pytest shows it under the failing test).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NoReturn, Protocol
from urllib.parse import quote, urlencode

import anyio
import anyio.abc
import httpx
import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from gateway.machine import TERMINAL
from tests.integration.test_live_support import STEP_S, StreamCheck, loads
from tests.support import GATEWAY_CLI, bearer, pgcluster
from tests.support import START_S as SERVER_START_S
from tests.support.history import History
from tests.support.pgcluster import ThrowawayPostgres
from tests.support.pgcluster import free_port as free_port  # the tests take it from here

# One secret for every process of a test: a token any of them issued works on all of them.
SECRET = "process-test-secret-0123456789abcdef0123"
# How long a gateway process may take to serve (imports, the migration lock, the bus) on a busy machine: as
# long as a server in the test's own process (beside two CPU burners and other tests, load 20 on 2 cores, a
# start that fails at once took 25-28 s, and two starts missed the 30 s this was).
START_S = SERVER_START_S
# How long a stopped gateway may take to exit before it is killed.
STOP_S = 10.0
POLL_S = 0.02

SERVING = re.compile(rb"Uvicorn running on http://127\.0\.0\.1:(\d+)")
STARTED = re.compile(rb"Started server process \[(\d+)\]")
STARTUP_COMPLETE = re.compile(rb"Application startup complete")
# The line `gateway serve` says at start with the dashboard's address (the gateway's URL, without its "/").
DASHBOARD = re.compile(rb"gateway: dashboard at (http://\S+)/")


def unavailable(message: str) -> NoReturn:
    """Skip, saying why; in CI (``CI`` set), fail instead: CI must run every test."""
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI must run every test)")
    pytest.skip(message)


async def redis_or_skip(url: str) -> None:
    client = Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
    try:
        await client.ping()
    except (RedisError, OSError) as exc:
        unavailable(f"Redis is not reachable at {url} ({exc}); start it to run this test")
    finally:
        await client.aclose()


# --- gateway processes --------------------------------------------------------------------------------------


def gateway_environ(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment less its ``GATEWAY_*`` variables, plus the shared secret, info logs and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env["GATEWAY_SECRET"] = SECRET
    env["GATEWAY_LOG_LEVEL"] = "info"
    env.update(extra or {})
    return env


class GatewayProcess:
    """One ``gateway serve`` subprocess; its stdout and stderr together in ``log``."""

    def __init__(self, name: str, process: anyio.abc.Process, log: Path) -> None:
        self.name = name
        self.process = process
        self.log = log
        self.port = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.process.returncode is None

    def output(self) -> str:
        return self.log.read_bytes().decode(errors="replace")

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output().splitlines()[-lines:])

    async def wait_for(
        self, pattern: re.Pattern[bytes], count: int = 1, timeout_s: float = START_S
    ) -> list[re.Match[bytes]]:
        """Wait until the output shows ``pattern`` ``count`` times; the process must keep running."""
        found: list[re.Match[bytes]] = []
        with anyio.move_on_after(timeout_s):
            while True:
                found = list(pattern.finditer(await anyio.Path(self.log).read_bytes()))
                if len(found) >= count:
                    return found
                if self.process.returncode is not None:
                    raise AssertionError(
                        f"{self.name} exited with {self.process.returncode} before its output showed "
                        f"{pattern.pattern!r}:\n{self.tail()}"
                    )
                # A child's log has nothing to wait on but reading it again.
                await anyio.sleep(POLL_S)
        raise AssertionError(
            f"{self.name}: {pattern.pattern!r} {count} times not seen within {timeout_s}s "
            f"(seen {len(found)}):\n{self.tail()}"
        )

    async def serving(self) -> None:
        """Wait until it serves, and learn its port from ``Uvicorn running on http://127.0.0.1:PORT``."""
        self.port = int((await self.wait_for(SERVING))[-1].group(1))

    def started_pids(self) -> list[int]:
        """The pids of the server processes its output announced (``Started server process [PID]``)."""
        return [int(m.group(1)) for m in STARTED.finditer(self.log.read_bytes())]

    async def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer would; returns once it is gone."""
        self.process.kill()
        with anyio.fail_after(STOP_S):
            await self.process.wait()

    async def stop(self, sig: signal.Signals = signal.SIGTERM) -> int:
        """Stop it with ``sig`` (SIGKILL past ``STOP_S``), then any server process it announced that is left
        (the workers of a killed ``--workers`` parent). Shielded: it runs to its end even in a cancelled
        test. Returns the exit code."""
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                self.process.send_signal(sig)
                with anyio.move_on_after(STOP_S):
                    await self.process.wait()
            if self.process.returncode is None:
                self.process.kill()
                await self.process.wait()
            await self.process.aclose()
            for pid in self.started_pids():
                if pid != self.pid and alive(pid) and b"multiprocessing" in _cmdline(pid):
                    os.kill(pid, signal.SIGKILL)
        returncode = self.process.returncode
        assert returncode is not None
        return returncode


async def spawn_gateway(
    name: str,
    database_url: str,
    log: Path,
    *,
    env: dict[str, str] | None = None,
    port: int = 0,
    args: Sequence[str] = (),
    stdout: Path | None = None,
    nofile: int | None = None,
) -> GatewayProcess:
    """Start ``gateway serve`` (not waiting for it to serve); the caller stops it. Its stdout and stderr go
    to ``log``, or its stderr alone when ``stdout`` names a file of its own; ``nofile``: its descriptor limit
    (soft and hard, with util-linux's ``prlimit``), which its workers inherit."""
    command = [*GATEWAY_CLI, "serve", "--port", str(port), "--database-url", database_url, *args]
    if nofile is not None:
        command = ["prlimit", f"--nofile={nofile}:{nofile}", "--", *command]
    with log.open("wb") as err, (stdout or log).open("ab") as out:
        process = await anyio.open_process(
            command,
            stdout=out,
            stderr=err if stdout is not None else subprocess.STDOUT,
            env=gateway_environ(env),
            cwd=log.parent,
        )
    return GatewayProcess(name, process, log)


def print_tails(gateways: Iterable[GatewayProcess]) -> None:
    for gw in gateways:
        print(f"\n----- {gw.name} (pid {gw.pid}, exit {gw.process.returncode}): {gw.log} -----\n{gw.tail()}")


@asynccontextmanager
async def gateway_processes(
    count: int, database_url: str, directory: Path, *, env: dict[str, str] | None = None, name: str = "gw"
) -> AsyncIterator[list[GatewayProcess]]:
    """``count`` gateway processes on one database, started together and serving when the block begins;
    all stopped when it ends (their output tails printed if it failed)."""
    gateways: list[GatewayProcess] = []
    failed = False
    try:
        for i in range(count):
            gateways.append(
                await spawn_gateway(f"{name}{i}", database_url, directory / f"{name}{i}.log", env=env)
            )
        for gw in gateways:
            await gw.serving()
        yield gateways
    except BaseException:
        failed = True
        raise
    finally:
        with anyio.CancelScope(shield=True):
            async with anyio.create_task_group() as tg:
                for gw in gateways:
                    tg.start_soon(gw.stop)
        if failed:
            print_tails(gateways)


# --- processes seen from /proc ------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def socket_owner(server_port: int, client_port: int, pids: Iterable[int]) -> int | None:
    """Which of ``pids`` holds the server's end of the loopback TCP connection from ``client_port`` to
    ``server_port`` (Linux: the socket's inode in ``/proc/net/tcp``, then the process with it open)."""
    local, remote = f"0100007F:{server_port:04X}", f"0100007F:{client_port:04X}"
    inode = None
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1] == local and fields[2] == remote:
            inode = fields[9]
            break
    if inode is None or inode == "0":
        return None
    target = f"socket:[{inode}]"
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                        return pid
    return None


# --- a round-robin TCP load balancer ------------------------------------------------------------------------


class _Pipe:
    __slots__ = ("backend", "streams", "websocket")

    def __init__(self, backend: int, streams: tuple[anyio.abc.SocketStream, anyio.abc.SocketStream]) -> None:
        self.backend = backend
        self.streams = streams
        self.websocket = False


class RoundRobinBalancer:
    """A loopback TCP load balancer, as a deployment puts in front of several gateway processes.

    Each new client connection goes to the next backend in turn that accepts a TCP connection (one that
    refuses is skipped; with none left the client is closed); bytes are piped both ways, and closing either
    side closes both. It knows which open connections are WebSocket upgrades, and to which backend."""

    def __init__(self, ports: Sequence[int]) -> None:
        self.ports = list(ports)
        self.port = 0
        self.routed: Counter[int] = Counter()  # connections sent to each backend, ever
        self.refused: Counter[int] = Counter()  # connection attempts a backend refused
        self._next = 0
        self._pipes: set[_Pipe] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def websockets(self) -> Counter[int]:
        """Open WebSocket connections by backend port."""
        return Counter(p.backend for p in self._pipes if p.websocket)

    def connections(self) -> Counter[int]:
        """Open connections of any kind by backend port."""
        return Counter(p.backend for p in self._pipes)

    def busiest(self) -> int:
        """The backend with the most open WebSocket connections (then the most connections of any kind)."""
        sockets, every = self.websockets(), self.connections()
        return max(self.ports, key=lambda port: (sockets[port], every[port]))

    async def _connect(self) -> tuple[int, anyio.abc.SocketStream] | None:
        for _ in range(len(self.ports)):
            port = self.ports[self._next % len(self.ports)]
            self._next += 1
            try:
                with anyio.fail_after(STEP_S):
                    return port, await anyio.connect_tcp("127.0.0.1", port)
            except (OSError, TimeoutError):
                self.refused[port] += 1
        return None

    async def handle(self, client: anyio.abc.SocketStream) -> None:
        """Serve one client connection (the listener's handler)."""
        async with client:
            found = await self._connect()
            if found is None:
                return
            port, server = found
            self.routed[port] += 1
            pipe = _Pipe(port, (client, server))
            self._pipes.add(pipe)
            try:
                async with server, anyio.create_task_group() as tg:
                    tg.start_soon(self._copy, pipe, client, server, tg.cancel_scope)
                    tg.start_soon(self._copy, pipe, server, client, tg.cancel_scope)
            finally:
                self._pipes.discard(pipe)

    @staticmethod
    async def _copy(
        pipe: _Pipe, src: anyio.abc.SocketStream, dst: anyio.abc.SocketStream, both: anyio.CancelScope
    ) -> None:
        first = src is pipe.streams[0]
        try:
            async for data in src:
                if first:
                    first = False
                    head = data.lower()
                    pipe.websocket = head.startswith(b"get ") and b"upgrade: websocket" in head
                await dst.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        both.cancel()  # one side is done: the pipe closes both (the streams close as the blocks end)


@asynccontextmanager
async def round_robin_balancer(ports: Sequence[int]) -> AsyncIterator[RoundRobinBalancer]:
    """A :class:`RoundRobinBalancer` on a free loopback port for the block; each pipe closed at its end."""
    balancer = RoundRobinBalancer(ports)
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    balancer.port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as tg:
        tg.start_soon(listener.serve, balancer.handle)
        try:
            yield balancer
        finally:
            tg.cancel_scope.cancel()


# --- a throwaway PostgreSQL cluster -------------------------------------------------------------------------


@asynccontextmanager
async def throwaway_postgres(settings: Mapping[str, str] | None = None) -> AsyncIterator[ThrowawayPostgres]:
    """:func:`tests.support.pgcluster.throwaway_postgres`, the test skipped (failed in CI) where no cluster
    can be made."""
    try:
        pgcluster.check()
    except pgcluster.ClusterUnavailable as exc:
        unavailable(f"{exc}: this test needs a PostgreSQL cluster of its own")
    async with pgcluster.throwaway_postgres(settings) as cluster:
        yield cluster


# --- clients that outlive a process going away --------------------------------------------------------------


# Close codes after which a subscriber comes back: a drop (1006, or no close at all), a server going away
# (1001), the database unreachable for a new subscription (1013).
RECONNECT_CODES = (None, 1001, 1006, 1013)


class Ready(Protocol):
    """A client that runs until done, and says once it holds its first frame."""

    ready: anyio.Event

    async def run(self) -> None: ...


async def start_all(tg: anyio.abc.TaskGroup, clients: Sequence[Ready]) -> None:
    """Start every client's run in ``tg`` and wait until each is ready."""
    for client in clients:
        tg.start_soon(client.run)
    with anyio.fail_after(STEP_S):
        for client in clients:
            await client.ready.wait()


class ResumingSubscriber:
    """One task's subscriber over ``/v1/tasks/{id}/ws`` that reconnects by itself after a drop with
    ``?cursor=<last version seen>``.

    Each connection's frames go through :class:`StreamCheck` from the state held so far: a resume frame
    that fits the cursor (``caught-up`` at it, a ``delta`` from cursor + 1, replayed on the state held, or a
    ``snapshot``), then ``event`` frames at exactly last + 1, each replayed on the machine. A gap, a repeat
    or a refusal (4xxx) fails it. It returns once it holds a terminal state and the gateway closed with
    1000."""

    def __init__(
        self,
        ws_base: str,
        task_id: str,
        token: str,
        base: dict[str, Any],
        *,
        retention: int | None = None,
        reconnect_delay_s: float = 0.1,
        history: History | None = None,
        name: str | None = None,
    ) -> None:
        self.ws_base = ws_base
        self.history = history
        self.name = name or f"subscriber-{id(self):x}"
        self.task_id = task_id
        self.token = token
        self.retention = retention
        self.reconnect_delay_s = reconnect_delay_s
        self.task = base
        self.version: int = base["version"]
        self.connections = 0  # connections that opened
        self.failed_opens = 0  # handshakes that failed (nothing listening, closed by the balancer)
        self.resumes: list[str] = []  # each connection's resume frame type
        self.events: list[int] = []  # versions of the event frames, over every connection
        self.closes: list[int | None] = []
        self.ready = anyio.Event()  # set at the first resume frame

    def url(self) -> str:
        query = urlencode({"cursor": self.version, "token": self.token})
        return f"{self.ws_base}/v1/tasks/{quote(self.task_id, safe='')}/ws?{query}"

    async def run(self, within_s: float = 30.0) -> None:
        """Follow the task to its end, reconnecting as needed; fails, saying where it stands, past
        ``within_s``."""
        with anyio.move_on_after(within_s):
            await self._follow()
            return
        raise AssertionError(
            f"{self.task_id}: not at its end within {within_s}s: at version {self.version} "
            f"({self.task['state']}) after {self.connections} connections, closes {self.closes}, "
            f"{self.failed_opens} failed opens"
        )

    async def _follow(self) -> None:
        while True:
            check = StreamCheck(self.task_id, self.version, base=self.task, retention=self.retention)
            code: int | None = None
            try:
                async with connect(self.url(), open_timeout=STEP_S, close_timeout=2) as ws:
                    self.connections += 1
                    try:
                        async for raw in ws:
                            frame = loads(raw)
                            if self.history is not None:
                                self.history.frame(self.name, frame, self.task_id)
                            check.feed(frame)
                            if len(check.types) == 1:
                                self.resumes.append(frame["type"])
                                self.ready.set()
                            elif frame["type"] == "event":
                                self.events.append(frame["version"])
                            assert check.task is not None
                            self.task, self.version = check.task, check.version
                    except ConnectionClosed:
                        pass
                    code = ws.close_code
            except (OSError, TimeoutError, InvalidHandshake):
                self.failed_opens += 1
            self.closes.append(code)
            if code == 1000:
                assert self.task["state"] in TERMINAL, (
                    self.task_id,
                    "closed with 1000 before the end",
                    self.task,
                )
                return
            assert code in RECONNECT_CODES, (self.task_id, f"closed with {code}", self.closes)
            await anyio.sleep(self.reconnect_delay_s)  # a reconnect's backoff

    def assert_final(self, task: dict[str, Any]) -> None:
        """It ends holding exactly ``task`` (as read from the store), having seen every version after its
        first cursor once, through an event or a resume frame."""
        assert self.task == task, (self.task_id, self.task, task)
        assert self.version == task["version"], (self.task_id, self.version, task["version"])
        assert self.closes[-1] == 1000, (self.task_id, self.closes)


def task_callbacks(task_id: str, progress: Iterable[int]) -> list[tuple[str, dict[str, Any], bool]]:
    """One worker's run of a task: ``(callbackId, event, fenced)`` for start, rising progress, succeed. The
    callback ids are unique per task id (they are global in the gateway) and every event is distinct."""
    calls: list[tuple[str, dict[str, Any], bool]] = [
        (f"{task_id}/start", {"type": "start", "worker": f"worker-{task_id}"}, False)
    ]
    for p in progress:
        calls.append((f"{task_id}/p{p}", {"type": "progress", "progress": p, "cursor": f"row-{p}"}, True))
    succeed = {"type": "succeed", "resultRef": f"s3://results/{task_id}", "resultHash": f"sha256:{task_id}"}
    calls.append((f"{task_id}/done", succeed, True))
    return calls


class CallbackPoster:
    """A worker's callbacks to one task: each logical callback has a stable ``callbackId`` and is posted
    again (same id, same body) after a connection error, a timeout or a 5xx until it is answered 2xx (an
    answer with ``"duplicateCallback": true`` is one that an earlier try applied). A 4xx fails it.

    ``url`` picks the gateway for each try; past ``give_up_s`` without a 2xx it fails. Every answer is
    counted; 5xx answers other than ``503`` and ``503`` answers without ``Retry-After`` are kept for the test
    to assert on."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        task_id: str,
        token: str,
        url: Callable[[], str],
        *,
        timeout_s: float = 5.0,
        retry_delay_s: float = 0.05,
        give_up_s: float = 30.0,
        history: History | None = None,
    ) -> None:
        self.client = client
        self.history = history
        self.task_id = task_id
        self.token = token
        self.url = url
        self.timeout_s = timeout_s
        self.retry_delay_s = retry_delay_s
        self.give_up_s = give_up_s
        self.attempt: int | None = None
        self.applied: list[tuple[str, dict[str, Any]]] = []  # (callbackId, event) answered 2xx, in order
        self.duplicates = 0  # 2xx answers with duplicateCallback: true
        self.answers: Counter[str] = Counter()  # by status, and "transport" for an error or a timeout
        self.posted_to: Counter[str] = Counter()
        self.server_errors: list[str] = []  # 5xx other than 503
        self.no_retry_after: list[str] = []  # 503 without a Retry-After header
        self.unavailable = anyio.Event()  # set at the first 503

    async def post(self, callback_id: str, event: dict[str, Any], *, fenced: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"callbackId": callback_id, "event": event}
        if fenced and self.attempt is not None:
            body["attempt"] = self.attempt
        path = f"/v1/tasks/{quote(self.task_id, safe='')}/callbacks"
        give_up = anyio.current_time() + self.give_up_s
        while True:
            assert anyio.current_time() < give_up, (
                f"{callback_id}: no 2xx within {self.give_up_s}s; answers so far {dict(self.answers)}, "
                f"5xx {self.server_errors[-3:]}"
            )
            base = self.url()
            self.posted_to[base] += 1
            delay = self.retry_delay_s
            try:
                answer = await self.client.post(
                    base + path, json=body, headers=bearer(self.token), timeout=self.timeout_s
                )
            except httpx.TransportError:
                self.answers["transport"] += 1
                if self.history is not None:
                    self.history.callback(self.task_id, callback_id, event, None)
                await anyio.sleep(delay)
                continue
            self.answers[str(answer.status_code)] += 1
            if answer.status_code < 300:
                result: dict[str, Any] = answer.json()
                if self.history is not None:
                    self.history.callback(self.task_id, callback_id, event, answer.status_code, result)
                self.applied.append((callback_id, event))
                self.duplicates += bool(result.get("duplicateCallback"))
                return result
            if self.history is not None:
                self.history.callback(self.task_id, callback_id, event, answer.status_code)
            if answer.status_code < 500:
                raise AssertionError(f"{callback_id} refused: {answer.status_code} {answer.text}")
            if answer.status_code == 503:
                self.unavailable.set()
                retry_after = answer.headers.get("retry-after")
                if retry_after is None:
                    self.no_retry_after.append(answer.text)
                else:
                    delay = min(float(retry_after), 1.0)
                assert answer.json()["error"]["code"] == "unavailable", answer.text
            else:
                self.server_errors.append(f"{answer.status_code} {answer.text}")
            await anyio.sleep(delay)

    async def run(
        self,
        calls: Sequence[tuple[str, dict[str, Any], bool]],
        *,
        pace_s: float = 0.0,
        after_each: Callable[[], object] | None = None,
    ) -> None:
        """Post ``calls`` in order, each once answered, ``pace_s`` apart (a worker's pace, not a wait for
        anything); the start's answer sets the attempt that fences the rest."""
        for i, (callback_id, event, fenced) in enumerate(calls):
            if i and pace_s:
                await anyio.sleep(pace_s)
            answer = await self.post(callback_id, event, fenced=fenced)
            if event["type"] == "start":
                assert answer["task"]["state"] == "running", answer
                self.attempt = answer["task"]["attempts"]
            if after_each is not None:
                after_each()


def assert_history_is(history: dict[str, Any], applied: Sequence[tuple[str, dict[str, Any]]]) -> None:
    """A task's whole history (``GET /v1/tasks/{id}/events?cursor=0``, a delta) holds each applied
    callback's event exactly once, in the order they were answered, and nothing else."""
    assert history["mode"] == "delta", history
    entries = history["events"]
    assert [e["version"] for e in entries] == list(range(1, len(entries) + 1)), entries
    events = [{k: v for k, v in e["event"].items() if k != "atMs"} for e in entries]
    for callback_id, event in applied:
        assert events.count(event) == 1, (callback_id, event, events)
    assert events == [event for _, event in applied], events
