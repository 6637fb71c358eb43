"""The server-sent events endpoint: ``/v1/tasks/{id}/stream``, one task's frames as an event stream, resumed
from ``Last-Event-ID`` (or the query's cursor) when an ``EventSource`` reconnects.

The stream has a :class:`~gateway.live.hub.Feed`, as a WebSocket has (``gateway.web.sockets``); a stream whose
client stopped reading loses its connection to the write watchdog. It lasts no longer than the token that
authorized it (``gateway.web.expiry``): at its ``exp`` it ends, and the reconnect with it is refused (401).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway.errors import CLOSE_UNAUTHORIZED, TooManySockets
from gateway.frames import Frame
from gateway.live.feed import Feed
from gateway.live.hub import Hub
from gateway.machine import same_history
from gateway.streams import MAX_STREAMS
from gateway.web.context import context_of
from gateway.web.expiry import Expiries
from gateway.web.extensions import connection
from gateway.web.stream_wire import parse_streams, query_streams
from gateway.web.wire import parse_cursor, query_cursor

_HEARTBEAT = Frame("heartbeat", -1, "")
SSE_HEARTBEAT_S = 15.0
SSE_RETRY_MS = 1000


async def stream(request: Request) -> Response:
    context = context_of(request)
    task_id = request.path_params["task_id"]
    grant = context.guard.task(request, task_id, "subscribe")
    last_id = request.headers.get("last-event-id")
    # Bad ones are refused even where Last-Event-ID wins.
    cursor, streams = query_cursor(request.query_params), query_streams(request.query_params)
    if last_id is not None:
        # The cursor, then the next offset of each stream asked: "7:3f9a0c1b7d2e;output:42,log:130".
        held, _, offsets = last_id.partition(";")
        cursor = parse_cursor(held)
        resumed = parse_streams(offsets, "Last-Event-ID")
        if resumed is not None:  # then those of ?streams= it does not name, 8 in all at most
            merged = dict(resumed)
            for name, offset in (streams or {}).items():
                if name not in merged and len(merged) < MAX_STREAMS:
                    merged[name] = offset
            streams = merged
    if last_id is not None or grant.tag is not None:
        with grant.reading():
            task = grant.check(await context.gateway.book.get(task_id))
        version, epoch = cursor
        ended = task.terminal and version >= task.version and same_history(task, epoch)
        if ended and streams and last_id is not None:  # and every stream's chunks and end were sent
            finals = (await context.gateway.stream_reads.next_offsets([task_id])).get(task_id, {})
            ended = all(offset >= finals.get(name, 0) for name, offset in streams.items())
        if last_id is not None and ended:
            # An EventSource reconnecting after the last frame: 204 tells it to stop reconnecting.
            return Response(status_code=204)
    # A stream holds its connection's descriptor for as long as it lasts: none past the process's ceiling
    # (the descriptors left answer callbacks and health checks), as for a WebSocket.
    handle = connection(request.scope)
    refused = handle.refuse_stream() if handle is not None else None
    if refused is not None:
        raise TooManySockets(refused)
    feed = context.new_feed()
    try:
        with grant.reading():  # a task deleted meanwhile is no more than any other to a tag token
            sub = await feed.subscribe(task_id, *cursor, streams=streams)
    except BaseException:
        feed.release()
        raise
    expiry = Expiries(feed)  # at the token's exp the stream ends; its reconnect is refused (401)
    expiry.watch(("task", task_id), sub, grant.expires_at, functools.partial(feed.close, CLOSE_UNAUTHORIZED))
    # A stream whose client stopped reading: the watchdog drops its connection (no close frame here).
    if handle is not None:
        feed.on_stall = handle.abort
    return StreamingResponse(
        _events(context.gateway.hub, feed, expiry),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _events(hub: Hub, feed: Feed, expiry: Expiries) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    timer: asyncio.TimerHandle | None = None

    def heartbeat() -> None:
        nonlocal timer
        feed.send_control(_HEARTBEAT)
        timer = loop.call_later(SSE_HEARTBEAT_S, heartbeat)

    timer = loop.call_later(SSE_HEARTBEAT_S, heartbeat)
    try:
        yield f"retry: {SSE_RETRY_MS}\n\n"  # a dropped stream is retried after 1 s, not the browser's 3
        cursor = ""  # the cursor of the last frame of the task: a stream's frames leave it as it was
        while True:
            item = await feed.next()
            if item is None:
                return
            subscription, frame = item
            # Each yield returns once the chunk is written: the watchdog times it like a socket send.
            feed.writing_since = hub.monotonic()
            if subscription is None:
                yield ": heartbeat\n\n"
            else:
                if frame.version >= 0:
                    cursor = frame.cursor
                streams = subscription.streams
                event_id = cursor if streams is None else f"{cursor};{streams.offsets()}"
                yield f"event: {frame.type}\nid: {event_id}\ndata: {frame.text}\n\n"
            feed.writing_since = None
            if subscription is not None and subscription.finished:
                return
    finally:
        timer.cancel()
        expiry.close()
        feed.release()
