"""The WebSocket protocol the gateway serves with: uvicorn's, plus a direct way to write frames.

Fan-out sends one entry to many sockets. Through ASGI, each frame costs a wake-up of that connection's
writer task, a pass through Starlette and uvicorn's ``send`` and a framing of the same text again. Like
``websockets``' ``broadcast()``, the hub instead frames an entry once (server frames are not masked, so the
same bytes are valid on every socket) and writes them straight to each transport whose buffer has room;
only a socket whose buffer is full falls back to its connection's bounded queue and writer task. The
extension ``gateway.direct`` in the ASGI scope is how the app finds a connection's :class:`DirectWriter`,
which is also its handle on the connection's limits:

- messages from the client are limited to ``ws_max_message_bytes_before_auth`` (uvicorn's ``ws_max_size``,
  checked by ``websockets`` from a frame's header, before its payload is buffered) until the app has
  authorized a subscription, then to ``ws_max_message_bytes`` (:meth:`DirectWriter.authorized`); past
  the limit the socket is closed with ``1009``. Messages are parsed one at a time, each once the app has
  handled the ones before it (:class:`_OneMessageAtATime`), so that a message is judged by the limit those
  left: a subscribe and a large cursors map sent together are both read (the map under the larger limit
  once the subscribe is authorized), where the map used to be judged, and refused, while the subscribe
  was still waiting for its answer;
- a connection cut for not reading (``4008``) gets its close frame behind what it has not read, without
  waiting for room, and is dropped when the grace ends (:meth:`DirectWriter.close_stalled`); uvicorn's
  own close waits for the peer to read, and its keep-alive ping would meanwhile close it with ``1011``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Generator
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.frames import Frame, Opcode
from websockets.protocol import State
from websockets.server import ServerProtocol
from websockets.streams import StreamReader

from gateway.server.http_protocol import AddressSlots, drop
from gateway.server.keepalive import KeepaliveWheel, Pinged, wheel_for
from gateway.web.extensions import DIRECT

# A transport holding more than this unsent is not written to directly: the connection's queue takes over.
BUFFER_LIMIT = 64 * 1024


class DirectWriter:
    """Writes already-framed bytes to one connection's transport, when that is safe right now."""

    __slots__ = ("_protocol",)

    def __init__(self, protocol: GatewayWebSocketProtocol) -> None:
        self._protocol = protocol

    def can_write(self, size: int) -> bool:
        """Whether ``size`` more bytes fit now: the connection is open and its buffer stays within bound."""
        p = self._protocol
        return (
            p.handshake_complete
            and not p.close_sent
            and not p.disconnected
            and not p.transport.is_closing()
            and p.transport.get_write_buffer_size() + size <= BUFFER_LIMIT
        )

    def write(self, data: bytes) -> None:
        self._protocol.transport.write(data)

    def authorized(self, max_message_bytes: int) -> None:
        """A subscription of this connection is authorized: take messages up to ``max_message_bytes``."""
        conn = self._protocol.conn
        if conn.max_message_size is not None and conn.max_message_size < max_message_bytes:
            conn.max_message_size = max_message_bytes

    def close(self, code: int) -> bool:
        """Send a close frame with ``code`` now, as the app's ``websocket.close`` would (its next receive is
        the disconnect), without a pass through the ASGI send path; ``False`` if it is already closing."""
        p = self._protocol
        if self._closing():
            return False
        p.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": ""})
        self._send_close(code, p.close_timeout, p.transport.close)
        return True

    def close_stalled(self, code: int, grace_s: float) -> bool:
        """Queue a close frame with ``code`` behind the unread data and drop the connection ``grace_s``
        later unless the peer has read up to it and answered; ``False`` if it is already closing."""
        if self._closing():
            return False
        self._protocol.stop_keepalive()
        self._send_close(code, grace_s, functools.partial(drop, self._protocol.transport))
        return True

    def _closing(self) -> bool:
        p = self._protocol
        return p.close_sent or p.disconnected or p.transport.is_closing()

    def _send_close(self, code: int, timeout_s: float, then: Callable[[], object]) -> None:
        """Write the close frame, read on to see the peer's answering one, and ``then`` after ``timeout_s``
        unless it came (uvicorn's handle_close and connection_lost cancel the timer; once the app returns it
        leaves a connection with a close timer to it)."""
        p = self._protocol
        p.conn.send_close(code)
        p.transport.write(b"".join(p.conn.data_to_send()))
        p.close_sent = True
        if p.read_paused:
            p.read_paused = False
            p.transport.resume_reading()
        p.read_held()
        p.close_timer = p.loop.call_later(timeout_s, then)


class _HeldReader(StreamReader):
    """websockets' stream reader, which a parser waits at between frames while ``held``: the bytes that follow
    stay buffered, unparsed."""

    held = False

    def at_eof(self) -> Generator[None, None, bool]:
        while self.held:
            yield
        return (yield from super().at_eof())


_DATA = (Opcode.TEXT, Opcode.BINARY, Opcode.CONT)


class _OneMessageAtATime(ServerProtocol):
    """websockets' server protocol that parses nothing past a complete message until :meth:`read_next`: the
    next message's size is then checked against the limit the app has set meanwhile."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.reader: _HeldReader = _HeldReader()
        self.parser = self.parse()  # on the held reader (nothing was received yet)
        next(self.parser)

    def recv_frame(self, frame: Frame) -> None:
        super().recv_frame(frame)
        if frame.fin and frame.opcode in _DATA and self.state is State.OPEN:
            self.reader.held = True

    def read_next(self) -> bool:
        """Parse what is buffered, up to the end of the next message; ``False`` if nothing was held."""
        if not self.reader.held:
            return False
        self.reader.held = False
        if not self.reader.eof:
            next(self.parser)
        return True


class _Inbox:
    """The messages a connection received and its app has not taken yet: what uvicorn keeps in an
    ``asyncio.Queue``, without the queue's four deques (about 3 KiB a socket). A message is parsed only once
    the app has handled the one before (:meth:`GatewayWebSocketProtocol.receive`), so it holds one at a
    time."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list[Any] = []
        self._waiter: asyncio.Future[None] | None = None

    def put_nowait(self, item: Any) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def empty(self) -> bool:
        return not self._items

    async def get(self) -> Any:
        while not self._items:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return self._items.pop(0)


class _Flag:
    """An ``asyncio.Event`` that makes its waiter only when someone waits (uvicorn's ``writable``)."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: list[asyncio.Future[None]] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        self._set = True
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    def clear(self) -> None:
        self._set = False

    async def wait(self) -> None:
        while not self._set:
            waiter = asyncio.get_running_loop().create_future()
            if self._waiters is None:
                self._waiters = []
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if self._waiters is not None and waiter in self._waiters:
                    self._waiters.remove(waiter)


class GatewayWebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's protocol with the memory of an idle socket kept small: a light inbox and ``writable``
    flag, and the handshake's request and response let go once the handshake is answered; keep-alive
    pings sent by the loop's wheel (``server.keepalive``) rather than two timers a socket; a peer that
    misses its keepalive pong is cut at once."""

    keepalive_bucket: dict[Pinged, None] | None = None  # its place in the wheel (server.keepalive)
    _wheel: KeepaliveWheel | None = None
    _slot: tuple[AddressSlots, str] | None = None  # its client address's count (http_protocol)
    _on_lost: Callable[[], None] | None = None  # its count among the process's sockets (http_protocol)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queue = _Inbox()  # type: ignore[assignment]
        self.writable = _Flag()  # type: ignore[assignment]
        self.writable.set()
        conn = self.conn
        self.conn = _OneMessageAtATime(
            extensions=conn.available_extensions, max_size=conn.max_message_size, logger=conn.logger
        )

    async def receive(self) -> Any:
        """The app's next message. Only once it has handled the ones it took (it asks with none waiting) is
        the next one parsed, or the socket read again: uvicorn read on as soon as a message was taken, and
        judged the next one's size before the app had authorized the subscription that raises the limit."""
        if self.queue.empty():
            self.read_held()
            if self.queue.empty() and self.read_paused:
                self.read_paused = False
                self.transport.resume_reading()
        return await self.queue.get()

    def read_held(self) -> None:
        """Parse the message held back, as ``data_received`` would have (a close frame it answers, a
        message too big for the limit now, the events): the app is ready for it, or reads no more."""
        conn = self.conn
        if isinstance(conn, _OneMessageAtATime) and conn.read_next():
            if conn.parser_exc is not None:
                self.handle_parser_exception()
                return
            self.handle_events()

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"][DIRECT] = DirectWriter(self)

    async def send(self, message: Any) -> None:
        await super().send(message)
        if message["type"] == "websocket.close":
            self.read_held()  # the app reads no more: what it held back may be the peer's close frame
        request = getattr(self, "request", None)
        if self.handshake_complete and request is not None:
            # The request's and the response's headers (2 to 3 KiB) are not read after the handshake.
            # websockets' parser keeps the request for the socket's life: its headers are emptied.
            request.headers.clear()
            self.request = None  # type: ignore[assignment]
            self.response = None  # type: ignore[assignment]

    def start_keepalive(self) -> None:
        """Join the loop's wheel: pinged every interval, dropped when a pong is an interval late. uvicorn's
        own timers when pings are off or their timeout is not the interval (options of one's own)."""
        interval = self.ping_interval
        if interval and self.ping_timeout == interval:
            self._wheel = wheel_for(self.loop, interval)
            if self._wheel is not None:
                self._wheel.join(self)
                return
        super().start_keepalive()

    def stop_keepalive(self) -> None:
        if self._wheel is not None:
            self._wheel.leave(self)
        super().stop_keepalive()

    def keepalive_timeout(self) -> None:
        """No pong in time: the peer is gone (no FIN ever came). uvicorn sends a close frame and closes the
        transport, which waits for the unsent bytes a dead peer will never take; abort it instead, so the
        connection and its subscriptions are let go now."""
        super().keepalive_timeout()
        if not self.disconnected:
            drop(self.transport)  # reset: the kernel lets go of the unsent bytes too

    def hand_over_slot(self, slots: AddressSlots, address: str) -> None:
        """This connection counts for its client address until it is lost (``server.http_protocol``)."""
        self._slot = (slots, address)

    def hand_over_count(self, release: Callable[[], None]) -> None:
        """This connection counts among the process's open sockets until it is lost (``http_protocol``)."""
        self._on_lost = release

    def connection_lost(self, exc: Exception | None) -> None:
        if self._on_lost is not None:
            release, self._on_lost = self._on_lost, None
            release()
        if self._slot is not None:
            slots, address = self._slot
            self._slot = None
            slots.release(address)
        super().connection_lost(exc)
