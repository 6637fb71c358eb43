"""The HTTP protocol the gateway serves with: uvicorn's (httptools), plus the limits a connection needs
before any route runs, so that a stranger cannot hold memory or sockets for free.

uvicorn's httptools protocol bounds neither the size nor the number of request headers (httptools keeps
an unfinished header in memory however long it grows), arms its keep-alive timer only after a response
(a connection that sends nothing, or sends its headers a byte at a time, is never timed out) and cancels
that timer on any byte received. Here every connection is, at every moment, in one phase with one
deadline that received bytes do not extend:

- ``idle`` (connected, or between requests): closed after ``idle_timeout``, unless a request's first
  bytes are already waiting in the socket (see ``_idle_expired``);
- ``headers`` (from a request's first byte): ``431 headers-too-large`` past ``max_header_bytes`` or
  ``max_header_count``; ``408 request-timeout`` past ``header_timeout``;
- ``body`` (headers done, body not): the route that reads the body answers ``408`` past ``body_timeout``
  (``gateway.web.request_body``); a body no route reads is dropped with its connection then.

Connections from one client address are counted (WebSockets included, until they close): past
``max_connections_per_address`` a new one is answered ``429 too-many-connections`` at once and closed.

The process's open connections are counted too, against its file descriptor limit (the soft
``RLIMIT_NOFILE``): past that limit less ``fd_reserve`` a WebSocket is answered ``503 too-many-sockets``
instead of upgraded, and an SSE stream the same by its route (:meth:`ConnectionHandle.refuse_stream`), each
counted in ``gateway_sockets_refused`` and said once in the log, so that the descriptors left keep
answering callbacks, health checks and the database, which a process out of descriptors could no longer do.

A refusal is written at once, the write side shut, and whatever the client still sends discarded for a
moment before the socket is dropped (closing a socket with unread data would reset the connection and
could destroy the answer before the client reads it).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import resource
import socket
import struct
import termios
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, ClassVar, cast

import orjson
from prometheus_client import Counter
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gateway.settings import Settings
from gateway.web.extensions import CONNECTION

log = logging.getLogger("gateway.http")

# How long a refused connection discards what its client still sends before it is dropped.
LINGER_S = 1.0


@dataclass(frozen=True)
class ConnectionLimits:
    max_header_bytes: int
    max_header_count: int
    header_timeout_s: float
    body_timeout_s: float
    idle_timeout_s: float
    max_per_address: int

    @classmethod
    def of(cls, settings: Settings) -> ConnectionLimits:
        return cls(
            max_header_bytes=settings.max_header_bytes,
            max_header_count=settings.max_header_count,
            header_timeout_s=settings.header_timeout_ms / 1000,
            body_timeout_s=settings.body_timeout_ms / 1000,
            idle_timeout_s=settings.idle_timeout_ms / 1000,
            max_per_address=settings.max_connections_per_address,
        )


def drop(transport: asyncio.Transport) -> None:
    """Close a connection now and have the kernel forget it: with a zero linger the socket is reset and
    its unsent data freed. (A plain close of a socket whose peer does not read leaves the kernel holding
    it, unsent data and all, for minutes of zero-window probes.)"""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def unread_bytes(transport: asyncio.Transport) -> int:
    """How many received bytes wait in the socket's kernel buffer, not read by the loop yet (0 if unknown)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        waiting: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
    except (OSError, ValueError):
        return 0
    return waiting


class AddressSlots:
    """Open connections per client address, within ``limit`` (0: not counted)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.counts: dict[str, int] = {}

    def take(self, address: str) -> bool:
        if self.limit <= 0:
            return True
        count = self.counts.get(address, 0)
        if count >= self.limit:
            return False
        self.counts[address] = count + 1
        return True

    def release(self, address: str) -> None:
        if self.limit <= 0:
            return
        count = self.counts.get(address, 0) - 1
        if count <= 0:
            self.counts.pop(address, None)
        else:
            self.counts[address] = count


class Sockets:
    """The connections this process holds open (HTTP and WebSocket alike), and how many it may hold before
    a new WebSocket is refused: its soft descriptor limit less ``reserve`` (``ceiling`` 0: no ceiling)."""

    def __init__(self, reserve: int, refused: Counter | None = None) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.ceiling = max(1, soft - reserve) if reserve > 0 and soft != resource.RLIM_INFINITY else 0
        self.reserve = reserve
        self.limit = soft
        self.open = 0
        self.refused = refused
        self._said = False

    def full(self) -> bool:
        """Whether a new WebSocket would pass the ceiling (the connection asking is counted already)."""
        return 0 < self.ceiling < self.open

    def refuse(self) -> str:
        """Count a refused WebSocket or SSE stream (said once in the log); the client's message."""
        if self.refused is not None:
            self.refused.inc()
        if not self._said:
            self._said = True
            log.warning(
                "refusing new WebSockets and SSE streams (503 too-many-sockets): %d connections open, past "
                "%d, this process's descriptor limit of %d less the %d kept for callbacks "
                "(GATEWAY_FD_RESERVE); said once",
                self.open,
                self.ceiling,
                self.limit,
                self.reserve,
            )
        return (
            f"this gateway process holds {self.open - 1} connections, as many as its file descriptors allow: "
            "try again later, or another process"
        )

    def release(self) -> None:
        self.open -= 1


class ConnectionHandle:
    """What a route may do to its own connection: drop it (a stream whose client stopped reading), or learn
    that the process has no room for a stream on it."""

    __slots__ = ("_protocol",)

    def __init__(self, protocol: GatewayHttpProtocol) -> None:
        self._protocol = protocol

    def abort(self) -> None:
        transport = self._protocol.transport
        if transport is not None:
            drop(transport)

    def refuse_stream(self) -> str | None:
        """Why this connection may not become an SSE stream: the process is past its ceiling (as a new
        WebSocket would be), or ``None``."""
        sockets = self._protocol.sockets
        return sockets.refuse() if sockets.full() else None


class _HeaderLimit(Exception):
    """Raised inside the parser's callback to stop it (uvicorn then calls ``send_400_response``)."""


class GatewayHttpProtocol(HttpToolsProtocol):
    limits: ClassVar[ConnectionLimits]
    slots: ClassVar[AddressSlots]
    sockets: ClassVar[Sockets]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase = "idle"
        self._header_bytes = 0
        self._header_count = 0
        self._timer: asyncio.TimerHandle | None = None
        self._address: str | None = None  # the slot this connection holds
        self._refused = False
        self._too_many_headers = False
        self._header_size = 0  # the parsed header lines' bytes of the request being read
        self._headers_oversize = False
        self._idle_extended = False  # this idle phase was extended once for bytes waiting unread
        self._counted = False  # this connection is among ``sockets.open``

    # --- the connection ---------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.sockets.open += 1
        self._counted = True
        address = self.client[0] if self.client else None
        if address is not None:
            if not self.slots.take(address):
                self._refuse(
                    429,
                    "too-many-connections",
                    f"at most {self.slots.limit} open connections per client address",
                )
                return
            self._address = address
        self._arm(self.limits.idle_timeout_s, self._idle_expired)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._release()
        if self._counted:
            self._counted = False
            self.sockets.release()
        super().connection_lost(exc)

    def _release(self) -> None:
        if self._address is not None:
            self.slots.release(self._address)
            self._address = None

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # discarded while the refusal lingers
        if self._phase != "body":
            self._header_bytes += len(data)
        super().data_received(data)
        if (
            self._phase == "headers"
            and self._header_bytes > self.limits.max_header_bytes
            and not self._refused
            and not self.transport.is_closing()
        ):
            self._headers_too_large(f"request headers over {self.limits.max_header_bytes} bytes")

    def handle_websocket_upgrade(self) -> None:
        if self.sockets.full():
            self._refuse(503, "too-many-sockets", self.sockets.refuse())
            return
        self._cancel()
        super().handle_websocket_upgrade()
        # The WebSocket protocol owns the transport (and this connection's count) from now on.
        count = getattr(self.transport.get_protocol(), "hand_over_count", None)
        if count is not None and self._counted:
            count(self.sockets.release)
            self._counted = False
        # The WebSocket protocol owns the transport (and this connection's slot) from now on.
        release = getattr(self.transport.get_protocol(), "hand_over_slot", None)
        if release is not None and self._address is not None:
            release(self.slots, self._address)
            self._address = None

    def send_400_response(self, msg: str) -> None:
        if self._too_many_headers:
            self._headers_too_large(f"more than {self.limits.max_header_count} request headers")
            return
        if self._headers_oversize:
            self._headers_too_large(f"request headers over {self.limits.max_header_bytes} bytes")
            return
        super().send_400_response(msg)

    # --- the parser's callbacks -------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        cast(dict[str, Any], self.scope)["extensions"] = {CONNECTION: ConnectionHandle(self)}
        self._phase = "headers"
        self._header_count = 0
        self._header_size = 0
        self._idle_extended = False
        self._arm(self.limits.header_timeout_s, self._headers_expired)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_header_count:
            self._too_many_headers = True
            raise _HeaderLimit
        # Counted as parsed too: a request whose headers arrive in one read is parsed whole by that read,
        # before data_received could count its bytes against the limit.
        self._header_size += len(name) + len(value) + 4
        if self._header_size > self.limits.max_header_bytes:
            self._headers_oversize = True
            raise _HeaderLimit
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._phase = "body"
        self._header_bytes = 0
        self._arm(self.limits.body_timeout_s, self._body_expired)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._phase = "idle"
        self._header_bytes = 0
        self._cancel()
        super().on_message_complete()
        if self.cycle is not None and self.cycle.response_complete:
            # Answered before its body was all in (a 429, a 401): idle from now on.
            self._arm(self.limits.idle_timeout_s, self._idle_expired)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if (
            self._phase == "idle"
            and not self.transport.is_closing()
            and (self.cycle is None or self.cycle.response_complete)
        ):
            self._arm(self.limits.idle_timeout_s, self._idle_expired)

    # --- deadlines --------------------------------------------------------------------------------------

    def _arm(self, delay_s: float, callback: Any) -> None:
        self._cancel()
        self._timer = self.loop.call_later(delay_s, callback)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _idle_expired(self) -> None:
        """Close an idle connection, unless its next request is already here: received by the kernel but
        not read yet, because the loop was busy past the deadline (uvloop runs the timers that are due
        before it reads the sockets). Closing then would reset a request the client sent in time, unanswered
        however long the loop was busy. It is read in this same turn of the loop, which starts its header
        deadline; a client whose waiting bytes begin no request gets one more idle period, not more."""
        self._timer = None
        if self._phase != "idle" or (self.cycle is not None and not self.cycle.response_complete):
            return
        if not self._idle_extended and unread_bytes(self.transport) > 0:
            self._idle_extended = True
            self._arm(self.limits.idle_timeout_s, self._idle_expired)
            return
        self.transport.close()

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's own keep-alive timer, armed after each response with the same delay as the idle one
        (``server_config``): closing is left to ``_idle_expired``, which does not reset a waiting request."""

    def _headers_expired(self) -> None:
        self._timer = None
        if self._phase == "headers":
            seconds = f"{self.limits.header_timeout_s:g}"
            self._refuse(408, "request-timeout", f"the request headers did not arrive within {seconds} s")

    def _body_expired(self) -> None:
        self._timer = None
        if self._phase != "body":
            return
        if self.cycle is not None and self.cycle.response_complete:
            self.transport.close()  # answered without its body, which is still trickling in
        else:
            # The route is reading it (and answers 408 by itself) or still working: look again later.
            self._arm(self.limits.body_timeout_s, self._body_expired)

    # --- refusals ---------------------------------------------------------------------------------------

    def _headers_too_large(self, message: str) -> None:
        self._refuse(431, "headers-too-large", message)

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer ``status`` with the error, then close (lingering, so that the answer is read)."""
        self._refused = True
        self._cancel()
        self._release()
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a response is under way: nothing can be written in between
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "-"
        log.info("%s - refused: %d %s", client, status, message)
        body = orjson.dumps({"error": {"code": code, "message": message}}) + b"\n"  # as every JSON answer
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(body)}\r\n"
            "connection: close\r\n\r\n"
        )
        transport = self.transport
        transport.write(head.encode() + body)
        try:
            if transport.can_write_eof():
                transport.write_eof()
            else:
                transport.close()
        except OSError:  # the client is already gone
            drop(transport)
            return
        self._timer = self.loop.call_later(LINGER_S, drop, transport)


def http_protocol(settings: Settings, refused: Counter | None = None) -> type[GatewayHttpProtocol]:
    """The protocol class for one server: its limits, one count of connections per address, and one of
    the process's open connections (``refused``: the metric of WebSockets refused for descriptors)."""
    limits = ConnectionLimits.of(settings)
    attributes = {
        "limits": limits,
        "slots": AddressSlots(limits.max_per_address),
        "sockets": Sockets(settings.fd_reserve, refused),
    }
    return type("GatewayHttpProtocol", (GatewayHttpProtocol,), attributes)
