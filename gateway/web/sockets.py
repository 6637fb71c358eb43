"""The WebSocket endpoints: ``/v1/tasks/{id}/ws`` (one task) and ``/v1/ws`` (many, by message).

Each connection has a :class:`~gateway.live.hub.Feed` and one writer that sends its frames; a write that makes
no progress for ``write_timeout`` closes the connection with ``4008``, so a peer that stopped reading costs
a bounded backlog and then nothing. Sockets are accepted first, then refused with an error frame and a
close code, so that browsers see why (protocol.md, Close codes). A subscription lasts no longer than the
token that authorized it (``gateway.web.expiry``): at its ``exp`` it ends with an ``unauthorized`` error frame
(the single-task socket closes ``4401``), as an HTTP read with it would be refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import orjson
from starlette.requests import HTTPConnection
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
    Unavailable,
    one_line,
)
from gateway.frames import PONG, Frame, error_frame
from gateway.live.feed import Feed
from gateway.store.database import database_unavailable
from gateway.tag_names import parent_key, parent_of
from gateway.tokens import EXPIRED
from gateway.web.auth import Grant, origin_allowed
from gateway.web.context import Context, context_of
from gateway.web.expiry import Expiries, end_subscription
from gateway.web.extensions import DirectSocket, direct_socket
from gateway.web.stream_wire import message_streams, query_streams
from gateway.web.tag_messages import TagMessage, parent_of_message, tag_message, tag_of
from gateway.web.wire import Cursor, message_cursor, query_cursor

log = logging.getLogger("gateway")
UNAVAILABLE = "the database is unreachable; try again"
# A close code of our own for "the peer went away": nothing is sent then.
_GONE = -1
# A /v1/ws socket that holds no subscription is closed at this many messages refused (answered with an error
# frame) since it opened or last held one (protocol.md, Close codes); one holding a subscription is not.
MAX_REFUSALS = 5


def socket_origin_allowed(conn: HTTPConnection, allowed: tuple[str, ...]) -> bool:
    """The handshake's ``Origin``, by the same rule as the HTTP routes' (``gateway.web.auth``)."""
    return origin_allowed(conn.headers.get("origin"), conn.headers.get("host"), allowed)


async def task_socket(ws: WebSocket) -> None:
    """``/v1/tasks/{task_id}/ws``: one task's frames, from the query's cursor, until it ends."""
    await ws.accept()
    context = context_of(ws)
    task_id = ws.path_params["task_id"]
    feed = context.new_feed()
    feed.direct = direct_socket(ws.scope)
    expiry = Expiries(feed)
    try:
        try:
            if not socket_origin_allowed(ws, context.gateway.settings.allowed_origins):
                raise Forbidden("origin not allowed")
            grant = context.guard.task(ws, task_id, "subscribe")
            cursor, streams = query_cursor(ws.query_params), query_streams(ws.query_params)
            sub = await subscribe(context, feed, grant, task_id, cursor, streams)
            authorized(context, ws)
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
        await pump(context, ws, feed, expiry, single=True)
    finally:
        expiry.close()
        feed.release()


async def multi_socket(ws: WebSocket) -> None:
    """``/v1/ws``: the tasks and tags its messages subscribe to."""
    await ws.accept()
    context = context_of(ws)
    settings = context.gateway.settings
    if not socket_origin_allowed(ws, settings.allowed_origins):
        await refuse(ws, Forbidden("origin not allowed"), None)
        return
    feed = context.new_feed()
    feed.direct = direct_socket(ws.scope)
    # Held to having a subscription: one with no credential costs a bounded time and work.
    feed.hold_to(settings.ws_auth_deadline_s, MAX_REFUSALS)
    expiry = Expiries(feed)
    try:
        await pump(context, ws, feed, expiry, single=False)
    finally:
        expiry.close()
        feed.release()


def authorized(context: Context, ws: WebSocket) -> None:
    """A subscription of this socket is authorized: its client may send larger messages from now on."""
    socket = direct_socket(ws.scope)
    if socket is not None:
        socket.authorized(context.gateway.settings.ws_max_message_bytes)


async def subscribe(
    context: Context,
    feed: Feed,
    grant: Grant,
    task_id: str,
    cursor: Cursor,
    streams: Mapping[str, int] | None = None,
) -> object:
    """Subscribe ``feed`` to the task as ``grant`` allows, from ``cursor`` (a version, and the epoch of its
    history if given), with ``streams`` from their offsets; the subscription is returned. A tag token's
    task is read once first (it must carry the tag: the subscription's resume frame would show it
    otherwise), and no such task is the same ``Forbidden`` to it as a task without its tag."""
    with grant.reading():
        if grant.tag is not None:
            grant.check(await context.gateway.book.get(task_id))
        return await feed.subscribe(task_id, *cursor, streams=streams)


async def refuse(ws: WebSocket, exc: GatewayError, task_id: str | None) -> None:
    await ws.send_text(error_frame(exc.code, exc.message, task_id).text)
    await ws.close(exc.close_code)


async def pump(context: Context, ws: WebSocket, feed: Feed, expiry: Expiries, *, single: bool) -> None:
    """Read the peer's messages while a writer sends the feed's frames, until either side ends.

    The connection's own task reads; the writer is a task that runs only while frames wait for it (most
    go out through the hub's direct writes), so an idle socket holds one task, not two."""
    writer = _Writer(feed, lambda: write(context, ws, feed, single=single))
    socket = direct_socket(ws.scope)
    if single and socket is not None:
        feed.on_finished = functools.partial(writer.end_directly, socket)
    try:
        with anyio.CancelScope() as reading:
            writer.on_end = reading.cancel
            writer.start()
            await read(context, ws, feed, expiry, single)
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
        slow_close_grace_s = context.gateway.settings.slow_close_grace_ms / 1000
        if socket is not None and socket.close_stalled(code, slow_close_grace_s):
            return
        grace = slow_close_grace_s
    with anyio.move_on_after(grace):
        with contextlib.suppress(WebSocketDisconnect, OSError, RuntimeError):
            await ws.close(code)


async def write(context: Context, ws: WebSocket, feed: Feed, *, single: bool) -> int | None:
    """Send what the feed has; ``None`` once it has nothing more for now, else how the socket ends."""
    hub = context.gateway.hub
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
            subscription, text = item[0], item[1].text
            # Nothing here holds the frame once it is sent: the next one may wait for a store read (a
            # stream's catch-up page), and a socket would otherwise hold its last frame meanwhile.
            item = None
            feed.writing_since = hub.monotonic()
            try:
                await ws.send_text(text)
            except (WebSocketDisconnect, OSError, RuntimeError):
                return _GONE
            text = ""
            feed.writing_since = None
            if subscription is None or not subscription.finished:
                continue
            if single:
                return CLOSE_NORMAL  # the stream of this task is complete
            if feed.subscriptions.get(subscription.task_id) is subscription:
                feed.unsubscribe(subscription.task_id)
    context.gateway.metrics.slow_consumers.inc()
    return CLOSE_SLOW_CONSUMER


async def read(context: Context, ws: WebSocket, feed: Feed, expiry: Expiries, single: bool) -> None:
    while feed.peer.closing is None:  # once closing, what it sends is not read
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            feed.close(_GONE)
            return
        raw = message.get("text")
        if raw is None:
            raw = message.get("bytes") or b""
        answer = await (handle_single(raw) if single else handle_multi(context, ws, feed, expiry, raw))
        # Answers wait for room in the bounded control queue: the client's messages are read no
        # faster than it reads the answers (one that stops reading is cut by the write watchdog).
        while answer is not None and not feed.send_control(answer):
            if feed.close_code is not None or feed.peer.closing is not None:
                return
            await feed.control_room()
        if answer is not None and answer.type == "error" and feed.peer.refused():
            message_text = f"{MAX_REFUSALS} messages refused on a socket that holds no subscription; closing"
            feed.close_after(error_frame("too-many-refusals", message_text), CLOSE_TOO_MANY_REFUSALS)


async def handle_single(raw: str | bytes) -> Frame | None:
    try:
        message = _message(raw)
    except InvalidRequest as exc:
        return error_frame(exc.code, exc.message)
    if message.get("type") == "ping":
        return PONG
    return error_frame("invalid-request", 'this socket takes only {"type": "ping"}')


async def handle_multi(
    context: Context, ws: WebSocket, feed: Feed, expiry: Expiries, raw: str | bytes
) -> Frame | None:
    task_id: str | None = None
    tag: str | None = None
    try:
        message = _message(raw)
        kind = message.get("type")
        if kind == "ping":
            return PONG
        if kind not in ("subscribe", "unsubscribe"):
            raise InvalidRequest(f"type: must be subscribe, unsubscribe or ping, got {_show(kind)}")
        if "tag" in message or "parent" in message:
            parent = parent_of_message(message)
            tag = tag_of(message) if parent is None else parent_key(parent)
            tag_max = context.gateway.settings.tag_subscription_max
            await handle_tag(context, ws, feed, expiry, tag_message(kind, message, tag_max))
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
        grant = context.guard.task_credential(token, task_id, "subscribe", where="a subscribe message")
        streams = message_streams(message.get("streams"))  # after the credential (protocol.md)
        sub = await subscribe(context, feed, grant, task_id, cursor, streams)
        authorized(context, ws)
        ended = error_frame("unauthorized", f"{EXPIRED}: subscribe again with a new one", task_id)
        end = functools.partial(end_subscription, feed, ended, task_id=task_id)
        expiry.watch(("task", task_id), sub, grant.expires_at, end)
        return None
    except GatewayError as exc:
        return error_frame(exc.code, exc.message, task_id, tag=tag)
    except Exception as exc:
        if not database_unavailable(exc):
            raise
        return error_frame("unavailable", UNAVAILABLE, task_id, tag=tag)


async def handle_tag(
    context: Context, ws: WebSocket, feed: Feed, expiry: Expiries, message: TagMessage
) -> None:
    """A tag's subscribe (its tasks listed, each resumed from the client's cursor, then the ones created
    later announced) or unsubscribe (its tasks' streams end too)."""
    if message.kind == "unsubscribe":
        feed.unsubscribe_tag(message.tag)
        return
    parent = parent_of(message.tag)
    if parent is None:
        # A tag token for this tag (or none in open mode); never the API key, as for a task's subscribe.
        exp = context.guard.tag_credential(message.token, message.tag, where="a subscribe message")
    else:  # a batch: the parent's subscribe token, or a tag token of a tag the parent carries
        grant = context.guard.task_credential(message.token, parent, "subscribe", where="a subscribe message")
        with grant.reading():
            grant.check(await context.gateway.book.get(parent))
        exp = grant.expires_at
    tag_sub = await feed.subscribe_tag(
        message.tag, message.cursors, context.gateway.settings.tag_subscription_max, message.epochs
    )
    authorized(context, ws)
    tag = message.tag
    ended = error_frame("unauthorized", f"{EXPIRED}: subscribe again with a new one", tag=tag)
    expiry.watch(("tag", tag), tag_sub, exp, functools.partial(end_subscription, feed, ended, tag=tag))


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
        except Exception as exc:
            if not database_unavailable(exc):
                log.exception("sending to a WebSocket failed")
                code = CLOSE_INTERNAL_ERROR
            else:  # a read the next frame needs (a stream's catch-up page, entries) found no database in time
                log.warning("a WebSocket's read found the database unavailable: %s", one_line(exc))
                code = Unavailable.close_code  # 1013: its client resumes later from what it holds
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

    def end_directly(self, socket: DirectSocket) -> None:
        """The task's terminal frame was written to the socket directly (the hub's fast path): close it
        after that frame the same way, with no writer task and no ASGI send (the reading side's next receive
        is the disconnect), and end as a socket that is gone."""
        feed = self._feed
        feed.on_work = None
        self._code = _GONE
        if self._task is not None:
            self._task.cancel()
        feed.close(CLOSE_NORMAL)  # nothing more is written to it
        socket.close(CLOSE_NORMAL)

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
