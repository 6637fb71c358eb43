"""The HTTP routes of protocol.md (all under ``/v1``), plus health, readiness and metrics."""

from __future__ import annotations

import importlib.metadata
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from gateway.book.book import CallbackRequest
from gateway.errors import (
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    Unavailable,
    UnsupportedMediaType,
)
from gateway.jobs.demo import DEMO_MAX_ATTEMPTS, DEMO_TTL_MS
from gateway.machine import cancel_task, is_blank, task_to_json
from gateway.runtime import Gateway
from gateway.store.database import DISK_FULL
from gateway.web import render, task_list, wire
from gateway.web.auth import Guard
from gateway.web.openapi import openapi_bytes
from gateway.web.tag_tokens import parse_token_body
from gateway.web.task_ids import task_id_problem


def check_json_type(request: Request) -> None:
    """A body is JSON: ``application/json`` (or a ``+json`` type), or no ``Content-Type`` at all; anything
    else is 415. (A form or text/plain body is what a cross-site page can post without a preflight.)"""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not (
        media_type.startswith("application/") and media_type.endswith("+json")
    ):
        raise UnsupportedMediaType(
            f"Content-Type {media_type or declared!r}: the body must be JSON; send "
            "'Content-Type: application/json' (curl: -H 'Content-Type: application/json', or --json)"
        )


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The JSON request body, refused with 415 when declared as something else, with 413 past ``limit``
    bytes without reading the rest, and with 408 when it has not all arrived within ``timeout_s``."""
    check_json_type(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes is over the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    with anyio.move_on_after(timeout_s) as scope:
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"body is over the limit of {limit} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            # Nobody is left to read the answer: one access line, not a traceback.
            raise InvalidRequest("the client closed the connection before the body was complete") from None
    if scope.cancelled_caught:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s")
    return b"".join(chunks)


# A drain's answer header: notifications were still to drain after its batch was taken.
DRAIN_MORE = "Drain-More"
# A drain takes no body: where a field sent in one belongs.
DRAIN_BODY_FIELDS = {"limit": "the drain's limit goes in the query: ?limit="}
# Idempotency keys (deliveries, drains) are at most this long.
MAX_IDEMPOTENCY_KEY = 256


def idempotency_key(request: Request) -> str | None:
    """The ``Idempotency-Key`` header, if sent; refused past ``MAX_IDEMPOTENCY_KEY`` characters (a blank
    one is the book's to refuse, as the reference does)."""
    key = request.headers.get("idempotency-key")
    if key is not None and len(key) > MAX_IDEMPOTENCY_KEY:
        raise InvalidRequest(f"Idempotency-Key: at most {MAX_IDEMPOTENCY_KEY} characters")
    return key


def _static_dir() -> Path:
    """``static/`` of the checkout (an editable install), else where a wheel installs it."""
    checkout = Path(__file__).resolve().parents[2] / "static"
    if checkout.is_dir():
        return checkout
    return Path(sys.prefix) / "share" / "task-gateway" / "static"


STATIC_DIR = _static_dir()


class _StaticFiles(StaticFiles):
    """``static/``, with TypeScript declarations (``gateway-client.d.ts``) as text rather than what the
    platform's MIME table says of ``.ts`` (an MPEG transport stream)."""

    def file_response(self, full_path: Any, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(full_path, *args, **kwargs)
        if str(full_path).endswith(".ts"):
            response.headers["content-type"] = "application/typescript; charset=utf-8"
        return response


def routes(gw: Gateway, guard: Guard) -> list[Route | Mount]:
    book, metrics, settings = gw.book, gw.metrics, gw.settings
    body_timeout_s = settings.body_timeout_ms / 1000

    async def body(request: Request) -> bytes:
        return await read_body(request, settings.max_body_bytes, body_timeout_s)

    async def create_task(request: Request) -> Response:
        guard.management(request)
        created_body = wire.parse_create(await body(request))
        task_id = created_body.id if created_body.id is not None else str(uuid.uuid4())
        problem = None if is_blank(task_id) else task_id_problem(task_id)
        if problem is not None:
            raise InvalidRequest(f"id: {problem}")
        if created_body.ttlMs > wire.MAX_TTL_MS:
            raise InvalidRequest(f"ttlMs: at most {wire.MAX_TTL_MS} (2**52, about 142,800 years)")
        task, created = await book.create(
            task_id, created_body.ttlMs, created_body.maxAttempts, created_body.heartbeatMs, created_body.tags
        )
        if created:
            metrics.tasks_created.inc()
        answer = {
            "task": task_to_json(task),
            "callbackToken": gw.tokens.issue(task.id, "callback", created_body.ttlMs),
            "subscribeToken": gw.tokens.issue(task.id, "subscribe", created_body.ttlMs),
        }
        return wire.JSON(answer, status_code=201 if created else 200)

    async def list_tasks(request: Request) -> Response:
        guard.task_list(request)
        query = task_list.parse_task_list_query(request.query_params)
        # One more than the page, to know whether another page follows.
        if not query.newest_first:
            found = await book.list_tasks(state=query.state, after=query.after(), limit=query.limit + 1)
            return wire.JSON(task_list.task_page_json(found, query.limit))
        found = await gw.tag_reads.list_tasks(
            query.tag or (), state=query.state, before=query.before(), limit=query.limit + 1
        )
        return wire.JSON(task_list.task_page_json(found, query.limit, newest_first=True))

    async def tasks(request: Request) -> Response:
        # One route for both methods, so that another method is answered 405 with both in Allow.
        return await (list_tasks(request) if request.method in ("GET", "HEAD") else create_task(request))

    async def get_task(request: Request) -> Response:
        task_id = request.path_params["task_id"]
        grant = guard.task(request, task_id, "subscribe")
        with grant.reading():  # a tag token: the task must carry its tag (checked on the task read)
            task = grant.check(await book.get(task_id))
        return wire.JSON(task_to_json(task))

    async def events(request: Request) -> Response:
        task_id = request.path_params["task_id"]
        grant = guard.task(request, task_id, "subscribe")
        cursor, epoch = wire.query_cursor(request.query_params)
        with grant.reading():
            resume = await book.resume(task_id, cursor, epoch)
            grant.check(resume.task)
        return wire.JSON(render.resume_json(resume))

    async def tag_token(request: Request) -> Response:
        guard.management(request)
        asked = parse_token_body(await body(request))
        token, exp_s = gw.tokens.issue_tag(asked.tag, asked.ttlS)
        return wire.JSON({"token": token, "expiresAtMs": exp_s * 1000}, status_code=201)

    async def callback(request: Request) -> Response:
        with gw.committer.answering():  # fan-out yields from here on (gateway.live.hub)
            return await _callback(request)

    async def _callback(request: Request) -> Response:
        started = time.perf_counter()
        task_id = request.path_params["task_id"]
        guard.task(request, task_id, "callback")
        gw.callback_rate.take(task_id)  # before the body is read: a flood costs no parsing
        parsed = wire.parse_callback(await body(request))
        digest = parsed.digest(task_id) if parsed.callbackId is not None else ""
        callback_request = CallbackRequest(
            task_id, parsed.event.at, parsed.callbackId, digest, parsed.attempt
        )
        outcome = await gw.committer.submit(callback_request)
        metrics.callbacks.labels(outcome.transition.reason).inc()
        metrics.callback_seconds.observe(time.perf_counter() - started)
        return wire.JSON(render.callback_json(outcome))

    async def cancel(request: Request) -> Response:
        task_id = request.path_params["task_id"]
        guard.management(request)
        reason = wire.parse_cancel(await body(request)).reason
        transition = await book.act(task_id, lambda task, now: cancel_task(task, now, reason))
        if transition.reason == "cancelled":
            metrics.tasks_cancelled.inc()
        return wire.JSON(render.cancel_json(transition))

    async def heartbeat(request: Request) -> Response:
        with gw.committer.answering():
            task_id = request.path_params["task_id"]
            guard.task(request, task_id, "callback")
            gw.callback_rate.take(task_id)
            parsed = wire.parse_heartbeat(await body(request))
            # Through group commit, with the callbacks: heartbeats of many tasks share a commit.
            outcome = await gw.committer.submit(CallbackRequest(task_id, None, attempt=parsed.attempt))
            metrics.heartbeats.inc()
            return wire.JSON(render.lease_json(outcome.lease))

    async def deliver(request: Request) -> Response:
        task_id = request.path_params["task_id"]
        guard.management(request)
        key = idempotency_key(request)
        if key is None:
            raise InvalidRequest("Idempotency-Key: header is required")
        wire.parse_empty_body(await body(request))
        return wire.JSON(render.delivery_json(await book.deliver(task_id, key)))

    async def drain(request: Request) -> Response:
        guard.management(request)
        key = idempotency_key(request)
        query = wire.parse_drain_query(request.query_params)
        wire.parse_empty_body(await body(request), DRAIN_BODY_FIELDS)
        drained = await book.drain(render.notifications_body, limit=query.limit, idempotency_key=key)
        metrics.notifications_drained.inc(len(drained.taken))
        if drained.replayed:
            metrics.drain_replays.inc()
        return wire.JSON(drained.body, headers={DRAIN_MORE: "true" if drained.more else "false"})

    async def healthz(request: Request) -> Response:
        return wire.JSON({"status": "ok"})

    async def readyz(request: Request) -> Response:
        if gw.fatal is not None:
            raise Unavailable("this process is stopping: a background part failed")
        if gw.db.disk_full():  # reads would pass; writes fail until space is freed
            raise Unavailable(f"{DISK_FULL}: writes fail until space is freed on it")
        await gw.db.ping()
        return wire.JSON({"status": "ready"})

    async def metrics_text(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def demo_status(request: Request) -> Response:
        return wire.JSON({"enabled": settings.demo_enabled})

    async def start_demo(request: Request) -> Response:
        if not settings.demo_enabled:
            raise NotFound(f"no route {request.url.path}")
        if not gw.can_spawn_demo():
            raise Unavailable("too many demo tasks are running; try again in a moment")
        task, _ = await book.create(f"demo-{uuid.uuid4().hex[:12]}", DEMO_TTL_MS, DEMO_MAX_ATTEMPTS)
        # The simulated worker reports through the public callback API, like any worker.
        gw.spawn_demo(task.id, gw.tokens.issue(task.id, "callback", DEMO_TTL_MS))
        answer = {
            "task": task_to_json(task),
            "subscribeToken": gw.tokens.issue(task.id, "subscribe", DEMO_TTL_MS),
        }
        return wire.JSON(answer, status_code=201)

    async def index(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "index.html")

    document = openapi_bytes(_version(), open_mode=settings.open_mode)

    async def openapi_json(request: Request) -> Response:
        return wire.JSON(document)

    async def api_page(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "api.html")

    return [
        Route("/", index, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/docs", api_page, methods=["GET"]),
        Mount("/static", _StaticFiles(directory=STATIC_DIR, check_dir=False), name="static"),
        Route("/v1/tasks", tasks, methods=["GET", "POST"]),
        Route("/v1/tasks/{task_id}", get_task, methods=["GET"]),
        Route("/v1/tasks/{task_id}/events", events, methods=["GET"]),
        Route("/v1/tasks/{task_id}/callbacks", callback, methods=["POST"]),
        Route("/v1/tasks/{task_id}/cancel", cancel, methods=["POST"]),
        Route("/v1/tasks/{task_id}/heartbeat", heartbeat, methods=["POST"]),
        Route("/v1/tasks/{task_id}/deliveries", deliver, methods=["POST"]),
        Route("/v1/notifications/drain", drain, methods=["POST"]),
        Route("/v1/tokens", tag_token, methods=["POST"]),
        Route("/v1/demo", demo_status, methods=["GET"]),
        Route("/v1/demo/tasks", start_demo, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
    ]


def _version() -> str:
    try:
        return importlib.metadata.version("task-gateway")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "0+unknown"
