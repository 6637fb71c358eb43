"""Live push: ``/v1/tasks/{id}/ws`` (one task), ``/v1/ws`` (many) and ``/v1/tasks/{id}/stream`` (SSE).

Each connection has a :class:`~gateway.live.hub.Feed` and one writer that sends its frames; a write that makes
no progress for ``write_timeout`` closes the connection with ``4008``, so a peer that stopped reading costs
a bounded backlog and then nothing. Sockets are accepted first, then refused with an error frame and a
close code, so that browsers see why (protocol.md, Close codes). A subscription lasts no longer than the
token that authorized it (``gateway.web.expiry``): at its ``exp`` it ends with an ``unauthorized`` error frame
(the single-task socket closes ``4401``; an SSE stream ends), as an HTTP read with it would be refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import orjson
from starlette.requests import HTTPConnection, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from gateway.errors import (
    CLOSE_INTERNAL_ERROR,
    CLOSE_NORMAL,
    CLOSE_SLOW_CONSUMER,
    CLOSE_TOO_MANY_REFUSALS,
    CLOSE_UNAUTHORIZED,
    Forbidden,
    GatewayError,
    InvalidRequest,
    TooManySockets,
    Unavailable,
)
from gateway.frames import PONG, Frame, error_frame
from gateway.live.feed import Feed
from gateway.machine import same_history
from gateway.runtime import Gateway
from gateway.store.database import database_unavailable
from gateway.tokens import EXPIRED
from gateway.web.auth import Grant, Guard, origin_allowed
from gateway.web.expiry import Expiries, end_subscription
from gateway.web.extensions import connection, direct_socket
from gateway.web.tag_messages import TagMessage, tag_message, tag_of
from gateway.web.wire import Cursor, message_cursor, parse_cursor, query_cursor

log = logging.getLogger("gateway")
UNAVAILABLE = "the database is unreachable; try again"
# A close code of our own for "the peer went away": nothing is sent then.
_GONE = -1
_HEARTBEAT = Frame("heartbeat", -1, "")
SSE_HEARTBEAT_S = 15.0
SSE_RETRY_MS = 1000
# A /v1/ws socket that holds no subscription is closed at this many messages refused (answered with an error
# frame) since it opened or last held one (protocol.md, Close codes); one holding a subscription is not.
MAX_REFUSALS = 5


def socket_origin_allowed(conn: HTTPConnection, allowed: tuple[str, ...]) -> bool:
    """The handshake's ``Origin``, by the same rule as the HTTP routes' (``gateway.web.auth``)."""
    return origin_allowed(conn.headers.get("origin"), conn.headers.get("host"), allowed)


def live_routes(gw: Gateway, guard: Guard) -> list[Route | WebSocketRoute]:
    settings = gw.settings
    slow_close_grace_s = settings.slow_close_grace_ms / 1000
    expiries: dict[Feed, Expiries] = {}  # each open socket's

    def authorized(ws: WebSocket) -> None:
        """A subscription of this socket is authorized: its client may send larger messages from now on."""
        socket = direct_socket(ws.scope)
        if socket is not None:
            socket.authorized(settings.ws_max_message_bytes)

    def new_feed() -> Feed:
        return Feed(
            gw.hub,
            gw.book,
            backlog=settings.subscription_backlog,
            max_subscriptions=settings.max_subscriptions,
        )

    async def subscribe(feed: Feed, grant: Grant, task_id: str, cursor: Cursor) -> object:
        """Subscribe ``feed`` to the task as ``grant`` allows, from ``cursor`` (a version, and the epoch of
        its history if given); the subscription is returned. A tag token's task is read once first (it must
        carry the tag: the subscription's resume frame would show it otherwise), and no such task is the
        same ``Forbidden`` to it as a task without its tag."""
        with grant.reading():
            if grant.tag is not None:
                grant.check(await gw.book.get(task_id))
            return await feed.subscribe(task_id, *cursor)

    async def refuse(ws: WebSocket, exc: GatewayError, task_id: str | None) -> None:
        await ws.send_text(error_frame(exc.code, exc.message, task_id).text)
        await ws.close(exc.close_code)

    async def pump(ws: WebSocket, feed: Feed, *, single: bool) -> None:
        """Read the peer's messages while a writer sends the feed's frames, until either side ends.

        The connection's own task reads; the writer is a task that runs only while frames wait for it (most
        go out through the hub's direct writes), so an idle socket holds one task, not two."""
        writer = _Writer(feed, lambda: write(ws, feed, single=single))
        try:
            with anyio.CancelScope() as reading:
                writer.on_end = reading.cancel
                writer.start()
                await read(ws, feed, single)
            code = await writer.result()
        finally:
            writer.cancel()
        if code == _GONE:
            return
        grace = 1.0
        if code == CLOSE_SLOW_CONSUMER:
            # Its close frame waits behind what the peer has not read: let go of its subscriptions now,
            # and tell it 4008 if it drains its socket within the grace; past that it is dropped (1006).
            feed.release()
            socket = direct_socket(ws.scope)
            if socket is not None and socket.close_stalled(code, slow_close_grace_s):
                return
            grace = slow_close_grace_s
        with anyio.move_on_after(grace):
            with contextlib.suppress(WebSocketDisconnect, OSError, RuntimeError):
                await ws.close(code)

    async def write(ws: WebSocket, feed: Feed, *, single: bool) -> int | None:
        """Send what the feed has; ``None`` once it has nothing more for now, else how the socket ends."""
        # A send that makes no progress for write_timeout is cancelled by the hub's watchdog (one timer
        # for all sockets, instead of a timeout scope around every frame).
        with anyio.CancelScope() as scope:
            feed.on_stall = scope.cancel
            while True:
                if not feed.has_work():
                    feed.on_stall = None
                    return None
                item = await feed.next()
                if item is None:
                    return feed.close_code if feed.close_code is not None else _GONE
                subscription, frame = item
                feed.writing_since = gw.hub.monotonic()
                try:
                    await ws.send_text(frame.text)
                except (WebSocketDisconnect, OSError, RuntimeError):
                    return _GONE
                feed.writing_since = None
                if subscription is None or not subscription.finished:
                    continue
                if single:
                    return CLOSE_NORMAL  # the stream of this task is complete
                if feed.subscriptions.get(subscription.task_id) is subscription:
                    feed.unsubscribe(subscription.task_id)
        gw.metrics.slow_consumers.inc()
        return CLOSE_SLOW_CONSUMER

    async def read(ws: WebSocket, feed: Feed, single: bool) -> None:
        while feed.peer.closing is None:  # once closing, what it sends is not read
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                feed.close(_GONE)
                return
            raw = message.get("text")
            if raw is None:
                raw = message.get("bytes") or b""
            answer = await (handle_single(raw) if single else handle_multi(ws, feed, raw))
            # Answers wait for room in the bounded control queue: the client's messages are read no
            # faster than it reads the answers (one that stops reading is cut by the write watchdog).
            while answer is not None and not feed.send_control(answer):
                if feed.close_code is not None or feed.peer.closing is not None:
                    return
                await feed.control_room()
            if answer is not None and answer.type == "error" and feed.peer.refused():
                message_text = (
                    f"{MAX_REFUSALS} messages refused on a socket that holds no subscription; closing"
                )
                feed.close_after(error_frame("too-many-refusals", message_text), CLOSE_TOO_MANY_REFUSALS)

    async def handle_single(raw: str | bytes) -> Frame | None:
        try:
            message = _message(raw)
        except InvalidRequest as exc:
            return error_frame(exc.code, exc.message)
        if message.get("type") == "ping":
            return PONG
        return error_frame("invalid-request", 'this socket takes only {"type": "ping"}')

    async def handle_multi(ws: WebSocket, feed: Feed, raw: str | bytes) -> Frame | None:
        task_id: str | None = None
        tag: str | None = None
        try:
            message = _message(raw)
            kind = message.get("type")
            if kind == "ping":
                return PONG
            if kind not in ("subscribe", "unsubscribe"):
                raise InvalidRequest(f"type: must be subscribe, unsubscribe or ping, got {_show(kind)}")
            if "tag" in message:
                tag = tag_of(message)
                await handle_tag(ws, feed, tag_message(kind, message, settings.tag_subscription_max))
                return None
            task_id = message.get("taskId")
            if not isinstance(task_id, str):
                task_id = None
                raise InvalidRequest("taskId: must be a string")
            if kind == "unsubscribe":
                feed.unsubscribe_task(task_id)  # a tag of the socket listing the task streams it on
                return None
            token = message.get("token")
            if token is not None and not isinstance(token, str):
                raise InvalidRequest("token: must be a string")
            cursor = message_cursor(message.get("cursor", 0))
            # A task's subscribe token, or a tag token for a tag of the task: the API key is taken from the
            # Authorization header alone (it has no business in a browser's socket message).
            grant = guard.task_credential(token, task_id, "subscribe", where="a subscribe message")
            sub = await subscribe(feed, grant, task_id, cursor)
            authorized(ws)
            ended = error_frame("unauthorized", f"{EXPIRED}: subscribe again with a new one", task_id)
            end = functools.partial(end_subscription, feed, ended, task_id=task_id)
            expiries[feed].watch(("task", task_id), sub, grant.expires_at, end)
            return None
        except GatewayError as exc:
            return error_frame(exc.code, exc.message, task_id, tag=tag)
        except Exception as exc:
            if not database_unavailable(exc):
                raise
            return error_frame("unavailable", UNAVAILABLE, task_id, tag=tag)

    async def handle_tag(ws: WebSocket, feed: Feed, message: TagMessage) -> None:
        """A tag's subscribe (its tasks listed, each resumed from the client's cursor, then the ones created
        later announced) or unsubscribe (its tasks' streams end too)."""
        if message.kind == "unsubscribe":
            feed.unsubscribe_tag(message.tag)
            return
        # A tag token for this tag (or none in open mode); never the API key, as for a task's subscribe.
        exp = guard.tag_credential(message.token, message.tag, where="a subscribe message")
        tag_sub = await feed.subscribe_tag(
            message.tag, message.cursors, settings.tag_subscription_max, message.epochs
        )
        authorized(ws)
        tag = message.tag
        ended = error_frame("unauthorized", f"{EXPIRED}: subscribe again with a new one", tag=tag)
        expiries[feed].watch(
            ("tag", tag), tag_sub, exp, functools.partial(end_subscription, feed, ended, tag=tag)
        )

    async def task_socket(ws: WebSocket) -> None:
        await ws.accept()
        task_id = ws.path_params["task_id"]
        feed = new_feed()
        feed.direct = direct_socket(ws.scope)
        expiry = Expiries(feed)
        try:
            try:
                if not socket_origin_allowed(ws, settings.allowed_origins):
                    raise Forbidden("origin not allowed")
                grant = guard.task(ws, task_id, "subscribe")
                sub = await subscribe(feed, grant, task_id, query_cursor(ws.query_params))
                authorized(ws)
                ended = error_frame("unauthorized", f"{EXPIRED}: connect again with a new one", task_id)
                end = functools.partial(feed.close_after, ended, CLOSE_UNAUTHORIZED)
                expiry.watch(("task", task_id), sub, grant.expires_at, end)
            except GatewayError as exc:
                await refuse(ws, exc, task_id)
                return
            except Exception as exc:
                if not database_unavailable(exc):
                    raise
                await refuse(ws, Unavailable(UNAVAILABLE), task_id)  # closes with 1013: try again later
                return
            await pump(ws, feed, single=True)
        finally:
            expiry.close()
            feed.release()

    async def multi_socket(ws: WebSocket) -> None:
        await ws.accept()
        if not socket_origin_allowed(ws, settings.allowed_origins):
            await refuse(ws, Forbidden("origin not allowed"), None)
            return
        feed = new_feed()
        feed.direct = direct_socket(ws.scope)
        # Held to having a subscription: one with no credential costs a bounded time and work.
        feed.hold_to(settings.ws_auth_deadline_s, MAX_REFUSALS)
        expiries[feed] = Expiries(feed)
        try:
            await pump(ws, feed, single=False)
        finally:
            expiries.pop(feed).close()
            feed.release()

    async def stream(request: Request) -> Response:
        task_id = request.path_params["task_id"]
        grant = guard.task(request, task_id, "subscribe")
        last_id = request.headers.get("last-event-id")
        cursor = query_cursor(request.query_params)  # a bad one is refused even where Last-Event-ID wins
        if last_id is not None:
            cursor = parse_cursor(last_id)
        if last_id is not None or grant.tag is not None:
            with grant.reading():
                task = grant.check(await gw.book.get(task_id))
            version, epoch = cursor
            ended = task.terminal and version >= task.version and same_history(task, epoch)
            if last_id is not None and ended:
                # An EventSource reconnecting after the last frame: 204 tells it to stop reconnecting.
                return Response(status_code=204)
        # A stream holds its connection's descriptor for as long as it lasts: none past the process's ceiling
        # (the descriptors left answer callbacks and health checks), as for a WebSocket.
        handle = connection(request.scope)
        refused = handle.refuse_stream() if handle is not None else None
        if refused is not None:
            raise TooManySockets(refused)
        feed = new_feed()
        try:
            with grant.reading():  # a task deleted meanwhile is no more than any other to a tag token
                sub = await feed.subscribe(task_id, *cursor)
        except BaseException:
            feed.release()
            raise
        expiry = Expiries(feed)  # at the token's exp the stream ends; its reconnect is refused (401)
        expiry.watch(
            ("task", task_id), sub, grant.expires_at, functools.partial(feed.close, CLOSE_UNAUTHORIZED)
        )
        # A stream whose client stopped reading: the watchdog drops its connection (no close frame here).
        if handle is not None:
            feed.on_stall = handle.abort
        return StreamingResponse(
            sse(feed, expiry),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def sse(feed: Feed, expiry: Expiries) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        timer: asyncio.TimerHandle | None = None

        def heartbeat() -> None:
            nonlocal timer
            feed.send_control(_HEARTBEAT)
            timer = loop.call_later(SSE_HEARTBEAT_S, heartbeat)

        timer = loop.call_later(SSE_HEARTBEAT_S, heartbeat)
        try:
            yield f"retry: {SSE_RETRY_MS}\n\n"  # a dropped stream is retried after 1 s, not the browser's 3
            while True:
                item = await feed.next()
                if item is None:
                    return
                subscription, frame = item
                # Each yield returns once the chunk is written: the watchdog times it like a socket send.
                feed.writing_since = gw.hub.monotonic()
                if subscription is None:
                    yield ": heartbeat\n\n"
                else:
                    yield f"event: {frame.type}\nid: {frame.cursor}\ndata: {frame.text}\n\n"
                feed.writing_since = None
                if subscription is not None and subscription.finished:
                    return
        finally:
            timer.cancel()
            expiry.close()
            feed.release()

    return [
        WebSocketRoute("/v1/tasks/{task_id}/ws", task_socket),
        WebSocketRoute("/v1/ws", multi_socket),
        Route("/v1/tasks/{task_id}/stream", stream, methods=["GET"]),
    ]


class _Writer:
    """A connection's writer task, started when its feed has work and ended when it has none."""

    __slots__ = ("_code", "_done", "_feed", "_task", "_write", "on_end")

    def __init__(self, feed: Feed, write: Callable[[], Awaitable[int | None]]) -> None:
        self._feed = feed
        self._write = write
        self._task: asyncio.Task[None] | None = None
        self._code: int | None = None
        self._done: asyncio.Future[None] | None = None
        self.on_end: Callable[[], object] | None = None
        feed.on_work = self.start

    def start(self) -> None:
        if self._task is None and self._code is None and self._feed.has_work():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        code: int | None = _GONE
        try:
            code = await self._write()
        except Exception:
            log.exception("sending to a WebSocket failed")
            code = CLOSE_INTERNAL_ERROR
        finally:
            self._task = None
            if code is not None:
                self._code = code
                self._feed.on_work = None
                if self._done is not None and not self._done.done():
                    self._done.set_result(None)
                if self.on_end is not None:
                    self.on_end()
        self.start()  # work that came while the last frame was being sent

    async def result(self) -> int:
        """How the socket ends, once the reading side has ended (the feed is closed then)."""
        self.start()
        while self._code is None:
            self._done = asyncio.get_running_loop().create_future()
            await self._done
        return self._code

    def cancel(self) -> None:
        self._feed.on_work = None
        if self._task is not None:
            self._task.cancel()


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _message(raw: str | bytes) -> dict[str, Any]:
    try:
        message = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"malformed JSON: {exc}") from None
    if not isinstance(message, dict):
        raise InvalidRequest("message: must be a JSON object")
    return message
