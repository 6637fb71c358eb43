"""The ASGI application: ``create_app`` puts the routes and sockets of protocol.md on top of a
:class:`~gateway.runtime.Gateway`, whose ``running`` context the lifespan enters (it owns every
long-lived thing: the database, the bus, the sweeper, the webhook relay)."""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, Mount, Route, WebSocketRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket

from gateway.errors import (
    CLOSE_FORBIDDEN,
    ConfigError,
    Forbidden,
    GatewayError,
    MethodNotAllowed,
    NotFound,
    Unavailable,
    one_line,
)
from gateway.metrics import Metrics
from gateway.runtime import Clock, Gateway, wall_clock_ms
from gateway.settings import Settings, is_loopback
from gateway.store.database import database_unavailable, unavailable_reason
from gateway.web import callbacks, metadata, pages, probes, results, sockets, sse, streams, tasks
from gateway.web.auth import host_name, origin_allowed
from gateway.web.context import Context
from gateway.web.openapi import openapi_bytes, package_version
from gateway.web.tag_tokens import tag_token
from gateway.web.wire import JSON

log = logging.getLogger("gateway")

# The routes of protocol.md, each a function of the module named for what it serves; each reaches the
# gateway through its app's context (``gateway.web.context``).
ROUTES: list[BaseRoute] = [
    Route("/", pages.index, methods=["GET"]),
    Route("/openapi.json", pages.openapi_json, methods=["GET"]),
    Route("/docs", pages.api_page, methods=["GET"]),
    Mount("/static", pages.Static(), name="static"),
    Route("/v1/tasks", tasks.tasks, methods=["GET", "POST"]),
    Route("/v1/tasks/{task_id}", tasks.get_task, methods=["GET"]),
    Route("/v1/tasks/{task_id}/events", tasks.events, methods=["GET"]),
    Route("/v1/tasks/{task_id}/callbacks", callbacks.callback, methods=["POST"]),
    Route("/v1/tasks/{task_id}/cancel", tasks.cancel, methods=["POST"]),
    Route("/v1/tasks/{task_id}/heartbeat", callbacks.heartbeat, methods=["POST"]),
    Route("/v1/tasks/{task_id}/metadata", metadata.patch_metadata, methods=["POST"]),
    Route("/v1/tasks/{task_id}/streams", streams.listing, methods=["GET"]),
    Route("/v1/tasks/{task_id}/streams/{name}", streams.append_or_page, methods=["GET", "POST"]),
    Route("/v1/tasks/{task_id}/streams/{name}/text", streams.text, methods=["GET"]),
    Route("/v1/tasks/{task_id}/deliveries", results.deliver, methods=["POST"]),
    Route("/v1/notifications/drain", results.drain, methods=["POST"]),
    Route("/v1/tokens", tag_token, methods=["POST"]),
    Route("/v1/demo", pages.demo_status, methods=["GET"]),
    Route("/v1/demo/tasks", pages.start_demo, methods=["POST"]),
    Route("/healthz", probes.healthz, methods=["GET"]),
    Route("/readyz", probes.readyz, methods=["GET"]),
    Route("/metrics", probes.metrics, methods=["GET"]),
    WebSocketRoute("/v1/tasks/{task_id}/ws", sockets.task_socket),
    WebSocketRoute("/v1/ws", sockets.multi_socket),
    Route("/v1/tasks/{task_id}/stream", sse.stream, methods=["GET"]),
]
SOCKETS = tuple(route for route in ROUTES if isinstance(route, WebSocketRoute))


def create_app(settings: Settings | None = None, *, clock: Clock | None = None) -> Starlette:
    """The gateway as an ASGI app. ``clock`` returns epoch milliseconds (tests use it to control time).

    Without ``settings`` it reads the ``GATEWAY_*`` environment, as ``gateway serve`` does."""
    gw = Gateway(settings or Settings.from_environ(os.environ), clock or wall_clock_ms)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        started = False
        try:
            async with gw.running():
                started = True
                yield
        except Exception as exc:
            # A worker started while the database is down (docs/configuration.md: one line, not a traceback).
            if started or not (isinstance(exc, ConfigError) or database_unavailable(exc)):
                raise
            why = str(exc) if isinstance(exc, ConfigError) else f"the database: {one_line(exc)}"
            gw.startup_failure = f"could not start: {why}"
            log.error("%s", gw.startup_failure)
            raise

    app = GatewayApp(
        routes=ROUTES,
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
    app.context = Context.of(gw, openapi_bytes(package_version(), open_mode=gw.settings.open_mode))
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
    app.socket_guard = (
        _OpenModeGuard(app.router, gw.settings.allowed_origins) if gw.settings.open_mode else None
    )
    return app


class GatewayApp(Starlette):
    """Starlette, except that a WebSocket goes straight to its endpoint: past the HTTP middleware and
    Starlette's error, exception and routing layers, whose coroutine frames a socket would otherwise hold
    for its whole life (about 5 KiB of an idle subscriber's memory). What those layers do for a socket is
    done here: the open-mode guard, and a socket with no route is left to Starlette (it refuses it)."""

    # What the endpoints share (the Gateway, the Guard, ...): set by create_app.
    context: Context
    sockets: tuple[WebSocketRoute, ...] = SOCKETS
    socket_guard: _OpenModeGuard | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await super().__call__(scope, receive, self._startup_failure_said(send))
            return
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

    def _startup_failure_said(self, send: Send) -> Send:
        """Starlette reports a start-up failure with the whole traceback, which the server logs; where the
        gateway said why in one line itself, that line is all."""
        gateway = self.state.gateway

        async def sending(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed" and gateway.startup_failure is not None:
                message = {**message, "message": ""}
            await send(message)

        return sending


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
    log.warning("database unavailable: %s", one_line(exc))
    # Usually nothing was written; a connection lost during the commit itself leaves the outcome unknown,
    # which is why callbacks carry a callbackId and deliveries and drains an Idempotency-Key: a retry is
    # applied once.
    message = (
        f"{unavailable_reason(exc)}; retry the request (a retry with the same callbackId is applied once)"
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
