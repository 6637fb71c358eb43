"""The application: ``create_app`` wires settings, database, book, tokens and routes, and its lifespan
owns every long-lived thing (the database, the sweeper)."""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
from anyio.abc import TaskGroup
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.book import Book
from gateway.bus import Bus, LocalBus
from gateway.demo import run_demo_worker
from gateway.errors import GatewayError, MethodNotAllowed, NotFound, Unavailable
from gateway.hub import Hub
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.store import Database
from gateway.sweeper import run_sweeper
from gateway.tokens import Tokens
from gateway.web.auth import Guard
from gateway.web.http import JSON, routes
from gateway.web.live import live_routes

log = logging.getLogger("gateway")

Clock = Callable[[], int]
MAX_DEMO_WORKERS = 50


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class Gateway:
    """Everything a running gateway holds; built by ``create_app``, opened and closed by its lifespan."""

    def __init__(self, settings: Settings, clock: Clock) -> None:
        self.settings = settings
        self.clock = clock
        self.metrics = Metrics()
        self.db = Database(settings.database_url)
        self.hub = Hub()
        self.bus: Bus = LocalBus()
        self.bus.listen(self.hub.publish)
        self.book = Book(
            self.db, clock, retention_versions=settings.retention_versions, on_commit=self.bus.publish
        )
        if settings.secret is not None:
            secret = settings.secret.get_secret_value()
        else:
            secret = secrets.token_urlsafe(32)
            log.warning(
                "GATEWAY_SECRET is not set: tokens are signed with a random secret made at start; they "
                "stop working when this process restarts and no other process accepts them"
            )
        self.tokens = Tokens(secret, grace_s=settings.token_grace_s)
        self.guard = Guard(settings, self.tokens)
        self.demo_workers = 0
        self._background: TaskGroup | None = None

    def spawn_demo(self, base_url: str, task_id: str, callback_token: str) -> bool:
        """Start a simulated worker for a demo task; ``False`` when enough of them run already."""
        if self._background is None or self.demo_workers >= MAX_DEMO_WORKERS:
            return False
        self.demo_workers += 1

        async def run() -> None:
            try:
                await run_demo_worker(base_url, task_id, callback_token)
            finally:
                self.demo_workers -= 1

        self._background.start_soon(run)
        return True

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        self.settings.check_bind()
        await self.db.open()
        try:
            async with anyio.create_task_group() as tg:
                self._background = tg
                tg.start_soon(self.hub.watch_writes, self.settings.write_timeout_ms / 1000)
                if self.settings.sweep_interval_ms > 0:
                    tg.start_soon(
                        run_sweeper, self.book, self.settings.sweep_interval_ms / 1000, self.metrics
                    )
                yield
                self._background = None
                tg.cancel_scope.cancel()
        finally:
            await self.db.close()


def create_app(settings: Settings | None = None, *, clock: Clock | None = None) -> Starlette:
    """The gateway as an ASGI app. ``clock`` returns epoch milliseconds (tests use it to control time)."""
    gw = Gateway(settings or Settings(), clock or wall_clock_ms)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with gw.running():
            yield

    app = Starlette(
        routes=[*routes(gw), *live_routes(gw)],
        lifespan=lifespan,
        exception_handlers={
            GatewayError: _gateway_error,
            HTTPException: _http_error,
            DBAPIError: _database_error,
            PoolTimeout: _database_error,
            OSError: _database_error,
            Exception: _internal_error,
        },
    )
    app.state.gateway = gw
    if gw.settings.allowed_origins:
        # Pages on the allowed origins may import gateway-client.js and read SSE streams and task state.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(gw.settings.allowed_origins),
            allow_methods=["GET"],
            allow_headers=["Authorization", "Last-Event-ID"],
        )
    app.add_middleware(_CountRequests, metrics=gw.metrics)
    return app


async def _gateway_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Unavailable) else None
    return JSON(exc.to_json(), status_code=exc.status, headers=headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        return await _gateway_error(request, MethodNotAllowed(f"{request.method} is not allowed here"))
    if exc.status_code == 404:
        return await _gateway_error(request, NotFound(f"no route {request.url.path}"))
    return JSON({"error": {"code": "invalid-request", "message": str(exc.detail)}}, exc.status_code)


async def _database_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, DBAPIError) and not _is_connection_problem(exc):
        return await _internal_error(request, exc)
    log.warning("database unavailable: %s", exc)
    return await _gateway_error(request, Unavailable("the database is unreachable; nothing was written"))


# SQLSTATE classes of a database that cannot serve now: connection exceptions (08), insufficient resources
# (53), operator intervention such as a shutdown (57); and "not accepting connections" (55000) and a
# database that does not exist (3D000).
_UNAVAILABLE_CLASSES = ("08", "53", "57")
_UNAVAILABLE_STATES = ("55000", "3D000")


def _is_connection_problem(exc: DBAPIError) -> bool:
    if exc.connection_invalidated or type(exc).__name__ in ("OperationalError", "InterfaceError"):
        return True
    state = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    return isinstance(state, str) and (state[:2] in _UNAVAILABLE_CLASSES or state in _UNAVAILABLE_STATES)


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
