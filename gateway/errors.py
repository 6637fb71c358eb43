"""One exception tree for the whole gateway.

Every error a client can cause is a :class:`GatewayError` carrying a protocol ``code``; the web layer maps
the code once to its HTTP status (and, for sockets, to a close code)::

    GatewayError
    ├── InvalidRequest          400 invalid-request        4400
    ├── Unauthorized            401 unauthorized           4401
    ├── Forbidden               403 forbidden              4403
    ├── UnknownTask             404 unknown-task           4404
    ├── NotFound                404 not-found
    ├── MethodNotAllowed        405 method-not-allowed
    ├── RequestTimeout          408 request-timeout (and the connection is closed)
    ├── Conflict                409 task-exists | key-reused-for-other-task | not-succeeded
    │                               | callback-id-reused | stale-attempt | history-full | not-running
    │                               | seq-reused | seq-gap | too-many-streams
    │                               (not-running carries the task beside the error: ``task``; seq-gap
    │                               the seq a stream expects: ``expectedSeq``)
    ├── PayloadTooLarge         413 payload-too-large | stream-full
    ├── UnsupportedMediaType    415 unsupported-media-type
    ├── RateLimited             429 rate-limited (with Retry-After)
    ├── Unavailable             503 unavailable (with Retry-After)
    └── TooManySockets          503 too-many-sockets (an SSE stream past the descriptor reserve; closed)

Limits the connection itself hits before any route runs (``gateway.server.http_protocol``) answer in the same
shape: ``431 headers-too-large``, ``408 request-timeout``, ``429 too-many-connections``, ``503
too-many-sockets`` (a WebSocket past the descriptor reserve).

The pure state machine raises only :class:`InvalidRequest`: its refusals are all ``400 invalid-request``
(protocol.md, Errors and The task's life).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar

# WebSocket close codes, named once (protocol.md, "Close codes").
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_INTERNAL_ERROR = 1011
CLOSE_SLOW_CONSUMER = 4008
# A /v1/ws socket that held no subscription for GATEWAY_WS_AUTH_DEADLINE_S, or had too many messages refused
# while it held none.
CLOSE_NO_SUBSCRIPTION = 4408
CLOSE_TOO_MANY_REFUSALS = 4429
CLOSE_INVALID_REQUEST = 4400
CLOSE_UNAUTHORIZED = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_UNKNOWN_TASK = 4404


class ConfigError(Exception):
    """The configuration cannot be used; the message says which setting and why (``gateway serve`` prints
    it in one line and exits 2). Not a :class:`GatewayError`: no client causes it."""


class GatewayError(Exception):
    """Root of every error the gateway reports to a client."""

    status: ClassVar[int] = 500
    close_code: ClassVar[int] = 1011
    default_code: ClassVar[str] = "internal"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code

    def to_json(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message}}

    def headers(self) -> dict[str, str] | None:
        """Response headers that go with this error (``Retry-After``, ``Connection: close``)."""
        return None


class InvalidRequest(GatewayError):
    status = 400
    close_code = CLOSE_INVALID_REQUEST
    default_code = "invalid-request"


class Unauthorized(GatewayError):
    status = 401
    close_code = CLOSE_UNAUTHORIZED
    default_code = "unauthorized"


class Forbidden(GatewayError):
    status = 403
    close_code = CLOSE_FORBIDDEN
    default_code = "forbidden"


class UnknownTask(GatewayError):
    status = 404
    close_code = CLOSE_UNKNOWN_TASK
    default_code = "unknown-task"

    def __init__(self, task_id: str) -> None:
        super().__init__(f"unknown task {task_id}")
        self.task_id = task_id


class NotFound(GatewayError):
    status = 404
    default_code = "not-found"


class MethodNotAllowed(GatewayError):
    status = 405
    default_code = "method-not-allowed"


class RequestTimeout(GatewayError):
    """The client did not send its request in time: answered, then the connection is closed."""

    status = 408
    default_code = "request-timeout"

    def headers(self) -> dict[str, str] | None:
        return {"Connection": "close"}


class Conflict(GatewayError):
    """A 409 whose ``code`` names the conflict (task-exists, stale-attempt, ...). ``task``, the task's JSON
    where the conflict is about what became of it (``not-running``: a cancel, a requeue), goes in the body
    beside ``error``, so that a worker learns why without another request; so do ``extra`` fields (a
    ``seq-gap``'s ``expectedSeq``)."""

    status = 409
    close_code = CLOSE_INVALID_REQUEST

    def __init__(
        self,
        code: str,
        message: str,
        *,
        task: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(message, code=code)
        self.task = task
        self.extra = extra

    def to_json(self) -> dict[str, Any]:
        body = super().to_json()
        if self.task is not None:
            body["task"] = dict(self.task)
        if self.extra is not None:
            body.update(self.extra)
        return body


class PayloadTooLarge(GatewayError):
    status = 413
    close_code = 1009
    default_code = "payload-too-large"


class UnsupportedMediaType(GatewayError):
    status = 415
    default_code = "unsupported-media-type"


class RateLimited(GatewayError):
    """Too many requests for one key (callbacks of one task): retry after ``retry_after_s``."""

    status = 429
    close_code = 1013
    default_code = "rate-limited"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(self.retry_after_s)}


class TooManySockets(GatewayError):
    """A stream asked of a process whose open connections reached its descriptor limit less the reserve
    (``GATEWAY_FD_RESERVE``): answered, and the connection closed, so that its descriptor is free at once."""

    status = 503
    default_code = "too-many-sockets"

    def headers(self) -> dict[str, str] | None:
        return {"Connection": "close"}


class Unavailable(GatewayError):
    """The database cannot be reached: retry (idempotently: a callbackId, an Idempotency-Key)."""

    status = 503
    close_code = 1013
    default_code = "unavailable"
    retry_after_s: ClassVar[int] = 1

    def headers(self) -> dict[str, str] | None:
        return {"Retry-After": str(self.retry_after_s)}


# What SQLAlchemy appends to a driver's message: the statement, its parameters, a link to its docs.
_WRAPPING = re.compile(r"\[(SQL|parameters): |\(Background on this error at: ")


def one_line(exc: BaseException) -> str:
    """An exception as one line, for a log line or a message: the driver's own words where a wrapper holds
    them (SQLAlchemy's ``DBAPIError.orig``), without the SQL a wrapper adds, whitespace collapsed; the
    exception's type when it says nothing (a ``TimeoutError`` of a deadline)."""
    orig = getattr(exc, "orig", None)
    if isinstance(orig, BaseException) and str(orig).strip():
        exc = orig
    text = str(exc)
    wrapping = _WRAPPING.search(text)
    if wrapping is not None:
        text = text[: wrapping.start()]
    return " ".join(text.split()) or type(exc).__name__
