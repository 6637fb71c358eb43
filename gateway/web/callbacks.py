"""A worker's routes: ``POST /v1/tasks/{id}/callbacks`` (a task's life, reported) and ``.../heartbeat`` (a
lease renewed), both through group commit, both counted against the task's callback rate before their body
is read (a flood costs no parsing)."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from gateway.book.book import CallbackRequest
from gateway.web import render, wire
from gateway.web.context import context_of


async def callback(request: Request) -> Response:
    context = context_of(request)
    gw = context.gateway
    with gw.committer.answering():  # fan-out yields from here on (gateway.live.hub)
        started = time.perf_counter()
        task_id = request.path_params["task_id"]
        context.guard.task(request, task_id, "callback")
        context.callback_rate.take(task_id)  # before the body is read: a flood costs no parsing
        parsed = wire.parse_callback(await context.body(request))
        digest = parsed.digest(task_id) if parsed.callbackId is not None else ""
        callback_request = CallbackRequest(
            task_id, parsed.event.at, parsed.callbackId, digest, parsed.attempt
        )
        outcome = await gw.committer.submit(callback_request)
        metrics = gw.metrics
        metrics.callbacks.labels(outcome.transition.reason).inc()
        metrics.callback_seconds.observe(time.perf_counter() - started)
        return wire.JSON(render.callback_json(outcome))


async def heartbeat(request: Request) -> Response:
    context = context_of(request)
    gw = context.gateway
    with gw.committer.answering():
        task_id = request.path_params["task_id"]
        context.guard.task(request, task_id, "callback")
        context.callback_rate.take(task_id)
        parsed = wire.parse_heartbeat(await context.body(request))
        # Through group commit, with the callbacks: heartbeats of many tasks share a commit.
        outcome = await gw.committer.submit(CallbackRequest(task_id, None, attempt=parsed.attempt))
        gw.metrics.heartbeats.inc()
        return wire.JSON(render.lease_json(outcome.lease))
