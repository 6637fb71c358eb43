"""``watch``: live frames of one or many tasks, over one ``/v1/ws`` socket that heals itself.

It resumes every subscription from its cursor after a drop (backoff with jitter), checks that each
``event`` frame is ``version == last + 1`` and resubscribes from ``last`` when it is not, and ends once
every watched task is terminal. What it yields is exactly what the server sent, so a caller can apply
frames in order and hold the exact task state.

A link that dies without a word (no FIN: a phone changing networks, a NAT timing out) is noticed by
pings: one every ``heartbeat_s``, and a pong missing after ``deadline_s`` drops the socket at once and
opens a new one, so a dead link is replaced within ``heartbeat_s + 2 * deadline_s`` (under 10 s by
default). Trouble is reported once per change or distinct failure, not per attempt: "cannot reach URL,
retrying in N s" (or "lost the connection") when the link goes, "reconnected" when it is back, to
``on_status`` (default: the ``gateway.client`` logger). What retrying cannot fix raises ``WatchError``: an
``error`` frame or close code for a bad token or an unknown task, and a server that is not a gateway (a 4xx
to the handshake, an answer that is not HTTP/1.1).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import anyio
import orjson
from websockets.asyncio.client import connect
from websockets.exceptions import (
    ConnectionClosed,
    InvalidHandshake,
    InvalidMessage,
    InvalidStatus,
    InvalidURI,
)

from gateway.client.backoff import Backoff
from gateway.client.errors import ClientError

TERMINAL = frozenset({"succeeded", "failed", "expired"})
RESUME_TYPES = frozenset({"caught-up", "delta", "snapshot"})
# Error codes that retrying cannot cure.
FATAL = frozenset({"unauthorized", "forbidden", "unknown-task", "invalid-request"})
# The close codes that say the same (protocol.md), and their error codes.
FATAL_CLOSE = {4400: "invalid-request", 4401: "unauthorized", 4403: "forbidden", 4404: "unknown-task"}
# HTTP answers to the handshake that may be gone on the next try: a timeout, a rate limit (and any 5xx:
# a proxy in front of a gateway that is restarting).
TRANSIENT_STATUS = frozenset({408, 429})

log = logging.getLogger("gateway.client")


@dataclass(frozen=True)
class LinkStatus:
    """A change in the link to the gateway: ``connected`` is False while it is down."""

    connected: bool
    message: str
    retry_in_s: float | None = None


def log_status(status: LinkStatus) -> None:
    log.log(logging.INFO if status.connected else logging.WARNING, "%s", status.message)


class WatchError(ClientError):
    def __init__(self, code: str, message: str, task_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}" + (f" (task {task_id})" if task_id else ""))
        self.code = code
        self.task_id = task_id


def ws_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    if base.startswith("http"):
        base = "ws" + base[4:]
    return base + "/v1/ws"


async def watch(
    base_url: str,
    tokens: Mapping[str, str | None],
    *,
    cursors: Mapping[str, int] | None = None,
    backoff: Backoff | None = None,
    max_reconnects: int | None = None,
    heartbeat_s: float = 3.0,
    deadline_s: float = 3.0,
    on_status: Callable[[LinkStatus], None] | None = log_status,
) -> AsyncIterator[dict[str, Any]]:
    """Yield the frames of the tasks in ``tokens`` (task id -> subscribe token) until all are terminal.

    ``cursors`` holds the versions already seen (default 0). Raises :class:`WatchError` on an error the
    server will not change its mind about (bad token, unknown task), or after ``max_reconnects`` drops.
    ``on_status`` hears of each change in the link (None: silence).
    """
    cursor = {task_id: (cursors or {}).get(task_id, 0) for task_id in tokens}
    done: set[str] = set()
    backoff = backoff or Backoff()
    drops = 0
    url = ws_url(base_url)
    down = False  # the last attempt failed or the last socket dropped, and that was said
    said: set[str] = set()  # the failures said since the link went down: each once, not once per attempt

    def report(status: LinkStatus) -> None:
        if on_status is not None:
            on_status(status)

    while len(done) < len(cursor):
        awaiting: set[str] = set()  # subscriptions whose resume frame has not come yet
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
                for task_id in cursor:
                    if task_id not in done:
                        awaiting.add(task_id)
                        await ws.send(_subscribe(task_id, cursor[task_id], tokens[task_id]))
                async for raw in ws:
                    frame = orjson.loads(raw)
                    kind, task_id = frame.get("type"), frame.get("taskId")
                    if kind == "error":
                        if frame.get("code") in FATAL:
                            raise WatchError(frame["code"], frame.get("message", ""), task_id)
                        continue
                    if task_id not in cursor or task_id in done:
                        continue
                    if kind in RESUME_TYPES:
                        if task_id not in awaiting and kind != "snapshot":
                            continue
                        awaiting.discard(task_id)
                        backoff.reset()
                    elif kind == "event":
                        if task_id in awaiting:
                            continue  # from before a resubscribe; the new resume frame covers it
                        if frame["version"] != cursor[task_id] + 1:
                            # A gap: ask again from what we hold.
                            awaiting.add(task_id)
                            await ws.send(_subscribe(task_id, cursor[task_id], tokens[task_id]))
                            continue
                    else:
                        continue
                    cursor[task_id] = frame["version"]
                    yield frame
                    if frame["task"]["state"] in TERMINAL:
                        done.add(task_id)
                        if len(done) == len(cursor):
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
                    message = f"cannot reach {base_url}, retrying in {delay:.1f} s ({why})"
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


def _subscribe(task_id: str, cursor: int, token: str | None) -> str:
    message: dict[str, Any] = {"type": "subscribe", "taskId": task_id, "cursor": cursor}
    if token is not None:
        message["token"] = token
    return orjson.dumps(message).decode()
