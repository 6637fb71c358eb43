"""The task state machine of protocol.md's task life: :func:`create_task`, :func:`expire_task` and
:func:`apply_event`, plus one event of the gateway's own, :class:`Cancel` (:func:`cancel_task`), which is
not one of the task machine's events (protocol.md, Shapes): each of those behaves exactly as the task life
says, to the reason string.

Pure: no I/O, no clock, no framework. Every function takes values and returns values, so the store, the
in-memory model of the tests and a replay of a task's history all decide transitions the same way.

A task does not carry its history here: a transition that changes the task returns the one new
:class:`Entry` (``version`` = old version + 1) and the caller appends it, in the same transaction as the
new task row. Checks run in the order of protocol.md's task life and fail as ``InvalidRequest``
(``400 invalid-request``), with a message that names the client's own field and no module prefix: a client
reads ``ttlMs must be a positive number``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Final, Literal, TypeAlias

import orjson

from gateway.errors import InvalidRequest

State: TypeAlias = Literal["queued", "running", "succeeded", "failed", "expired"]
TERMINAL: Final[frozenset[str]] = frozenset({"succeeded", "failed", "expired"})

# JavaScript's String.prototype.trim() whitespace, so that "blank" (protocol.md: a blank id, resultRef, key)
# means what it means to the protocol's JavaScript clients.
JS_WHITESPACE: Final = (
    "\t\n\v\f\r \u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000\ufeff"
)


@dataclass(frozen=True, slots=True)
class Start:
    at_ms: float
    worker: str
    type: Literal["start"] = "start"


@dataclass(frozen=True, slots=True)
class Progress:
    at_ms: float
    progress: float
    cursor: str
    type: Literal["progress"] = "progress"


@dataclass(frozen=True, slots=True)
class Succeed:
    at_ms: float
    result_ref: str
    result_hash: str
    type: Literal["succeed"] = "succeed"


@dataclass(frozen=True, slots=True)
class Fail:
    at_ms: float
    error: str
    retryable: bool
    type: Literal["fail"] = "fail"


@dataclass(frozen=True, slots=True)
class Expire:
    at_ms: float
    type: Literal["expire"] = "expire"


@dataclass(frozen=True, slots=True)
class Cancel:
    """The gateway's own event, not the task machine's (protocol.md, Shapes): a backend or an operator ended
    a live task
    (``POST /v1/tasks/{id}/cancel``). Never a worker's callback."""

    at_ms: float
    reason: str | None = None
    type: Literal["cancel"] = "cancel"


Event: TypeAlias = Start | Progress | Succeed | Fail | Expire | Cancel

# A cancelled task is ``failed`` with exactly this ``error`` (what clients test); the reason given is in the
# ``cancel`` entry.
CANCELLED: Final = "cancelled"


@dataclass(frozen=True, slots=True)
class Entry:
    """One history entry: the event that moved the task to ``version``."""

    version: int
    event: Event


@dataclass(frozen=True, slots=True)
class Task:
    id: str
    state: State
    expires_at_ms: float
    attempts: int
    max_attempts: int
    progress: int
    version: int
    result_ref: str | None = None
    result_hash: str | None = None
    error: str | None = None
    # The gateway's own (protocol.md, Shapes): fixed at creation, carried unchanged by every transition.
    tags: tuple[str, ...] = ()
    created_at_ms: int = 0
    # Which history of the id this is (protocol.md, Resuming): made at random when the task is created, so
    # that a task made again under the id of a deleted one is told apart from it ("": none given).
    epoch: str = ""
    # The gateway's own fields of issue 34 (protocol.md, Shapes), beside the history, never in it: no event
    # of the machine reads or sets them, every transition carries them unchanged (``dataclasses.replace``).
    # Fixed at creation: a title a person reads, the parent of a child of a batch, and whether the gateway
    # moves its progress as its children end.
    title: str | None = None
    parent: str | None = None
    progress_from_children: bool = False
    # Live state beside the history: the metadata as its compact JSON text, the counts of its children
    # (``gateway.children.Children``; ``None`` until it has one), and their revision (each change counted).
    metadata: str = "{}"
    children: tuple[int, int, int, int, int, int] | None = None
    revision: int = 0
    # What the gateway saw of its runs (``gateway.task_times``): the last start's worker and time, and when
    # the task became terminal.
    worker: str | None = None
    started_at_ms: int | None = None
    ended_at_ms: int | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL


@dataclass(frozen=True, slots=True)
class Transition:
    task: Task
    changed: bool
    duplicate: bool
    notify: bool
    reason: str
    entry: Entry | None = None


def fail(message: str) -> InvalidRequest:
    """A refusal in the words ``<field> must ...``: the field as the client sent it, and what it must be."""
    return InvalidRequest(message)


def is_blank(value: str) -> bool:
    return value.strip(JS_WHITESPACE) == ""


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value: object, field: str, minimum: int = 0) -> int:
    """``Number.isInteger(value) && value >= min``; returns the value as an ``int``."""
    if (
        not _is_number(value) or (isinstance(value, float) and not value.is_integer()) or value < minimum  # type: ignore[operator]
    ):
        raise fail(f"{field} must be an integer >= {minimum}")
    return int(value)  # type: ignore[call-overload, no-any-return]


def _positive(value: object, field: str) -> None:
    if not _is_number(value) or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type, operator]
        raise fail(f"{field} must be a positive number")


def _non_negative(value: object, field: str) -> None:
    if not _is_number(value) or not math.isfinite(value) or value < 0:  # type: ignore[arg-type, operator]
        raise fail(f"{field} must be a non-negative number")


def create_task(*, id: str, now_ms: float, ttl_ms: float, max_attempts: float) -> Task:
    """``createAsyncTask``: a queued task at version 0 whose deadline is ``now_ms + ttl_ms``."""
    if is_blank(id):
        raise fail("id must not be blank")
    _non_negative(now_ms, "nowMs")
    _positive(ttl_ms, "ttlMs")
    attempts = _integer(max_attempts, "maxAttempts", 1)
    return Task(
        id=id,
        state="queued",
        expires_at_ms=now_ms + ttl_ms,
        attempts=0,
        max_attempts=attempts,
        progress=0,
        version=0,
    )


def _advance(task: Task, event: Event, reason: str, *, notify: bool = False, **patch: Any) -> Transition:
    version = task.version + 1
    return Transition(
        task=replace(task, version=version, **patch),
        changed=True,
        duplicate=False,
        notify=notify,
        reason=reason,
        entry=Entry(version, event),
    )


def _unchanged(task: Task, reason: str, duplicate: bool = False) -> Transition:
    return Transition(task=task, changed=False, duplicate=duplicate, notify=False, reason=reason)


def expire_task(task: Task) -> Transition:
    """``expireTask``: a system action, pinned to ``expires_at_ms`` so that a replay reproduces it."""
    if task.terminal:
        expired = task.state == "expired"
        return _unchanged(task, "duplicate-expire" if expired else "terminal-conflict", expired)
    return _advance(task, Expire(task.expires_at_ms), "expired", notify=True, state="expired")


def apply_event(task: Task, event: Event) -> Transition:
    """``applyAsyncEvent``: the expiry check comes before the callback; the TTL is the delivery deadline."""
    _non_negative(event.at_ms, "event.atMs")
    if task.terminal:
        if isinstance(event, Succeed) and task.state == "succeeded" and task.result_hash == event.result_hash:
            return _unchanged(task, "duplicate-result", True)
        if isinstance(event, Expire) and task.state == "expired":
            return _unchanged(task, "duplicate-expire", True)
        return _unchanged(task, "terminal-conflict")
    if isinstance(event, Expire) or event.at_ms >= task.expires_at_ms:
        return expire_task(task)
    if isinstance(event, Cancel):
        return _advance(task, event, "cancelled", notify=True, state="failed", error=CANCELLED)

    if isinstance(event, Start):
        if task.state == "running":
            return _unchanged(task, "already-running", True)
        if task.state != "queued" or task.attempts >= task.max_attempts:
            return _unchanged(task, "not-startable")
        return _advance(task, event, "started", state="running", attempts=task.attempts + 1, progress=0)

    if isinstance(event, Progress):
        if task.state != "running":
            return _unchanged(task, "not-running")
        progress = _integer(event.progress, "progress", 0)
        if progress > 100:
            raise fail("progress must not exceed 100")
        if progress < task.progress:
            return _unchanged(task, "stale-progress")
        if progress == task.progress:
            return _unchanged(task, "duplicate-progress", True)
        if type(event.progress) is not int:
            event = replace(event, progress=progress)
        return _advance(task, event, "progress", progress=progress)

    if task.state != "running":
        return _unchanged(task, "not-running")
    if isinstance(event, Succeed):
        if is_blank(event.result_ref) or is_blank(event.result_hash):
            raise fail("resultRef and resultHash must not be blank")
        return _advance(
            task,
            event,
            "succeeded",
            notify=True,
            state="succeeded",
            progress=100,
            result_ref=event.result_ref,
            result_hash=event.result_hash,
        )
    if event.retryable and task.attempts < task.max_attempts:
        return _advance(task, event, "requeued", state="queued", progress=0, error=event.error)
    return _advance(task, event, "failed", notify=True, state="failed", error=event.error)


def cancel_task(task: Task, at_ms: float, reason: str | None = None) -> Transition:
    """End a live task on request: ``failed`` with ``error: "cancelled"``, through one ``cancel`` entry
    (``notify``: a terminal state). Decided in ``apply_event``'s order, as if it were a callback: a terminal
    task does not change (``terminal-conflict``), and a cancel at or after the deadline expires the task
    instead (``expired``, the entry an ``expire`` at the deadline), as a late callback would."""
    return apply_event(task, Cancel(at_ms, reason))


ResumeMode: TypeAlias = Literal["caught-up", "delta", "snapshot"]


def resume_mode(version: int, cursor: object, retention_versions: int) -> tuple[ResumeMode, str | None]:
    """The resume choice of protocol.md, Resuming: a cursor ahead of the task (a history this task does
    not have) gets a snapshot, not ``caught-up``.

    Returns the mode and, for a snapshot, its reason.
    """
    position = _integer(cursor, "cursorVersion")
    if position > version:
        return "snapshot", "cursor-ahead"
    if version == position:
        return "caught-up", None
    if version - position > retention_versions:
        return "snapshot", "retention"
    return "delta", None


# The reason of a snapshot for a cursor of another history than the task's: the task it was read from was
# deleted, and its id made again.
RECREATED: Final = "recreated"


def same_history(task: Task, epoch: str | None) -> bool:
    """Whether a cursor of ``epoch`` counts in ``task``'s history: a bare version (``None``, a client that
    sends no epoch) is taken as one of the task the id names now, as before epochs."""
    return epoch is None or epoch == task.epoch


def resume_from(
    task: Task, cursor: object, retention_versions: int, epoch: str | None = None
) -> tuple[ResumeMode, str | None]:
    """:func:`resume_mode` for a cursor that may carry the epoch of its history: one of another history
    (the id was deleted and made again since) gets a snapshot (``recreated``) whatever its version, for
    version N of one history is not version N of another."""
    if not same_history(task, epoch):
        _integer(cursor, "cursorVersion")
        return "snapshot", RECREATED
    return resume_mode(task.version, cursor, retention_versions)


# --- protocol.md's JSON shapes (camelCase; its Shapes), for history rows and the wire ---------------------

# A task's ``children`` counts, in the order ``Task.children`` holds them.
CHILDREN_FIELDS: Final = ("total", "queued", "running", "succeeded", "failed", "expired")


def _num(value: float) -> float:
    """Integral numbers travel as JSON integers, as JavaScript prints them."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def event_to_json(event: Event) -> dict[str, Any]:
    at = _num(event.at_ms)
    if isinstance(event, Start):
        return {"type": "start", "atMs": at, "worker": event.worker}
    if isinstance(event, Progress):
        return {"type": "progress", "atMs": at, "progress": _num(event.progress), "cursor": event.cursor}
    if isinstance(event, Succeed):
        return {"type": "succeed", "atMs": at, "resultRef": event.result_ref, "resultHash": event.result_hash}
    if isinstance(event, Fail):
        return {"type": "fail", "atMs": at, "error": event.error, "retryable": event.retryable}
    if isinstance(event, Cancel):
        if event.reason is None:
            return {"type": "cancel", "atMs": at}
        return {"type": "cancel", "atMs": at, "reason": event.reason}
    return {"type": "expire", "atMs": at}


def event_from_json(data: dict[str, Any]) -> Event:
    """The inverse of :func:`event_to_json`, for entries read back from the store."""
    kind, at = data["type"], data["atMs"]
    if kind == "start":
        return Start(at, data["worker"])
    if kind == "progress":
        return Progress(at, data["progress"], data["cursor"])
    if kind == "succeed":
        return Succeed(at, data["resultRef"], data["resultHash"])
    if kind == "fail":
        return Fail(at, data["error"], data["retryable"])
    if kind == "expire":
        return Expire(at)
    if kind == "cancel":
        return Cancel(at, data.get("reason"))
    raise ValueError(f"unknown event type {kind!r}")


def entry_to_json(entry: Entry) -> dict[str, Any]:
    return {"version": entry.version, "event": event_to_json(entry.event)}


def task_to_json(task: Task) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": task.id,
        "state": task.state,
        "expiresAtMs": _num(task.expires_at_ms),
        "attempts": task.attempts,
        "maxAttempts": task.max_attempts,
        "progress": task.progress,
        "version": task.version,
        "tags": list(task.tags),
        "createdAtMs": task.created_at_ms,
    }
    if task.result_ref is not None:
        out["resultRef"] = task.result_ref
    if task.result_hash is not None:
        out["resultHash"] = task.result_hash
    if task.error is not None:
        out["error"] = task.error
    if task.epoch:
        out["epoch"] = task.epoch
    if task.title is not None:
        out["title"] = task.title
    out["metadata"] = orjson.loads(task.metadata) if task.metadata != "{}" else {}
    if task.parent is not None:
        out["parent"] = task.parent
    if task.progress_from_children:
        out["progressFromChildren"] = True
    if task.children is not None:
        out["children"] = dict(zip(CHILDREN_FIELDS, task.children, strict=True))
    out["revision"] = task.revision
    if task.worker is not None:
        out["worker"] = task.worker
    if task.started_at_ms is not None:
        out["startedAtMs"] = task.started_at_ms
    if task.ended_at_ms is not None:
        out["endedAtMs"] = task.ended_at_ms
    return out


def task_from_json(data: dict[str, Any]) -> Task:
    """The inverse of :func:`task_to_json` (a task carried in a frame)."""
    return Task(
        id=data["id"],
        state=data["state"],
        expires_at_ms=data["expiresAtMs"],
        attempts=data["attempts"],
        max_attempts=data["maxAttempts"],
        progress=data["progress"],
        version=data["version"],
        result_ref=data.get("resultRef"),
        result_hash=data.get("resultHash"),
        error=data.get("error"),
        tags=tuple(data.get("tags", ())),
        created_at_ms=data.get("createdAtMs", 0),
        epoch=data.get("epoch", ""),
        title=data.get("title"),
        parent=data.get("parent"),
        progress_from_children=data.get("progressFromChildren", False),
        metadata=orjson.dumps(data.get("metadata", {})).decode(),
        children=tuple(data["children"][name] for name in CHILDREN_FIELDS) if "children" in data else None,
        revision=data.get("revision", 0),
        worker=data.get("worker"),
        started_at_ms=data.get("startedAtMs"),
        ended_at_ms=data.get("endedAtMs"),
    )


@dataclass(frozen=True, slots=True)
class Resume:
    """What a subscriber resuming at a cursor gets (protocol.md, Resume): nothing new, the entries it
    missed, or the whole state."""

    mode: ResumeMode
    reason: str | None
    task: Task
    # (version, the event's JSON as stored) for a delta; empty otherwise.
    entries: Sequence[tuple[int, bytes]]

    def entries_json(self) -> bytes:
        """The entries as a JSON array of ``{"version", "event"}``, the stored events spliced in as stored."""
        return b"[" + b",".join(b'{"version":%d,"event":%b}' % (v, raw) for v, raw in self.entries) + b"]"
