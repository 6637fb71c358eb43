"""What a backend takes of the tasks that ended, each under an ``Idempotency-Key``: a succeeded task's result
(``POST /v1/tasks/{id}/deliveries``, a receipt per key) and the terminal notifications
(``POST /v1/notifications/drain``, a batch per key)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import InvalidRequest
from gateway.web import render, wire
from gateway.web.context import context_of

# A drain's answer header: notifications were still to drain after its batch was taken.
DRAIN_MORE = "Drain-More"
# A drain takes no body: where a field sent in one belongs.
DRAIN_BODY_FIELDS = {"limit": "the drain's limit goes in the query: ?limit="}
# Idempotency keys (deliveries, drains) are at most this long.
MAX_IDEMPOTENCY_KEY = 256


def idempotency_key(request: Request) -> str | None:
    """The ``Idempotency-Key`` header, if sent; refused past ``MAX_IDEMPOTENCY_KEY`` characters (a blank
    one is the book's to refuse, as every blank key is: protocol.md, Deliveries)."""
    key = request.headers.get("idempotency-key")
    if key is not None and len(key) > MAX_IDEMPOTENCY_KEY:
        raise InvalidRequest(f"Idempotency-Key: at most {MAX_IDEMPOTENCY_KEY} characters")
    return key


async def deliver(request: Request) -> Response:
    context = context_of(request)
    task_id = request.path_params["task_id"]
    context.guard.management(request)
    key = idempotency_key(request)
    if key is None:
        raise InvalidRequest("Idempotency-Key: header is required")
    wire.parse_empty_body(await context.body(request))
    return wire.JSON(render.delivery_json(await context.gateway.book.deliver(task_id, key)))


async def drain(request: Request) -> Response:
    context = context_of(request)
    context.guard.management(request)
    key = idempotency_key(request)
    query = wire.parse_drain_query(request.query_params)
    wire.parse_empty_body(await context.body(request), DRAIN_BODY_FIELDS)
    gw = context.gateway
    drained = await gw.book.drain(render.notifications_body, limit=query.limit, idempotency_key=key)
    gw.metrics.notifications_drained.inc(len(drained.taken))
    if drained.replayed:
        gw.metrics.drain_replays.inc()
    return wire.JSON(drained.body, headers={DRAIN_MORE: "true" if drained.more else "false"})
