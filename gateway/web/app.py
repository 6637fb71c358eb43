"""The application: ``create_app`` wires settings, database, book, tokens and routes, and its lifespan
owns every long-lived thing (the database, the sweeper, the webhook relay)."""

from __future__ import annotations

import functools
import inspect
import logging
import os
import secrets
import sqlite3
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
from anyio.abc import TaskGroup, TaskStatus
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match, WebSocketRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from gateway.book import Book
from gateway.bus import Bus, bus_for
from gateway.committer import Committer
from gateway.demo import run_demo_worker
from gateway.errors import CLOSE_FORBIDDEN, Forbidden, GatewayError, MethodNotAllowed, NotFound, Unavailable
from gateway.hub import Hub
from gateway.metrics import Metrics
from gateway.rate import RateLimiter
from gateway.relay import Relay
from gateway.secret_file import with_secret
from gateway.settings import Settings, is_loopback
from gateway.store import Database
from gateway.store.database import database_unavailable
from gateway.store.sql import SqlStore
from gateway.sweeper import run_sweeper
from gateway.sweeper_thread import run_sweeper_thread
from gateway.tokens import Tokens
from gateway.web.auth import Guard, host_name, origin_allowed
from gateway.web.http import JSON, routes
from gateway.web.live import live_routes

log = logging.getLogger("gateway")

Clock = Callable[[], int]
MAX_DEMO_WORKERS = 50
# Callback batches committing at once on PostgreSQL (of the pool's 10 connections, and 10 more on demand).
COMMITS_IN_FLIGHT = 3


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class Gateway:
    """Everything a running gateway holds; built by ``create_app``, opened and closed by its lifespan."""

    def __init__(self, settings: Settings, clock: Clock) -> None:
        self.settings = settings
        self.clock = clock
        self.metrics = Metrics()
        self.db = Database(settings.database_url)
        self.store = SqlStore(self.db)
        self.bus: Bus = bus_for(settings.bus_url, settings.database_url)
        self.book = Book(
            self.store,
            clock,
            bus=self.bus,
            retention_versions=settings.retention_versions,
            max_history_versions=settings.max_history_versions,
        )
        self.callback_rate = RateLimiter(settings.callback_rate_per_s)
        self.hub = Hub(self.book)
        # On PostgreSQL several batches commit at once, each on a connection of the pool.
        self.committer = Committer(self.book, concurrency=1 if self.db.is_sqlite else COMMITS_IN_FLIGHT)
        self.hub.callbacks_waiting = self.committer.busy
        self.relay = Relay.from_settings(self.store, settings, self.metrics)
        if self.relay is not None:
            self.book.on_notifications = self.relay.wake
        self.metrics.watch_hub(self.hub.stats)
        self.metrics.watch_bus(self.bus)
        settings = self.settings = with_secret(settings)
        if settings.secret is not None:
            secret = settings.secret.get_secret_value()
        else:
            secret = secrets.token_urlsafe(32)
            log.warning(
                "GATEWAY_SECRET is not set: tokens are signed with a random secret made at start; they "
                "stop working when this process restarts and no other process accepts them (a SQLite "
                "gateway keeps its secret beside the file; on PostgreSQL set GATEWAY_SECRET)"
            )
        self.tokens = Tokens(secret, grace_s=settings.token_grace_s)
        self.guard = Guard(settings, self.tokens)
        self.demo_workers = 0
        # Set when a background part failed for good (see _essential); on_fatal asks the server to stop.
        self.fatal: BaseException | None = None
        self.on_fatal: Callable[[], None] | None = None
        self.app: Starlette | None = None
        self._background: TaskGroup | None = None

    def can_spawn_demo(self) -> bool:
        return self._background is not None and self.demo_workers < MAX_DEMO_WORKERS

    def spawn_demo(self, task_id: str, callback_token: str) -> None:
        """Start a simulated worker for a demo task. It posts to this app's public callback route in
        process (an ASGI transport): the same route, auth and checks as any worker, and no address that a
        request's Host header could point elsewhere."""
        assert self._background is not None and self.app is not None
        self.demo_workers += 1
        transport = httpx.ASGITransport(app=self.app)

        async def run() -> None:
            try:
                async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
                    await run_demo_worker(client, task_id, callback_token)
            except Exception:  # a demo must never take the sweeper and the watchdog down with it
                log.exception("demo worker for %s failed", task_id)
            finally:
                self.demo_workers -= 1

        self._background.start_soon(run)

    async def _essential(
        self,
        name: str,
        work: Callable[..., Awaitable[None]],
        *args: Any,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run a background part the gateway cannot serve without. Each handles the failures it expects
        (a database or bus outage) itself; one that still ends with an exception leaves a process that
        would answer but no longer push or expire, so the process stops instead (``fatal``, readiness
        fails, the server exits with an error) and its supervisor starts a whole one."""
        try:
            if "task_status" in inspect.signature(work).parameters:
                await work(*args, task_status=task_status)
            else:
                task_status.started()
                await work(*args)
        except Exception as exc:
            log.critical("%s failed; stopping this process so that it is restarted whole", name, exc_info=exc)
            self.fatal = exc
            if self.on_fatal is not None:
                self.on_fatal()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        self.settings.check_bind()
        await self.store.open()
        try:
            async with anyio.create_task_group() as tg:
                self._background = tg
                await tg.start(
                    self._essential, "the bus listener", self.bus.run, self.hub.receive, self.hub.resync
                )
                # On a bus shared with other processes a message can be lost: check the store now and then.
                reconcile_s = self.settings.reconcile_interval_ms / 1000 if self.bus.shared else None
                tg.start_soon(self._essential, "the hub's catch-up", self.hub.run, reconcile_s)
                tg.start_soon(self._essential, "the group committer", self.committer.run)
                tg.start_soon(
                    self._essential,
                    "the write watchdog",
                    self.hub.watch_writes,
                    self.settings.write_timeout_ms / 1000,
                )
                if self.settings.sweep_interval_ms > 0:
                    interval_s = self.settings.sweep_interval_ms / 1000
                    if self.db.is_sqlite:  # a file only this process writes: it makes every deadline
                        sweeper = functools.partial(
                            run_sweeper, self.book, interval_s, self.metrics, solo=True
                        )
                    else:  # off the event loop (gateway.sweeper_thread)
                        url = self.settings.database_url
                        sweeper = functools.partial(
                            run_sweeper_thread, self.book, url, interval_s, self.metrics
                        )
                    tg.start_soon(self._essential, "the sweeper", sweeper)
                if self.relay is not None:
                    tg.start_soon(self._essential, "the webhook relay", self.relay.run)
                yield
                self._background = None
                tg.cancel_scope.cancel()
        finally:
            await self.store.close()


def create_app(settings: Settings | None = None, *, clock: Clock | None = None) -> Starlette:
    """The gateway as an ASGI app. ``clock`` returns epoch milliseconds (tests use it to control time).

    Without ``settings`` it reads the ``GATEWAY_*`` environment, as ``gateway serve`` does."""
    gw = Gateway(settings or Settings.from_environ(os.environ), clock or wall_clock_ms)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with gw.running():
            yield

    sockets = live_routes(gw)
    app = GatewayApp(
        routes=[*routes(gw), *sockets],
        lifespan=lifespan,
        exception_handlers={
            GatewayError: _gateway_error,
            HTTPException: _http_error,
            DBAPIError: _database_error,
            sqlite3.Error: _database_error,  # the SQLite writer's own connection (a locked file: 503)
            PoolTimeout: _database_error,
            OSError: _database_error,
            Exception: _internal_error,
        },
    )
    app.state.gateway = gw
    gw.app = app
    if gw.settings.allowed_origins:
        # Pages on the allowed origins may import gateway-client.js and read SSE streams and task state.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(gw.settings.allowed_origins),
            allow_methods=["GET"],
            allow_headers=["Authorization", "Last-Event-ID"],
        )
    if gw.settings.open_mode:
        app.add_middleware(_OpenModeGuard, allowed_origins=gw.settings.allowed_origins)
    app.add_middleware(_CountRequests, metrics=gw.metrics)
    app.sockets = tuple(route for route in sockets if isinstance(route, WebSocketRoute))
    app.socket_guard = (
        _OpenModeGuard(app.router, gw.settings.allowed_origins) if gw.settings.open_mode else None
    )
    return app


class GatewayApp(Starlette):
    """Starlette, except that a WebSocket goes straight to its endpoint: past the HTTP middleware and
    Starlette's error, exception and routing layers, whose coroutine frames a socket would otherwise hold
    for its whole life (about 5 KiB of an idle subscriber's memory). What those layers do for a socket is
    done here: the open-mode guard, and a socket with no route is left to Starlette (it refuses it)."""

    sockets: tuple[WebSocketRoute, ...] = ()
    socket_guard: _OpenModeGuard | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            guard = self.socket_guard
            if guard is not None and guard.problem(scope) is not None:
                await send({"type": "websocket.close", "code": CLOSE_FORBIDDEN})
                return
            for route in self.sockets:
                match, child = route.matches(scope)
                if match is Match.FULL:
                    scope.update(child)
                    scope["app"] = self
                    await route.endpoint(WebSocket(scope, receive, send))
                    return
            if "websocket.http.response" in scope.get("extensions", {}):
                # No socket here: the handshake is answered 404 not-found, as an HTTP route would be
                # (Starlette refuses it with a bare 403, which reads as a credential problem).
                refusal = NotFound(f"no route {scope['path']}")
                answer = JSON(refusal.to_json(), status_code=refusal.status)
                await WebSocket(scope, receive, send).send_denial_response(answer)
                return
        await super().__call__(scope, receive, send)


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return JSON(exc.to_json(), status_code=exc.status, headers=exc.headers())


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        answer = await _gateway_error(request, MethodNotAllowed(f"{request.method} is not allowed here"))
        if exc.headers and "Allow" in exc.headers:
            answer.headers["Allow"] = exc.headers["Allow"]
        return answer
    if exc.status_code == 404:
        return await _gateway_error(request, NotFound(f"no route {request.url.path}"))
    return JSON({"error": {"code": "invalid-request", "message": str(exc.detail)}}, exc.status_code)


async def _database_error(request: Request, exc: Exception) -> Response:
    if not database_unavailable(exc):
        return await _internal_error(request, exc)
    log.warning("database unavailable: %s", exc)
    # Usually nothing was written; a connection lost during the commit itself leaves the outcome unknown,
    # which is why callbacks carry a callbackId and deliveries an Idempotency-Key: a retry is applied once.
    message = (
        "the database is unreachable; retry the request (a retry with the same callbackId is applied once)"
    )
    return await _gateway_error(request, Unavailable(message))


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return JSON({"error": {"code": "internal", "message": "internal error"}}, status_code=500)


class _CountRequests:
    """Counts answered requests by status (pure ASGI, so it costs one closure per request)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.http_requests.labels(scope["method"], str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class _OpenModeGuard:
    """With no API key the management API is open to whoever reaches loopback, so guard what a browser on
    this machine could be made to send: a ``Host`` that is not a loopback name (DNS rebinding) is refused,
    and so is a state-changing request from a page whose ``Origin`` is neither loopback nor allowed
    (cross-site requests, which need no preflight with a text/plain body)."""

    def __init__(self, app: ASGIApp, allowed_origins: tuple[str, ...]) -> None:
        self.app = app
        self.allowed = allowed_origins

    def problem(self, scope: Scope) -> str | None:
        """Why this request or socket is refused, or ``None``."""
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if not is_loopback(host_name(host)):
            return "with no API key the gateway answers only to loopback names (Host)"
        origin = headers.get("origin")
        unsafe = scope["type"] == "websocket" or scope["method"] not in ("GET", "HEAD", "OPTIONS")
        if unsafe and not origin_allowed(origin or None, host, self.allowed):
            return "origin not allowed"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            problem = self.problem(scope)
            if problem is not None:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": CLOSE_FORBIDDEN})
                    return
                answer = JSON(Forbidden(problem).to_json(), status_code=Forbidden.status)
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)
