"""A task's streams (protocol.md, Streams): ``POST /v1/tasks/{id}/streams/{name}`` (an append, through
group commit with the callbacks, counted against the task's callback rate before its body is read), and
the reads: a page from an offset, the text, the list. What they take is ``gateway.web.stream_wire``', what
they decide ``gateway.streams``', what they read ``gateway.book.stream_reads``'."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.datastructures import QueryParams
from starlette.requests import Request
from starlette.responses import Response

from gateway.book.outcomes import CallbackRequest
from gateway.errors import InvalidRequest
from gateway.streams import MAX_APPEND_BYTES, Append, Chunks, check_name
from gateway.web import wire
from gateway.web.auth import Grant
from gateway.web.context import Context, context_of
from gateway.web.render import lease_json
from gateway.web.request_body import read_body
from gateway.web.stream_wire import PageQuery, parse_append, parse_offset


def _query(params: QueryParams, allowed: tuple[str, ...] = ()) -> dict[str, str]:
    """A query's single values but the credential (``token``, read by the guard); one given twice, or one
    a route does not take, is refused."""
    repeated = sorted({name for name, _ in params.multi_items() if len(params.getlist(name)) > 1})
    if repeated:
        raise InvalidRequest(f"{repeated[0]}: given more than once")
    unknown = sorted(set(params) - {*allowed, "token"})
    if unknown:
        raise InvalidRequest(f"{unknown[0]}: unknown query parameter")
    return {name: value for name, value in params.items() if name != "token"}


def _reader(request: Request) -> tuple[Context, str, Grant]:
    """A read's context, task id and grant (any credential that reads the task)."""
    context = context_of(request)
    task_id = request.path_params["task_id"]
    return context, task_id, context.guard.task(request, task_id, "subscribe")


async def append_or_page(request: Request) -> Response:
    # One route for both methods, so that another method is answered 405 with both in Allow.
    return await (page(request) if request.method in ("GET", "HEAD") else append(request))


async def append(request: Request) -> Response:
    context = context_of(request)
    gw = context.gateway
    with gw.committer.answering():  # fan-out yields from here on (gateway.live.hub)
        task_id = request.path_params["task_id"]
        context.guard.producer(request, task_id)
        context.callback_rate.take(task_id)  # before the body is read: a flood costs no parsing
        name = check_name(request.path_params["name"])
        _query(request.query_params)
        body = parse_append(await read_body(request, MAX_APPEND_BYTES, context.body_timeout_s))
        asked = Append(name, body.attempt, body.seq, Chunks.of(body.chunks))
        outcome = await gw.committer.submit(CallbackRequest(task_id, None, append=asked))
        appended = outcome.appended
        assert appended is not None
        answer: dict[str, Any] = {
            "stream": appended.stream,
            "attempt": appended.attempt,
            "offset": appended.offset,
            "nextOffset": appended.next_offset,
            "duplicate": appended.duplicate,
        }
        if outcome.lease is not None and outcome.lease.heartbeat_ms is not None:
            answer.update(lease_json(outcome.lease))
        return wire.JSON(answer)


async def page(request: Request) -> Response:
    context, task_id, grant = _reader(request)
    name = check_name(request.path_params["name"])
    query = wire._validate(PageQuery, _query(request.query_params, ("offset", "limit")))
    offset, epoch = parse_offset(query.offset)
    with grant.reading():
        task, found = await context.gateway.stream_reads.page(task_id, name, offset, epoch, query.limit)
        grant.check(task)
    answer = {
        "stream": name,
        "epoch": task.epoch,
        "attempt": found.attempt,
        "offset": found.offset,
        "chunks": orjson.Fragment(found.encoded),  # as stored: spliced, never decoded and encoded again
        "nextOffset": found.next_offset,
        "more": found.more,
        "closed": task.terminal,
    }
    return wire.JSON(answer)


async def text(request: Request) -> Response:
    context, task_id, grant = _reader(request)
    name = check_name(request.path_params["name"])
    _query(request.query_params)
    with grant.reading():
        task, found = await context.gateway.stream_reads.text(task_id, name)
        grant.check(task)
    headers = {
        "Stream-Attempt": str(found.attempt),
        "Stream-Next-Offset": str(found.next_offset),
        "Stream-Closed": "true" if task.terminal else "false",
    }
    return Response(found.text, media_type="text/plain; charset=utf-8", headers=headers)


async def listing(request: Request) -> Response:
    context, task_id, grant = _reader(request)
    _query(request.query_params)
    with grant.reading():
        task, heads = await context.gateway.stream_reads.heads(task_id)
        grant.check(task)
    streams = [
        {
            "name": h.name,
            "attempt": h.attempt,
            "nextOffset": h.next_offset,
            "bytes": h.size,
            "closed": task.terminal,
        }
        for h in heads
    ]
    return wire.JSON({"epoch": task.epoch, "streams": streams})
