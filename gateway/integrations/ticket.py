"""What a queue integration is configured with, and what a queued job carries to its worker.

``GatewayConfig`` is read once by ``install()``, which refuses at once what the gateway would refuse at
every create (its bounds as ``gateway.client.backend_wire`` states them); a ``Ticket`` travels in the job's
message headers (under ``"gateway"``, the key the user also puts a job's tags and heartbeat under), from
the producer that created the gateway task to the worker that runs it: the callback token and the
parameters the task was made with, so a worker that must create the task itself (the producer could not)
makes the same one.

The words a job's outcome becomes on the wire (``resultRef``, ``resultHash``, ``error``) are made here too,
once for every queue.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import reprlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx

from gateway.client.backend_wire import (
    MAX_HEARTBEAT_MS,
    MAX_TAGS,
    MAX_TITLE_CHARS,
    MAX_TTL_MS,
    MIN_HEARTBEAT_MS,
    MIN_TTL_MS,
    TAG_PATTERN,
    TAG_RULE,
)

# The message header a ticket travels in.
HEADER = "gateway"
# A day: the gateway task's deadline when neither the job nor install() says.
DEFAULT_TTL_MS = 86_400_000
# An error longer than this is cut (the gateway takes a body of 64 KiB at most).
MAX_ERROR_CHARS = 4096
# A title made of a job's name and arguments is cut to this many characters (a card's line, not a log).
DEFAULT_TITLE_CHARS = 80
# How a job's arguments are shown in its title: a few items of a collection, the start of a long string.
_ARGS = reprlib.Repr()
_ARGS.maxlevel, _ARGS.maxstring, _ARGS.maxlong, _ARGS.maxother = 2, 24, 16, 24
_ARGS.maxtuple = _ARGS.maxlist = _ARGS.maxarray = _ARGS.maxdict = _ARGS.maxset = _ARGS.maxfrozenset = 3
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")

# What ``install(title=...)`` takes: the title of a job from its name, its arguments and its keyword
# arguments (``None``: no title).
Titler = Callable[[str, Sequence[Any], Mapping[str, Any]], "str | None"]


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
    title: Titler | None = None  # None: job_title


@dataclass(frozen=True)
class Ticket:
    """A gateway task as its job's message carries it: the callback token (``None``: the producer could
    not create the task) and the parameters of the create."""

    token: str | None
    ttl_ms: int
    max_attempts: int
    heartbeat_ms: int | None
    tags: tuple[str, ...]
    # What a person reads for the task, its first metadata, the batch it is a child of (a parent's id),
    # whether its progress follows its children's ends; the batch a queue's group makes of it
    # (``batch.py``'s header: the parent's id and token, the group's size, a chord's body).
    title: str | None = None
    metadata: Mapping[str, Any] | None = None
    parent: str | None = None
    progress_from_children: bool = False
    batch: Mapping[str, Any] | None = field(default=None, compare=False)

    def to_header(self) -> dict[str, Any]:
        """The header's JSON-able value (no ``null``: AMQP headers and some brokers drop or refuse them)."""
        header: dict[str, Any] = {
            "tags": list(self.tags),
            "ttlMs": self.ttl_ms,
            "maxAttempts": self.max_attempts,
        }
        optional = {
            "heartbeatMs": self.heartbeat_ms,
            "token": self.token,
            "title": self.title,
            "metadata": None if self.metadata is None else dict(self.metadata),
            "parent": self.parent,
            "progressFromChildren": self.progress_from_children or None,
            "batch": None if self.batch is None else dict(self.batch),
        }
        header.update({key: value for key, value in optional.items() if value is not None})
        return header

    def create_options(self) -> dict[str, Any]:
        """The keyword arguments of the create that makes this task (``Wire.create``'s, but the id)."""
        return {
            "ttl_ms": self.ttl_ms,
            "max_attempts": self.max_attempts,
            "heartbeat_ms": self.heartbeat_ms,
            "tags": self.tags,
            "title": self.title,
            "metadata": self.metadata,
            "parent": self.parent,
            "progress_from_children": self.progress_from_children,
        }

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
        title, metadata, parent = header.get("title"), header.get("metadata"), header.get("parent")
        batch = header.get("batch")
        return cls(
            token=token if isinstance(token, str) else None,
            ttl_ms=ttl_ms,
            max_attempts=max_attempts,
            heartbeat_ms=heartbeat_ms if isinstance(heartbeat_ms, int) else None,
            tags=tuple(str(t) for t in header.get("tags") or ()),
            title=title if isinstance(title, str) else None,
            metadata=metadata if isinstance(metadata, Mapping) else None,
            parent=parent if isinstance(parent, str) else None,
            progress_from_children=header.get("progressFromChildren") is True,
            batch=batch if isinstance(batch, Mapping) else None,
        )


def job_title(name: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> str:
    """A job's default title: its function's name (the last part of a dotted one) and its arguments, as a
    call reads, each argument shortened (a few items of a collection, the start of a long string), the
    whole cut to :data:`DEFAULT_TITLE_CHARS`: ``export_report(42, fmt='pdf')``."""
    short = str(name).rpartition(".")[2] or str(name) or "job"
    shown = [_ARGS.repr(arg) for arg in args]
    shown += [f"{key}={_ARGS.repr(value)}" for key, value in (kwargs or {}).items()]
    return clean_title(f"{short}({', '.join(shown)})", DEFAULT_TITLE_CHARS) or short[:DEFAULT_TITLE_CHARS]


def clean_title(text: Any, limit: int = MAX_TITLE_CHARS) -> str | None:
    """``text`` as a title the gateway takes: control characters made spaces, cut to ``limit`` characters
    (``…`` at the cut); ``None`` for what is not a string or is blank."""
    if not isinstance(text, str):
        return None
    text = _CONTROL.sub(" ", text).strip()
    if len(text) > limit:
        text = text[: limit - 1].rstrip() + "…"
    return text or None


def titled(
    header: Any, config: GatewayConfig, name: str, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> str | None:
    """A job's title: its options' ``title`` (``None`` there: no title), else ``install(title=...)``'s
    function of its name and arguments, else :func:`job_title`."""
    header = header if isinstance(header, Mapping) else {}
    if "title" in header:
        return clean_title(header["title"])
    if config.title is not None:
        return clean_title(config.title(name, args, kwargs))
    return job_title(name, args, kwargs)


def asked_metadata(header: Any) -> Mapping[str, Any] | None:
    """The first metadata a job's options give (``"metadata": {...}``), else ``None``."""
    metadata = header.get("metadata") if isinstance(header, Mapping) else None
    return metadata if isinstance(metadata, Mapping) else None


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
    title: Titler | None = None,
) -> GatewayConfig:
    """``install()``'s keyword options, the same words for every queue (seconds, or a ``timedelta`` for
    ``ttl``), as a :class:`GatewayConfig`: ``ttl`` is a task's deadline unless its job says (a day by
    default); ``timeout`` bounds the producer's create and any wait of a job for the gateway;
    ``min_interval`` is the least time between two progress callbacks; ``heartbeat`` gives every task a
    lease (a killed worker's task is then requeued); ``tags`` are every task's tags.

    Checked here, when ``install()`` is called: a value the gateway would refuse at every create (a
    heartbeat under a second, a tag with a space) raises ``ValueError`` naming the option and what it
    takes, before anything is installed, rather than leave every job unshown."""
    ttl_s = ttl.total_seconds() if isinstance(ttl, timedelta) else ttl
    ttl_ms = DEFAULT_TTL_MS if ttl_s is None else _milliseconds("ttl", ttl_s, "ttlMs", MIN_TTL_MS, MAX_TTL_MS)
    heartbeat_ms = (
        None
        if heartbeat is None
        else _milliseconds("heartbeat", heartbeat, "heartbeatMs", MIN_HEARTBEAT_MS, MAX_HEARTBEAT_MS)
    )
    return GatewayConfig(
        url=_url(url),
        api_key=_api_key(api_key),
        ttl_ms=ttl_ms,
        heartbeat_ms=heartbeat_ms,
        min_interval_s=_seconds("min_interval", min_interval, zero=True),
        timeout_s=_seconds("timeout", timeout, zero=False),
        tags=_tags(tags),
        title=_titler(title),
    )


def _titler(title: object) -> Titler | None:
    if title is not None and not callable(title):
        raise ValueError(
            f"title: must be a function of a job's name, arguments and keyword arguments that returns its "
            f"title (or None), got {title!r}"
        )
    return title


def _number(value: object) -> float | None:
    """``value`` if it is a finite number (not a boolean), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def _milliseconds(option: str, seconds: object, field: str, low_ms: int, high_ms: int) -> int:
    """``seconds`` as the whole milliseconds the gateway's ``field`` takes, from ``low_ms`` to ``high_ms``."""
    number = _number(seconds)
    ms = round(number * 1000) if number is not None else None
    if ms is None or not low_ms <= ms <= high_ms:
        raise ValueError(
            f"{option}: must be from {low_ms / 1000:g} s to {high_ms // 1000:,} s (the gateway's {field}: "
            f"{low_ms} to {high_ms} ms), got {seconds!r}"
        )
    return ms


def _seconds(option: str, value: object, *, zero: bool) -> float:
    number = _number(value)
    if number is None or number < 0 or (number == 0 and not zero):
        least = "0 or more" if zero else "above 0"
        raise ValueError(f"{option}: must be a number of seconds, {least}, got {value!r}")
    return number


def _url(url: object) -> str:
    if isinstance(url, str):
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL:
            pass
        else:
            if parsed.scheme in ("http", "https") and parsed.host:
                return url
    raise ValueError(
        f"url: must be the gateway's address, http:// or https:// and a host (http://127.0.0.1:8000), "
        f"got {url!r}"
    )


def _api_key(api_key: object) -> str | None:
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ValueError(
            f"api_key: must be the gateway's API key (GATEWAY_API_KEY), or None for a gateway in open mode, "
            f"got {api_key!r}"
        )
    return api_key


_TAG = re.compile(TAG_PATTERN)


def _tags(tags: object) -> tuple[str, ...]:
    """Every task's tags, as a create takes them: at most ``MAX_TAGS``, each a tag, each once."""
    if isinstance(tags, (str, bytes)) or not isinstance(tags, Iterable):
        raise ValueError(f"tags: must be a list of tags (tags=['owner:u42']), got {tags!r}")
    given = tuple(tags)
    if len(given) > MAX_TAGS:
        raise ValueError(f"tags: at most {MAX_TAGS} tags per task, got {len(given)}")
    for tag in given:
        if not isinstance(tag, str) or _TAG.fullmatch(tag) is None:
            raise ValueError(f"tags: {tag!r} is not a tag: a tag is {TAG_RULE}")
    if len(set(given)) < len(given):
        twice = next(tag for tag in given if given.count(tag) > 1)
        raise ValueError(f"tags: {twice!r} is given more than once (each tag once)")
    return given
