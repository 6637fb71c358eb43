"""Test support: a real uvicorn server on a free loopback port, a controllable clock, databases."""

from __future__ import annotations

import asyncio
import functools
import os
import ssl
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import anyio
import httpx
import jwt
import uvicorn
from starlette.applications import Starlette

from gateway import Settings, create_app
from gateway.client.backend import LIMITS
from gateway.runtime import Gateway
from gateway.server.serve import GatewayServer, server_config
from gateway.store.base import Store, WriteTx
from tests.support.databases import PG_ADMIN_URL as PG_ADMIN_URL
from tests.support.databases import pg_admin as pg_admin
from tests.support.databases import postgres_database as postgres_database
from tests.support.databases import postgres_or_skip as postgres_or_skip

SECRET = "test-secret-0123456789abcdef0123456789"

# The ``gateway`` command of the interpreter running the tests (its venv), never a path of one machine.
GATEWAY_CLI = [sys.executable, "-m", "gateway.cli"]


# Bounds one wait for something expected to happen promptly (a frame, a close, a counter catching up): room
# for a loaded machine (the suite runs on several processes, two a core, perhaps beside other work), yet a
# hang fails the test in seconds. GATEWAY_TESTS_TIMEOUT_FACTOR scales it (and START_S) on a slower machine,
# as websockets' WEBSOCKETS_TESTS_TIMEOUT_FACTOR does: a test that passes takes no longer for it.
TIMEOUT_FACTOR = float(os.environ.get("GATEWAY_TESTS_TIMEOUT_FACTOR", "1"))
STEP_S = 20.0 * TIMEOUT_FACTOR
# Bounds a server's start or stop in the test's own process: imports, a migration check, the lifespan.
START_S = 60.0 * TIMEOUT_FACTOR

T = TypeVar("T")


# --- waiting for an outcome -------------------------------------------------------------------------------
#
# An outcome made by something asynchronous (the hub letting go of a connection, a counter a background task
# increments after an answer went out, a line another process logs, a commit on the sweeper's thread) is
# awaited, never read once right after the action that leads to it: what merely tends to come first on one
# machine comes second on another. Each wait has a deadline and says what it waited for.


def _describe(what: str | Callable[[], str]) -> str:
    return what if isinstance(what, str) else what()


async def wait_until(
    condition: Callable[[], bool], what: str | Callable[[], str], within_s: float = STEP_S
) -> None:
    """Poll a cheap, non-blocking ``condition`` (a counter, the hub's stats, a file another process writes)
    until it holds; past ``within_s``, fail saying ``what`` was awaited (a callable: the words are made then,
    with the state at that moment). It waits for the condition itself, never for a guessed duration."""
    with anyio.move_on_after(within_s):
        while not condition():  # noqa: ASYNC110  (no event to wait on: the state is someone else's)
            await anyio.sleep(0.01)
        return
    if not condition():
        raise AssertionError(f"not within {within_s} s: {_describe(what)}")


async def eventually(
    probe: Callable[[], Awaitable[T]],
    accept: Callable[[T], bool],
    what: str,
    within_s: float = STEP_S,
    *,
    poll_s: float = 0.02,
) -> T:
    """Await ``probe()`` (a request to the gateway, a read of its database) until ``accept`` holds for what
    it returns, and return that; past ``within_s``, fail saying ``what`` was awaited and the last value
    seen."""
    seen: list[T] = []
    with anyio.move_on_after(within_s):
        while True:
            value = await probe()
            if accept(value):
                return value
            seen[:] = [value]
            await anyio.sleep(poll_s)
    last = repr(seen[0]) if seen else "nothing"
    raise AssertionError(f"not within {within_s} s: {what} (last seen: {last[:2000]})")


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def mint(
    sub: str, scope: str = "subscribe", *, exp_in_s: int = 3_600, secret: str = SECRET, **claims: Any
) -> str:
    """A token as a backend holding ``GATEWAY_SECRET`` would make it (protocol.md, Tokens)."""
    payload: dict[str, Any] = {"sub": sub, "scope": scope, "exp": int(time.time()) + exp_in_s, **claims}
    return jwt.encode(payload, secret, algorithm="HS256")


def mint_tag(tag: str, *, exp_in_s: int = 3_600, secret: str = SECRET, **claims: Any) -> str:
    """A tag token as a backend holding ``GATEWAY_SECRET`` would make it (protocol.md, Credentials)."""
    payload: dict[str, Any] = {"tag": tag, "scope": "subscribe", "exp": int(time.time()) + exp_in_s, **claims}
    return jwt.encode(payload, secret, algorithm="HS256")


async def issue_tag_token(
    gw_or_client: Running | httpx.AsyncClient, tag: str, *, headers: dict[str, str] | None = None
) -> str:
    """A tag token from ``POST /v1/tokens`` (with ``headers``: the API key, where one is configured)."""
    answer = await _client(gw_or_client).post("/v1/tokens", json={"tag": tag}, headers=headers)
    assert answer.status_code == 201, answer.text
    token: str = answer.json()["token"]
    return token


def error(answer: httpx.Response, status: int, code: str) -> str:
    """Check an error answer's status and shape (protocol.md, Errors: a ``not-running`` and a
    ``parent-ended`` carry the task beside the error); return its message."""
    assert answer.status_code == status, answer.text
    body = answer.json()
    shape = {"error", "task"} if code in ("not-running", "parent-ended") else {"error"}
    assert set(body) == shape and set(body["error"]) == {"code", "message"}, body
    assert body["error"]["code"] == code, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    message: str = body["error"]["message"]
    return message


class FakeClock:
    """Epoch milliseconds that move only when a test says so."""

    def __init__(self, now: int = 1_700_000_000_000) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> None:
        self.now += ms


@dataclass
class Running:
    url: str
    app: Starlette
    client: httpx.AsyncClient

    @property
    def gateway(self) -> Gateway:
        gateway = self.app.state.gateway
        assert isinstance(gateway, Gateway)
        return gateway


@asynccontextmanager
async def serve(app: Starlette) -> AsyncIterator[str]:
    """Run ``app`` under a real uvicorn server on a free port until the block ends."""
    config = server_config(app, "127.0.0.1", 0, log_level="warning", lifespan="on")
    async with running(GatewayServer(config, app), "the gateway") as port:
        yield f"http://127.0.0.1:{port}"


@asynccontextmanager
async def running(server: uvicorn.Server, what: str) -> AsyncIterator[int]:
    """Serve with ``server`` (bound to a free port) until the block ends; yields its port."""
    async with anyio.create_task_group() as tg:
        done = anyio.Event()

        async def run() -> None:
            try:
                await server.serve()
            finally:
                done.set()

        tg.start_soon(run)
        with anyio.fail_after(START_S):
            while not server.started:
                if done.is_set():
                    raise RuntimeError(f"{what} did not start")
                await anyio.sleep(0.005)
        try:
            yield server.servers[0].sockets[0].getsockname()[1]
        finally:
            server.should_exit = True
            with anyio.fail_after(START_S):
                await done.wait()


@asynccontextmanager
async def running_gateway(
    database_url: str, *, clock: FakeClock | None = None, **overrides: Any
) -> AsyncIterator[Running]:
    values: dict[str, Any] = {"database_url": database_url, "secret": SECRET}
    values.update(overrides)
    app = create_app(Settings(**values), clock=clock)
    async with serve(app) as url, http_client(base_url=url, timeout=30) as client:
        yield Running(url, app, client)


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every client of the tests: httpx makes one per client otherwise, loading the
    system's certificates each time (tens of milliseconds), for connections that are all plain HTTP."""
    return ssl.create_default_context()


def http_client(**options: Any) -> httpx.AsyncClient:
    """An httpx client with the limits of the project's own clients (``gateway.client.backend.LIMITS``), as
    README.md tells a gateway's clients to make one: it lets go of a kept-alive connection after 2 s idle,
    before the gateway closes it (``GATEWAY_IDLE_TIMEOUT_MS``, 5 s). httpx's default expiry is those same
    5 s, so a request sent as the gateway closes the connection is reset unanswered
    (``RemoteProtocolError: Server disconnected``)."""
    return httpx.AsyncClient(limits=LIMITS, verify=_tls(), **options)


# --- tasks through the HTTP API -----------------------------------------------------------------------------


class Created(dict[str, Any]):
    """The answer to ``POST /v1/tasks`` (``task``, ``callbackToken``, ``subscribeToken``), a dict whose
    parts are attributes too."""

    @property
    def task(self) -> dict[str, Any]:
        task: dict[str, Any] = self["task"]
        return task

    @property
    def callback_token(self) -> str:
        return str(self["callbackToken"])

    @property
    def subscribe_token(self) -> str:
        return str(self["subscribeToken"])


def _client(gw_or_client: Running | httpx.AsyncClient) -> httpx.AsyncClient:
    return gw_or_client.client if isinstance(gw_or_client, Running) else gw_or_client


@overload
async def create_task(
    gw_or_client: Running | httpx.AsyncClient,
    task_id: str | None,
    *,
    ttl_ms: int = ...,
    max_attempts: int = ...,
    tags: Sequence[str] | None = ...,
    headers: dict[str, str] | None = ...,
    expect: int = ...,
) -> Created: ...


@overload
async def create_task(
    gw_or_client: Running | httpx.AsyncClient,
    task_id: str | None,
    *,
    ttl_ms: int = ...,
    max_attempts: int = ...,
    tags: Sequence[str] | None = ...,
    headers: dict[str, str] | None = ...,
    expect: None,
) -> httpx.Response: ...


async def create_task(
    gw_or_client: Running | httpx.AsyncClient,
    task_id: str | None,
    *,
    ttl_ms: int = 600_000,
    max_attempts: int = 3,
    tags: Sequence[str] | None = None,
    headers: dict[str, str] | None = None,
    expect: int | None = 201,
) -> Created | httpx.Response:
    """``POST /v1/tasks`` (``task_id`` None: the gateway names the task; ``tags`` None: none). Checks that
    the status is ``expect`` (201: created; 200: the same task again) and returns the answer;
    ``expect=None`` returns the response as it came, unchecked."""
    body: dict[str, Any] = {"ttlMs": ttl_ms, "maxAttempts": max_attempts}
    if task_id is not None:
        body = {"id": task_id, **body}
    if tags is not None:
        body["tags"] = list(tags)
    answer = await _client(gw_or_client).post("/v1/tasks", json=body, headers=headers)
    if expect is None:
        return answer
    assert answer.status_code == expect, answer.text
    return Created(answer.json())


async def drain_all(gw_or_client: Running | httpx.AsyncClient, count: int) -> list[dict[str, Any]]:
    """Drain as protocol.md says a backend does, until ``count`` notifications came: again at once while
    ``Drain-More`` is true, else a poll later. A batch can come back short, ``Drain-More: false``, while a
    webhook relay records its sends: on PostgreSQL a drain skips the rows another transaction holds, which a
    later drain takes."""
    client = _client(gw_or_client)
    drained: list[dict[str, Any]] = []
    with anyio.fail_after(STEP_S):
        while True:
            answer = await client.post("/v1/notifications/drain")
            assert answer.status_code == 200, answer.text
            drained += answer.json()
            if len(drained) >= count:
                return drained
            if answer.headers["Drain-More"] != "true":
                await anyio.sleep(0.01)  # a backend's poll: the relay lets go of its rows within moments


@overload
async def post_callback(
    gw_or_client: Running | httpx.AsyncClient,
    task_id: str,
    token: str,
    event: dict[str, Any],
    *,
    callback_id: str | None = ...,
    attempt: int | None = ...,
    expect: int = ...,
) -> dict[str, Any]: ...


@overload
async def post_callback(
    gw_or_client: Running | httpx.AsyncClient,
    task_id: str,
    token: str,
    event: dict[str, Any],
    *,
    callback_id: str | None = ...,
    attempt: int | None = ...,
    expect: None,
) -> httpx.Response: ...


async def post_callback(
    gw_or_client: Running | httpx.AsyncClient,
    task_id: str,
    token: str,
    event: dict[str, Any],
    *,
    callback_id: str | None = None,
    attempt: int | None = None,
    expect: int | None = 200,
) -> dict[str, Any] | httpx.Response:
    """``POST /v1/tasks/{task_id}/callbacks`` with the callback token ``token``. Checks that the status is
    ``expect`` and returns the answer's JSON; ``expect=None`` returns the response as it came, unchecked."""
    body: dict[str, Any] = {"event": event}
    if callback_id is not None:
        body["callbackId"] = callback_id
    if attempt is not None:
        body["attempt"] = attempt
    answer = await _client(gw_or_client).post(
        f"/v1/tasks/{task_id}/callbacks", json=body, headers=bearer(token)
    )
    if expect is None:
        return answer
    assert answer.status_code == expect, answer.text
    result: dict[str, Any] = answer.json()
    return result


S = TypeVar("S", bound=Store)


@asynccontextmanager
async def opened(store: S) -> AsyncIterator[S]:
    """``store``, open for the block."""
    await store.open()
    try:
        yield store
    finally:
        await store.close()


# --- write transactions cut short ---------------------------------------------------------------------


async def transact_cut_short(
    store: Store,
    work: Callable[[WriteTx], Awaitable[object]],
    committing: Callable[[], Awaitable[None]],
    finish_commit: Callable[[], Awaitable[None]],
) -> list[object]:
    """``store.transact(work)`` whose caller is cancelled (a stop, or the database deadline) once
    ``committing()`` has returned (its COMMIT is under way and held there); then ``finish_commit()`` lets
    the COMMIT go on. What the caller was told: ``[result]``, or ``["cancelled"]``."""
    outcome: list[object] = []

    async def caller(scope: anyio.CancelScope) -> None:
        with scope:
            outcome.append(await store.transact(work))
            return
        outcome.append("cancelled")

    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()
        tg.start_soon(caller, scope)
        with anyio.fail_after(5):
            await committing()
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        await finish_commit()
    return outcome


class TcpProxy:
    """A loopback TCP proxy the test can cut, to drop connections the way a network does (no close frame,
    no FIN handshake at the application level): ``cut()`` aborts every open pipe; ``drop_responses = n``
    swallows the next n answers from the server and aborts their connection, as a timeout would.

    ``stall()`` is a link that dies silently (a phone changing networks, a NAT forgetting the flow): every
    open pipe stops forwarding in both directions and is never closed, so neither end sees a FIN or an
    error; what is sent into it is lost. Connections opened afterwards pass. ``refuse = True`` resets every
    new connection at once, as a gateway that cannot be reached; ``accepted`` counts connections served."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.drop_responses = 0
        self.cuts = 0
        self.stalls = 0
        self.refuse = False
        self.refused = 0
        self.accepted = 0
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._stalled: set[asyncio.StreamWriter] = set()
        self._released = asyncio.Event()  # set when stalled pipes are let go (cut or the proxy stops)

    async def __aenter__(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._pipe, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        self.cuts += 1
        for writer in tuple(self._open):
            writer.transport.abort()
        self._open.clear()
        self._stalled.clear()
        self._released.set()
        self._released = asyncio.Event()

    def stall(self) -> None:
        self.stalls += 1
        self._stalled.update(self._open)

    def open_connections(self) -> int:
        """Pipes open now and still forwarding."""
        return len(self._open - self._stalled) // 2

    async def _pipe(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.refuse:
            self.refused += 1
            client_w.transport.abort()
            return
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.accepted += 1
        self._open.update((client_w, server_w))

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter, answers: bool) -> None:
            try:
                while data := await src.read(65536):
                    if dst in self._stalled:
                        # A dead link: nothing more gets through, and nothing closes, until let go.
                        await self._released.wait()
                        return
                    if answers and self.drop_responses > 0:
                        self.drop_responses -= 1
                        client_w.transport.abort()
                        server_w.transport.abort()
                        return
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.transport.abort()

        try:
            await asyncio.gather(copy(client_r, server_w, False), copy(server_r, client_w, True))
        finally:
            self._open.discard(client_w)
            self._open.discard(server_w)
            self._stalled.discard(client_w)
            self._stalled.discard(server_w)


# --- tasks a database driver leaves behind -----------------------------------------------------------------


def leftover_driver_tasks() -> list[asyncio.Task[Any]]:
    """Pending asyncio tasks of SQLAlchemy or aiosqlite, other than the current one."""
    current = asyncio.current_task()
    found = []
    for task in asyncio.all_tasks():
        code = getattr(task.get_coro(), "cr_code", None)
        filename = code.co_filename if code is not None else ""
        if task is not current and not task.done() and ("sqlalchemy" in filename or "aiosqlite" in filename):
            found.append(task)
    return found


async def reap_leftover_driver_tasks(settle_s: float = 1.0) -> list[str]:
    """Database-driver tasks still pending once every gateway of the test has stopped: given ``settle_s`` to
    end, then cancelled until they do, since one left pending hangs the event loop's shutdown for ever
    (``test_stopping_during_a_sweep_leaves_no_driver_task_behind`` checks there are none). Returns their
    names."""
    with anyio.move_on_after(settle_s):
        while leftover_driver_tasks():  # noqa: ASYNC110  (foreign tasks: nothing to wait on but polling)
            await anyio.sleep(0.01)
    left = leftover_driver_tasks()
    names = [task.get_coro().__qualname__ for task in left]  # type: ignore[union-attr]
    for task in left:
        for _ in range(20):
            if task.done():
                break
            task.cancel()
            await anyio.sleep(0.01)
    return names
