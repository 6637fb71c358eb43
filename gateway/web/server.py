"""The uvicorn server the gateway runs under: on shutdown, every subscriber is told ``1001`` first."""

from __future__ import annotations

import socket
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette

from gateway.errors import CLOSE_GOING_AWAY
from gateway.web.protocol import GatewayWebSocketProtocol

# How long shutdown waits for sockets to say goodbye before uvicorn closes what is left.
GOODBYE_S = 2.0


def server_config(app: Starlette, host: str, port: int, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for the gateway.

    The server pings each socket every ``ws_ping_interval_ms`` and drops it when the pong is as late
    (settings). Per-message deflate is off: it costs a compressor per socket (memory) and a compression
    per frame per subscriber (CPU), the two things fan-out has to keep small; task frames are a few
    hundred bytes.
    """
    options.setdefault("ws", GatewayWebSocketProtocol)
    # Protocol-level pings: a peer that vanished without a FIN is dropped within twice the interval.
    ping_s = app.state.gateway.settings.ws_ping_interval_ms / 1000 or None
    options.setdefault("ws_ping_interval", ping_s)
    options.setdefault("ws_ping_timeout", ping_s)
    return uvicorn.Config(app, host=host, port=port, ws_per_message_deflate=False, **options)


class GatewayServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Starlette) -> None:
        super().__init__(config)
        self.gateway = app.state.gateway
        self._hub = self.gateway.hub
        self.gateway.on_fatal = self._stop

    def _stop(self) -> None:
        self.should_exit = True

    @property
    def failed(self) -> bool:
        """Whether the server did not start, or stopped because a part of the gateway failed."""
        return not self.started or self.gateway.fatal is not None

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connections while the open ones are closed
        self._hub.shutdown(CLOSE_GOING_AWAY)
        with anyio.move_on_after(GOODBYE_S):
            await self._hub.idle()
        await super().shutdown(sockets)


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket that ``--workers`` children share (uvicorn binds it the same way)."""
    config = uvicorn.Config(app=None, host=host, port=port)  # type: ignore[arg-type]
    return config.bind_socket()
