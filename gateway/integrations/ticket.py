"""What a queue integration is configured with, and what a queued job carries to its worker.

``GatewayConfig`` is read once by ``install()``; a ``Ticket`` travels in the job's message headers (under
``"gateway"``, the key the user also puts a job's tags and heartbeat under), from the producer that created
the gateway task to the worker that runs it: the callback token and the parameters the task was made with,
so a worker that must create the task itself (the producer could not) makes the same one.

The words a job's outcome becomes on the wire (``resultRef``, ``resultHash``, ``error``) are made here too,
once for every queue.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

# The message header a ticket travels in.
HEADER = "gateway"
# A day: the gateway task's deadline when neither the job nor install() says.
DEFAULT_TTL_MS = 86_400_000
# An error longer than this is cut (the gateway takes a body of 64 KiB at most).
MAX_ERROR_CHARS = 4096


@dataclass(frozen=True)
class GatewayConfig:
    """``install(...)``'s settings. ``timeout_s`` bounds the producer's create and any wait of a job for
    the gateway (``begin``, ``finish``); ``min_interval_s`` is the least time between two progress
    callbacks of one run; ``tags`` and ``heartbeat_ms`` are every task's unless its headers say otherwise."""

    url: str
    api_key: str | None = None
    ttl_ms: int = DEFAULT_TTL_MS
    heartbeat_ms: int | None = None
    min_interval_s: float = 0.25
    timeout_s: float = 2.0
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class Ticket:
    """A gateway task as its job's message carries it: the callback token (``None``: the producer could
    not create the task) and the parameters of the create."""

    token: str | None
    ttl_ms: int
    max_attempts: int
    heartbeat_ms: int | None
    tags: tuple[str, ...]

    def to_header(self) -> dict[str, Any]:
        """The header's JSON-able value (no ``null``: AMQP headers and some brokers drop or refuse them)."""
        header: dict[str, Any] = {
            "tags": list(self.tags),
            "ttlMs": self.ttl_ms,
            "maxAttempts": self.max_attempts,
        }
        if self.heartbeat_ms is not None:
            header["heartbeatMs"] = self.heartbeat_ms
        if self.token is not None:
            header["token"] = self.token
        return header

    @classmethod
    def from_header(cls, header: Any) -> Ticket | None:
        """The ticket a header holds; ``None`` unless it holds a whole one (the user's own ``{"tags": ...}``
        before the producer completed it is not)."""
        if not isinstance(header, Mapping):
            return None
        ttl_ms, max_attempts = header.get("ttlMs"), header.get("maxAttempts")
        if not isinstance(ttl_ms, int) or not isinstance(max_attempts, int):
            return None
        token, heartbeat_ms = header.get("token"), header.get("heartbeatMs")
        return cls(
            token=token if isinstance(token, str) else None,
            ttl_ms=ttl_ms,
            max_attempts=max_attempts,
            heartbeat_ms=heartbeat_ms if isinstance(heartbeat_ms, int) else None,
            tags=tuple(str(t) for t in header.get("tags") or ()),
        )


def requested(header: Any, config: GatewayConfig) -> tuple[tuple[str, ...], int | None]:
    """The tags and heartbeat a job asked for in its ``"gateway"`` header, else the config's."""
    header = header if isinstance(header, Mapping) else {}
    tags: Sequence[Any] = header.get("tags") or config.tags
    heartbeat_ms = header.get("heartbeatMs", config.heartbeat_ms)
    return tuple(str(t) for t in tags), int(heartbeat_ms) if heartbeat_ms is not None else None


def result_ref(value: Any, scheme: str, task_id: str) -> str:
    """A job's returned string (not blank) is its result's reference; any other value is referred to by
    the queue's own address of the job, ``celery://<id>``."""
    if isinstance(value, str) and value.strip():
        return value
    return f"{scheme}://{task_id}"


def result_hash(value: Any) -> str:
    """The SHA-256 (hex) of the result's canonical JSON (sorted keys, no spaces, UTF-8; ``repr`` for what
    JSON cannot hold)."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def error_text(error: BaseException | str) -> str:
    """``"ValueError: bad row 7"``: the exception's type and message, cut to what the gateway takes."""
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    return text[:MAX_ERROR_CHARS] or "error"


def gateway_config(
    *,
    url: str,
    api_key: str | None = None,
    ttl: float | timedelta | None = None,
    timeout: float = 2.0,
    min_interval: float = 0.25,
    heartbeat: float | None = None,
    tags: Sequence[str] = (),
) -> GatewayConfig:
    """``install()``'s keyword options, the same words for every queue (seconds, or a ``timedelta`` for
    ``ttl``), as a :class:`GatewayConfig`: ``ttl`` is a task's deadline unless its job says (a day by
    default); ``timeout`` bounds the producer's create and any wait of a job for the gateway;
    ``min_interval`` is the least time between two progress callbacks; ``heartbeat`` gives every task a
    lease (a killed worker's task is then requeued); ``tags`` are every task's tags."""
    ttl_s = ttl.total_seconds() if isinstance(ttl, timedelta) else ttl
    return GatewayConfig(
        url=url,
        api_key=api_key,
        ttl_ms=round(ttl_s * 1000) if ttl_s is not None else DEFAULT_TTL_MS,
        heartbeat_ms=round(heartbeat * 1000) if heartbeat is not None else None,
        min_interval_s=min_interval,
        timeout_s=timeout,
        tags=tuple(tags),
    )
