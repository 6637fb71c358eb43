"""The WebSocket protocol the gateway serves with: uvicorn's, plus a direct way to write frames.

Fan-out sends one entry to many sockets. Through ASGI, each frame costs a wake-up of that connection's
writer task, a pass through Starlette and uvicorn's ``send`` and a framing of the same text again. Like
``websockets``' ``broadcast()``, the hub instead frames an entry once (server frames are not masked, so the
same bytes are valid on every socket) and writes them straight to each transport whose buffer has room;
only a socket whose buffer is full falls back to its connection's bounded queue and writer task. The
extension ``gateway.direct`` in the ASGI scope is how the app finds a connection's :class:`DirectWriter`.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

DIRECT = "gateway.direct"
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


class GatewayWebSocketProtocol(WebSocketsSansIOProtocol):
    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"][DIRECT] = DirectWriter(self)
