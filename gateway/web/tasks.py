"""The task routes of protocol.md: ``POST /v1/tasks`` (create), ``GET /v1/tasks`` (list), a task's read
(``GET /v1/tasks/{id}``), its resume (``.../events``) and its cancel (``.../cancel``)."""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import Response

from gateway.book.beside import Beside
from gateway.errors import InvalidRequest
from gateway.machine import cancel_task, is_blank, task_to_json
from gateway.metadata import EMPTY, encoded
from gateway.web import render, task_list, wire
from gateway.web.context import context_of
from gateway.web.task_ids import task_id_problem


async def tasks(request: Request) -> Response:
    """``/v1/tasks``: one route for both methods, so that another method is answered 405 with both in
    ``Allow``."""
    return await (list_tasks(request) if request.method in ("GET", "HEAD") else create_task(request))


async def create_task(request: Request) -> Response:
    context = context_of(request)
    context.guard.management(request)
    created_body = wire.parse_create(await context.body(request))
    task_id = created_body.id if created_body.id is not None else str(uuid.uuid4())
    problem = None if is_blank(task_id) else task_id_problem(task_id)
    if problem is not None:
        raise InvalidRequest(f"id: {problem}")
    if created_body.ttlMs > wire.MAX_TTL_MS:
        raise InvalidRequest(f"ttlMs: at most {wire.MAX_TTL_MS} (2**52, about 142,800 years)")
    beside = Beside(
        created_body.title,
        encoded(created_body.metadata) if created_body.metadata is not None else EMPTY,
        created_body.parent,
        created_body.progressFromChildren,
    )
    gw = context.gateway
    task, created = await gw.book.create(
        task_id,
        created_body.ttlMs,
        created_body.maxAttempts,
        created_body.heartbeatMs,
        created_body.tags,
        beside,
    )
    if created:
        gw.metrics.tasks_created.inc()
    answer = {
        "task": task_to_json(task),
        "callbackToken": gw.tokens.issue(task.id, "callback", created_body.ttlMs),
        "subscribeToken": gw.tokens.issue(task.id, "subscribe", created_body.ttlMs),
    }
    return wire.JSON(answer, status_code=201 if created else 200)


async def list_tasks(request: Request) -> Response:
    context = context_of(request)
    context.guard.task_list(request)
    query = task_list.parse_task_list_query(request.query_params)
    # One more than the page, to know whether another page follows.
    if not query.newest_first:
        found = await context.gateway.book.list_tasks(
            state=query.state, after=query.after(), limit=query.limit + 1
        )
        return wire.JSON(task_list.task_page_json(found, query.limit))
    found = await context.gateway.tag_reads.list_tasks(
        query.tag or (),
        state=query.state,
        before=query.before(),
        limit=query.limit + 1,
        parent=query.parent,
        title=query.title,
    )
    return wire.JSON(task_list.task_page_json(found, query.limit, newest_first=True))


async def get_task(request: Request) -> Response:
    context = context_of(request)
    task_id = request.path_params["task_id"]
    grant = context.guard.task(request, task_id, "subscribe")
    with grant.reading():  # a tag token: the task must carry its tag (checked on the task read)
        task = grant.check(await context.gateway.book.get(task_id))
    return wire.JSON(task_to_json(task))


async def events(request: Request) -> Response:
    context = context_of(request)
    task_id = request.path_params["task_id"]
    grant = context.guard.task(request, task_id, "subscribe")
    cursor, epoch = wire.query_cursor(request.query_params)
    with grant.reading():
        resume = await context.gateway.book.resume(task_id, cursor, epoch)
        grant.check(resume.task)
    return wire.JSON(render.resume_json(resume))


async def cancel(request: Request) -> Response:
    context = context_of(request)
    task_id = request.path_params["task_id"]
    context.guard.management(request)
    reason = wire.parse_cancel(await context.body(request)).reason
    transition = await context.gateway.book.act(task_id, lambda task, now: cancel_task(task, now, reason))
    if transition.reason == "cancelled":
        context.gateway.metrics.tasks_cancelled.inc()
    return wire.JSON(render.cancel_json(transition))
