"""The uvicorn server the gateway runs under: on shutdown, every subscriber is told ``1001`` first.

Its protocols are uvicorn's with the gateway's limits (``gateway.server.http_protocol``,
``gateway.server.ws_protocol``), and its log lines never carry a ``token=`` query value.
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote_plus

import anyio
import uvicorn
from starlette.applications import Starlette

from gateway.errors import CLOSE_GOING_AWAY
from gateway.server.http_protocol import http_protocol
from gateway.server.ws_protocol import GatewayWebSocketProtocol

if TYPE_CHECKING:
    from gateway.settings import Settings

# How long shutdown waits for sockets to say goodbye before uvicorn closes what is left.
GOODBYE_S = 2.0
# The cyclic garbage collector's young-generation threshold in a gateway process (CPython's default: 700).
GC_YOUNG_THRESHOLD = 10_000
# How long a thread waiting for the interpreter lock waits before asking for it (CPython's default: 5 ms).
SWITCH_INTERVAL_S = 0.001


def setup_logging(settings: Settings) -> None:
    """A gateway process's log: ``LEVEL: logger: message`` on stderr at the settings' level. httpx's line per
    request (the demo worker's callbacks, the webhook relay's POSTs) only from warning up: the relay logs
    what matters of those itself."""
    logging.basicConfig(level=settings.logging_level, format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(max(logging.WARNING, settings.logging_level))


def tune_interpreter() -> None:
    """CPython settings for a gateway process (``gateway serve`` and each ``--workers`` child; not for
    in-process users of the app), measured with ``bench/``:

    - the cyclic garbage collector runs less often: thousands of sockets are thousands of long-lived
      objects that every older-generation pass walks again; with the default threshold a reconnect storm
      of 5,000 sockets met several of those passes of 100-300 ms each. A young threshold of 10,000
      allocations (at most that many objects of cyclic garbage waiting) made that storm 20% faster
      (3.7 s -> 2.9 s). What is loaded at start (modules, the app) is set aside for good (``gc.freeze``);
    - a thread that needs the interpreter lock gets it within 1 ms, not 5: the SQLite writer's thread,
      back from its commit's fsync while fan-out holds the lock, answered the callback up to 5 ms late
      (commit p99 at 1,000 subscribers 2.4 -> 1.2-2.9 ms)."""
    import gc
    import sys

    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)
    sys.setswitchinterval(SWITCH_INTERVAL_S)


def server_config(app: Starlette, host: str, port: int, **options: Any) -> uvicorn.Config:
    """uvicorn's configuration for the gateway, with the limits of the app's settings.

    The server pings each socket every ``ws_ping_interval_ms`` and drops it when the pong is as late
    (settings). Per-message deflate is off: it costs a compressor per socket (memory) and a compression
    per frame per subscriber (CPU), the two things fan-out has to keep small; task frames are a few
    hundred bytes.
    A WebSocket starts with the small message limit of a client not yet authorized (the app raises it).
    """
    settings = app.state.gateway.settings
    options.setdefault("ws", GatewayWebSocketProtocol)
    # Protocol-level pings: a peer that vanished without a FIN is dropped within twice the interval.
    ping_s = settings.ws_ping_interval_ms / 1000 or None
    options.setdefault("ws_ping_interval", ping_s)
    options.setdefault("ws_ping_timeout", ping_s)
    options.setdefault("http", http_protocol(settings, app.state.gateway.metrics.sockets_refused))
    options.setdefault("timeout_keep_alive", settings.idle_timeout_ms / 1000)
    options.setdefault("ws_max_size", settings.ws_max_message_bytes_before_auth)
    config = uvicorn.Config(app, host=host, port=port, ws_per_message_deflate=False, **options)
    redact_tokens_in_logs()
    return config


_QUERY = re.compile(r"\?[^\s\"#]*")


def redact_query(text: str) -> str:
    """``text`` with the value of every ``token`` query parameter replaced (``?token=[redacted]``)."""

    def redact(match: re.Match[str]) -> str:
        pairs = match.group(0)[1:].split("&")
        for i, pair in enumerate(pairs):
            name, sep, _ = pair.partition("=")
            if sep and unquote_plus(name).strip().lower() == "token":
                pairs[i] = f"{name}=[redacted]"
        return "?" + "&".join(pairs)

    return _QUERY.sub(redact, text) if "?" in text else text


class RedactTokens(logging.Filter):
    """Rewrites a record's arguments (a path with its query string) so that no token reaches a log."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(redact_query(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = redact_query(record.msg)
        return True


_REDACT = RedactTokens()


def redact_tokens_in_logs() -> None:
    """On uvicorn's access lines and its WebSocket lines (``"WebSocket /v1/ws?token=..." [accepted]``)."""
    for name in ("uvicorn.access", "uvicorn.error"):
        logger = logging.getLogger(name)
        if _REDACT not in logger.filters:
            logger.addFilter(_REDACT)


class _SaidWhy(logging.Filter):
    """Drops uvicorn's "Application startup failed. Exiting." where the gateway said why in one line."""

    def __init__(self, gateway: Any) -> None:
        super().__init__()
        self.gateway = gateway

    def filter(self, record: logging.LogRecord) -> bool:
        return self.gateway.startup_failure is None or not record.getMessage().startswith(
            "Application startup failed"
        )


class GatewayServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        app: Starlette,
        *,
        on_listening: Callable[[str, int], None] | None = None,
    ) -> None:
        """``on_listening(host, port)`` is called once the server listens (with the port it was given when
        asked for port 0)."""
        super().__init__(config)
        self.gateway = app.state.gateway
        self._hub = self.gateway.hub
        self.gateway.on_fatal = self._stop
        self._on_listening = on_listening

    def _stop(self) -> None:
        self.should_exit = True

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        # A start-up failure the gateway said in one line (the database unreachable) is not said again.
        quiet = _SaidWhy(self.gateway)
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addFilter(quiet)
        try:
            await super().startup(sockets)
        finally:
            uvicorn_log.removeFilter(quiet)
        if self.started and self._on_listening is not None and self.servers:
            listeners = self.servers[0].sockets or ()
            for listener in listeners:
                host, port = listener.getsockname()[:2]
                self._on_listening(host, port)
                break

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
    """The socket of a ``--workers`` parent: bound to the port, not listened on (uvicorn binds it the same
    way); where the workers cannot each listen on a socket of their own, they share it."""
    config = uvicorn.Config(app=None, host=host, port=port)  # type: ignore[arg-type]
    return config.bind_socket()
