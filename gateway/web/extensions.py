"""What the gateway's own uvicorn protocols (``gateway.server``) lend a connection through the ASGI scope's
``extensions``: the live endpoints use them where they are, and do without them under any other server.

- ``gateway.direct`` (a WebSocket): a :class:`DirectSocket`, which the hub writes already-framed bytes to
  while the socket has room, past the ASGI send path;
- ``gateway.connection`` (an HTTP request): a :class:`Connection` the write watchdog can abort (an SSE
  stream whose client stopped reading), and that says whether the process has room for a stream.
"""

from __future__ import annotations

from typing import Any, Protocol

DIRECT = "gateway.direct"
CONNECTION = "gateway.connection"


class DirectSocket(Protocol):
    def can_write(self, size: int) -> bool:
        """Whether ``size`` more bytes fit in the transport's buffer now."""
        ...

    def write(self, data: bytes) -> None: ...

    def authorized(self, max_message_bytes: int) -> None:
        """A subscription of this socket is authorized: it may receive larger messages from now on."""
        ...

    def close(self, code: int) -> bool:
        """Send a close frame with ``code`` now (the app's next receive is the disconnect); ``False`` if the
        socket is closing already."""
        ...

    def close_stalled(self, code: int, grace_s: float) -> bool:
        """Close a socket cut for not reading: the close frame waits ``grace_s`` for it, then the socket is
        reset. ``False`` if the socket cannot be closed that way (the caller closes it as usual)."""
        ...


class Connection(Protocol):
    def abort(self) -> None: ...

    def refuse_stream(self) -> str | None:
        """Why this connection may not become a long-lived stream (the process's open connections are past
        its descriptor limit less the reserve: the refusal is counted and logged), or ``None``."""
        ...


def direct_socket(scope: Any) -> DirectSocket | None:
    extension: DirectSocket | None = scope.get("extensions", {}).get(DIRECT)
    return extension


def connection(scope: Any) -> Connection | None:
    extension: Connection | None = scope.get("extensions", {}).get(CONNECTION)
    return extension
