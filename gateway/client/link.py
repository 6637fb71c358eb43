"""The self-healing ``/v1/ws`` socket under ``watch`` and ``watch_tag``: one session per connection, a new
connection after a drop (backoff with jitter), the link's changes reported once each.

A link that dies without a word (no FIN: a phone changing networks, a NAT timing out) is noticed by
pings: one every ``heartbeat_s``, and a pong missing after ``deadline_s`` drops the socket at once and
opens a new one, so a dead link is replaced within ``heartbeat_s + 2 * deadline_s`` (under 10 s by
default). Trouble is reported once per change or distinct failure, not per attempt: "cannot reach URL,
retrying in N s" (or "lost the connection") when the link goes, "reconnected" when it is back, to
``on_status`` (default: the ``gateway.client`` logger). What retrying cannot fix raises ``WatchError``: an
error frame or close code for a bad token or an unknown task, and a server that is not a gateway (a 4xx to
the handshake, an answer that is not HTTP/1.1).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidMessage,
    InvalidStatus,
    InvalidURI,
)

from gateway.client.backoff import Backoff
from gateway.client.errors import WatchError

# The close codes that say the same as a fatal error frame (protocol.md), and their error codes.
FATAL_CLOSE = {4400: "invalid-request", 4401: "unauthorized", 4403: "forbidden", 4404: "unknown-task"}
# HTTP answers to the handshake that may be gone on the next try: a timeout, a rate limit (and any 5xx:
# a proxy in front of a gateway that is restarting).
TRANSIENT_STATUS = frozenset({408, 429})

log = logging.getLogger("gateway.client")

T = TypeVar("T")


@dataclass(frozen=True)
class LinkStatus:
    """A change in the link to the gateway: ``connected`` is False while it is down."""

    connected: bool
    message: str
    retry_in_s: float | None = None


def log_status(status: LinkStatus) -> None:
    log.log(logging.INFO if status.connected else logging.WARNING, "%s", status.message)


def ws_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    if base.startswith("http"):
        base = "ws" + base[4:]
    return base + "/v1/ws"


async def linked(
    base_url: str,
    session: Callable[[ClientConnection], AsyncIterator[T]],
    *,
    finished: Callable[[], bool],
    backoff: Backoff,
    max_reconnects: int | None,
    heartbeat_s: float,
    deadline_s: float,
    on_status: Callable[[LinkStatus], None] | None,
) -> AsyncIterator[T]:
    """Yield what ``session`` yields on each connection to ``/v1/ws``, opening a new one after each drop,
    until ``finished()``. Raises :class:`WatchError` on what retrying cannot cure, or after
    ``max_reconnects`` drops."""
    drops = 0
    url = ws_url(base_url)
    down = False  # the last attempt failed or the last socket dropped, and that was said
    said: set[str] = set()  # the failures said since the link went down: each once, not once per attempt

    def report(status: LinkStatus) -> None:
        if on_status is not None:
            on_status(status)

    while not finished():
        opened = False
        try:
            async with connect(
                url,
                ping_interval=heartbeat_s,
                ping_timeout=deadline_s,
                # A dead link never answers our close either: give up on it at once.
                close_timeout=deadline_s,
                open_timeout=2 * deadline_s,
                max_size=2**24,
            ) as ws:
                opened = True
                if down:
                    down = False
                    said.clear()
                    report(LinkStatus(True, f"reconnected to {base_url}"))
                async for item in session(ws):
                    yield item
                    if finished():
                        return
        except (ConnectionClosed, OSError, InvalidHandshake, InvalidURI, TimeoutError) as exc:
            fatal = _fatal(exc, base_url)
            if fatal is not None:
                raise fatal from exc
            drops += 1
            if max_reconnects is not None and drops > max_reconnects:
                raise WatchError("disconnected", f"gave up after {drops - 1} reconnects: {exc}") from exc
            delay = backoff.next_delay()
            why = _why(exc)
            if not down or why not in said:
                down = True
                said.add(why)
                if opened:
                    message = f"lost the connection to {base_url} ({why}), reconnecting"
                else:
                    # Full jitter makes many a wait shorter than the tenth of a second the line shows.
                    when = f"in {delay:.1f} s" if delay >= 0.05 else "at once"
                    message = f"cannot reach {base_url}, retrying {when} ({why})"
                report(LinkStatus(False, message, delay))
            await anyio.sleep(delay)


def _fatal(exc: BaseException, base_url: str) -> WatchError | None:
    """The error to give up with when retrying cannot cure ``exc``; ``None`` when it may."""
    if isinstance(exc, InvalidURI):
        return WatchError("invalid-url", f"{base_url} is not an http(s):// or ws(s):// URL")
    if isinstance(exc, ConnectionClosed) and exc.rcvd is not None and exc.rcvd.code in FATAL_CLOSE:
        reason = f": {exc.rcvd.reason}" if exc.rcvd.reason else ""
        return WatchError(FATAL_CLOSE[exc.rcvd.code], f"closed by the gateway with {exc.rcvd.code}{reason}")
    if isinstance(exc, InvalidStatus):
        status = exc.response.status_code
        if status < 500 and status not in TRANSIENT_STATUS:
            what = "not a task-gateway (check --url or GATEWAY_URL)" if status in (200, 404) else "refused"
            return WatchError(
                "not-a-gateway" if status in (200, 404) else "handshake-refused",
                f"{ws_url(base_url)} answered HTTP {status} to the WebSocket handshake: {what}",
            )
    if isinstance(exc, InvalidMessage) and not isinstance(exc.__cause__, (EOFError, OSError)):
        # It answered, but not in HTTP/1.1 (an HTTP/1.0 server, another protocol on that port).
        return WatchError(
            "not-a-gateway",
            f"{base_url} did not answer the WebSocket handshake in HTTP/1.1 ({exc.__cause__ or exc}): "
            "not a task-gateway (check --url or GATEWAY_URL)",
        )
    return None


def _why(exc: BaseException) -> str:
    if isinstance(exc, ConnectionClosed):
        if exc.rcvd is not None:
            return f"closed by the gateway with {exc.rcvd.code}"
        if exc.sent is not None and exc.sent.reason == "keepalive ping timeout":
            return "no answer to a ping"
        return "the connection dropped"
    if isinstance(exc, InvalidMessage) and exc.__cause__ is not None:
        return f"{exc}: {exc.__cause__}"
    return str(exc) or type(exc).__name__
