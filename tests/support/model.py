"""An in-memory model of the gateway's HTTP API: the oracle of the model-based tests.

Built on the pure state machine (``gateway.machine``), it is the book of protocol.md's task life (its
create, resume, callbacks, notifications and deliveries) with the gateway's additions protocol.md states,
and it answers every operation as the HTTP API does, as ``(status_code, json_body)`` in the protocol's JSON
shapes (camelCase), without tokens:

- ``create``: the same id with the same parameters is idempotent (200, the current task); other parameters
  are ``409 task-exists`` (the task life's book would silently overwrite). The task carries the gateway's own
  three fields: ``createdAtMs`` (``now_ms`` at create), ``tags`` (none: the model's creates name none) and
  ``epoch`` (made at random by the gateway: given to the model, ``""`` for none); and those beside the
  history a create without them has (``metadata`` ``{}``, ``revision`` 0), with what the gateway records of
  the runs (``gateway.task_times``: the last start's worker and time, when the task ended).
- ``events``: protocol.md's resume (Resuming), but a cursor ahead of the task is a snapshot
  (``cursor-ahead``); a snapshot carries its ``reason``; a cursor outside 0 to 2**53 - 1 is
  ``invalid-request`` in the protocol's words (``cursor: ...``), not the task life's own (``cursorVersion``),
  whether or not the task exists (a bad query, like a non-integer cursor).
- ``callback``: the event comes without ``atMs`` (the model stamps ``now_ms``); a callback id reused with
  another body (task id, event and attempt, compared as parsed JSON) is ``409 callback-id-reused``; an
  ``attempt`` (a whole number from 0 to 2**63 - 1, else 400) that is not the task's current ``attempts`` is
  ``409 stale-attempt`` on progress, succeed and fail; every transition answers 200, ``terminal-conflict``
  included.
- ``cancel``: the gateway's own event (not one of the task life's): ``POST /v1/tasks/{id}/cancel`` with
  ``{"reason"?}`` (or no body) applies ``cancel_task`` at ``now_ms`` and answers the callback's shape
  without ``duplicateCallback``; a bad body is 400, an unknown task 404.
- ``sweep``: the sweeper expires overdue tasks; its notifications are at ``expiresAtMs``.
- ``drain``: notifications carry the task's ``version``.

Simplicity over cleverness: this is what the real service is compared with.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from gateway import machine as m
from gateway.errors import Conflict, GatewayError, InvalidRequest, UnknownTask
from gateway.task_times import stamped

MAX_CURSOR = 2**53 - 1  # the largest cursor the protocol takes (JavaScript's largest safe integer)

Answer = tuple[int, Any]

RETENTION = 8

# The fields of each event type a worker may send (the gateway stamps atMs; "expire" is a system action and
# "cancel" the gateway's own event, neither a worker's); those in OPTIONAL may be left out, for their default.
_STRING = "string"
_NUMBER = "number"
_BOOLEAN = "boolean"
EVENT_FIELDS: dict[str, dict[str, str]] = {
    "start": {"worker": _STRING},
    "progress": {"progress": _NUMBER, "cursor": _STRING},
    "succeed": {"resultRef": _STRING, "resultHash": _STRING},
    "fail": {"error": _STRING, "retryable": _BOOLEAN},
}
OPTIONAL: dict[tuple[str, str], Any] = {("progress", "cursor"): ""}
FENCED = frozenset({"progress", "succeed", "fail"})
# The state machine's refusals read "<field> must ..." (``gateway.machine.fail``); the HTTP layer's, and
# this model's stand-ins for them, "<field>: ...". An error is compared by its message too when it is the
# machine's.
MACHINE_MESSAGE = re.compile(r"^[\w.]+(?: and \w+)? must ")


def _an_attempt(value: object) -> bool:
    """An ``attempt`` the HTTP layer takes: a whole JSON number (1 or 1.0) that a task's ``attempts`` can be,
    0 to 2**63 - 1; another, a negative one included, is a 400 before any fencing."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return (isinstance(value, int) or value.is_integer()) and 0 <= value <= 2**63 - 1


def _error(error: GatewayError) -> Answer:
    return error.status, error.to_json()


def _json_type(value: object) -> str:
    if isinstance(value, bool):
        return _BOOLEAN
    if isinstance(value, (int, float)):
        return _NUMBER
    if isinstance(value, str):
        return _STRING
    return type(value).__name__


def json_equal(a: object, b: object) -> bool:
    """Equality of parsed JSON values: numbers by value (1 == 1.0), but a boolean is never a number."""
    if _json_type(a) != _json_type(b):
        return False
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def parse_event(body: object, at_ms: float) -> m.Event:
    """The HTTP layer's type checks of a callback's event, then the machine's event at ``at_ms``.

    Range checks (progress over 100, a blank resultRef) are the machine's, in its order.
    """
    if not isinstance(body, dict):
        raise InvalidRequest("event: must be an object")
    kind = body.get("type")
    if not isinstance(kind, str) or kind not in EVENT_FIELDS:
        raise InvalidRequest(f"unknown event type {kind!r}")
    fields = EVENT_FIELDS[kind]
    extra = set(body) - set(fields) - {"type"}
    if extra:
        raise InvalidRequest(f"unexpected fields {sorted(extra)}")
    body = {**{name: OPTIONAL[kind, name] for name in fields if (kind, name) in OPTIONAL}, **body}
    for name, expected in fields.items():
        if name not in body:
            raise InvalidRequest(f"missing field {name}")
        if _json_type(body[name]) != expected:
            raise InvalidRequest(f"{name}: must be a {expected}")
    if kind == "start":
        return m.Start(at_ms, body["worker"])
    if kind == "progress":
        return m.Progress(at_ms, body["progress"], body["cursor"])
    if kind == "succeed":
        return m.Succeed(at_ms, body["resultRef"], body["resultHash"])
    return m.Fail(at_ms, body["error"], body["retryable"])


MAX_CANCEL_REASON = 1024


def parse_cancel(body: object) -> str | None:
    """The HTTP layer's checks of a cancel's body: nothing, or an object with at most a ``reason`` (a
    string of 1 to 1,024 characters); returns the reason."""
    if body is None:
        return None
    if not isinstance(body, dict):
        raise InvalidRequest("body: must be an object")
    extra = set(body) - {"reason"}
    if extra:
        raise InvalidRequest(f"unexpected fields {sorted(extra)}")
    reason = body.get("reason")
    if reason is None:
        return None
    if not isinstance(reason, str) or not 1 <= len(reason) <= MAX_CANCEL_REASON:
        raise InvalidRequest("reason: must be a string of 1 to 1024 characters")
    return reason


def _num(value: float) -> float:
    """Integral numbers travel as JSON integers, as JavaScript prints them (machine.py does the same)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _utf16(text: str) -> bytes:
    """A sort key that orders strings as JavaScript's ``<`` does (by UTF-16 code units)."""
    return text.encode("utf-16-be", "surrogatepass")


@dataclass
class Model:
    retention: int = RETENTION
    tasks: dict[str, m.Task] = field(default_factory=dict)
    params: dict[str, tuple[float, int]] = field(default_factory=dict)  # id -> (ttlMs, maxAttempts)
    histories: dict[str, list[m.Entry]] = field(default_factory=dict)
    callbacks: dict[str, dict[str, Any]] = field(default_factory=dict)  # callback id -> canonical body
    outbox: list[dict[str, Any]] = field(default_factory=list)
    deliveries: dict[str, dict[str, Any]] = field(default_factory=dict)  # idempotency key -> receipt

    # --- bookkeeping -----------------------------------------------------------------------------------

    def _record(self, transition: m.Transition, at_ms: float) -> None:
        """Keep a transition's task and entry; a terminal transition adds one notification at ``at_ms``."""
        task = transition.task
        if transition.changed:
            assert transition.entry is not None
            self.tasks[task.id] = task
            self.histories[task.id].append(transition.entry)
        if transition.notify:
            self.outbox.append(
                {"taskId": task.id, "state": task.state, "atMs": _num(at_ms), "version": task.version}
            )

    # --- routes ------------------------------------------------------------------------------------------

    def create(
        self, task_id: str, now_ms: float, ttl_ms: float, max_attempts: object, *, epoch: str = ""
    ) -> Answer:
        """``POST /v1/tasks`` (``epoch``: the new task's, when it is made)."""
        try:
            # The gateway's one deviation from createAsyncTask: its clock counts whole milliseconds, so a
            # fractional ttlMs is a type error of the HTTP layer (1000.0 is 1000).
            if isinstance(ttl_ms, float) and not ttl_ms.is_integer():
                raise InvalidRequest("ttlMs: must be a whole number of milliseconds")
            task = m.create_task(id=task_id, now_ms=now_ms, ttl_ms=ttl_ms, max_attempts=max_attempts)  # type: ignore[arg-type]
            task = replace(task, created_at_ms=int(now_ms), epoch=epoch)
        except InvalidRequest as error:
            return _error(error)
        existing = self.tasks.get(task_id)
        if existing is not None:
            if self.params[task_id] == (ttl_ms, task.max_attempts):
                return 200, {"task": m.task_to_json(existing)}
            return _error(Conflict("task-exists", f"task {task_id} exists with other parameters"))
        self.tasks[task_id] = task
        self.params[task_id] = (ttl_ms, task.max_attempts)
        self.histories[task_id] = []
        return 201, {"task": m.task_to_json(task)}

    def get(self, task_id: str) -> Answer:
        """``GET /v1/tasks/{id}``."""
        task = self.tasks.get(task_id)
        if task is None:
            return _error(UnknownTask(task_id))
        return 200, m.task_to_json(task)

    def events(self, task_id: str, cursor: object, retention: int | None = None) -> Answer:
        """``GET /v1/tasks/{id}/events?cursor=N``."""
        if isinstance(cursor, int) and not 0 <= cursor <= MAX_CURSOR:  # the query's, before the lookup
            return _error(InvalidRequest(f"cursor: must be an integer from 0 to {MAX_CURSOR}, got {cursor}"))
        task = self.tasks.get(task_id)
        if task is None:
            return _error(UnknownTask(task_id))
        try:
            mode, reason = m.resume_mode(
                task.version, cursor, self.retention if retention is None else retention
            )
        except InvalidRequest as error:
            return _error(error)
        position = int(cursor)  # type: ignore[call-overload]  # an integer: resume_mode checked it
        after = [e for e in self.histories[task_id] if e.version > position] if mode == "delta" else []
        body: dict[str, Any] = {
            "mode": mode,
            "version": task.version,
            "events": [m.entry_to_json(e) for e in after],
            "task": m.task_to_json(task),
        }
        if reason is not None:
            body["reason"] = reason
        return 200, body

    def callback(
        self,
        task_id: str,
        now_ms: float,
        event_body: dict[str, Any],
        callback_id: str | None = None,
        attempt: int | None = None,
    ) -> Answer:
        """``POST /v1/tasks/{id}/callbacks``, body ``{"callbackId"?, "attempt"?, "event": event_body}``."""
        # 1. the HTTP layer's type checks (atMs and type "expire" included: neither is the worker's to send)
        try:
            if attempt is not None and not _an_attempt(attempt):
                raise InvalidRequest("attempt: must be a whole number from 0 to 2**63-1")
            if callback_id is not None and not isinstance(callback_id, str):
                raise InvalidRequest("callbackId: must be a string")
            event = parse_event(event_body, now_ms)
            if attempt is not None and event.type not in FENCED:
                raise InvalidRequest("attempt: only progress, succeed and fail callbacks are fenced")
        except InvalidRequest as error:
            return _error(error)
        # 2. existence
        task = self.tasks.get(task_id)
        if task is None:
            return _error(UnknownTask(task_id))
        # 3. callback-id dedup: global, checked first, bodies compared as parsed JSON
        # the defaults of the fields left out included, as the gateway parses the body before comparing
        defaults = {name: value for (kind, name), value in OPTIONAL.items() if kind == event.type}
        sent = {**defaults, **copy.deepcopy(event_body)}
        canonical = {"taskId": task_id, "event": sent, "attempt": attempt}
        if callback_id is not None and callback_id in self.callbacks:
            if not json_equal(self.callbacks[callback_id], canonical):
                return _error(
                    Conflict("callback-id-reused", f"callback id {callback_id} was used for another body")
                )
            return 200, {
                "changed": False,
                "duplicate": True,
                "duplicateCallback": True,
                "notify": False,
                "reason": "duplicate-callback",
                "task": m.task_to_json(task),
            }
        # 4. attempt fencing: nothing remembered
        if attempt is not None and event.type in FENCED and attempt != task.attempts:
            return _error(
                Conflict("stale-attempt", f"attempt {attempt} is not the current attempt {task.attempts}")
            )
        # 5. the state machine: an invalid event is not remembered
        try:
            transition = stamped(m.apply_event(task, event), now_ms)
        except InvalidRequest as error:
            return _error(error)
        if callback_id is not None:
            self.callbacks[callback_id] = canonical
        # protocol.md's notification time is the callback's, even when the callback expired the task
        self._record(transition, now_ms)
        return 200, {
            "changed": transition.changed,
            "duplicate": transition.duplicate,
            "duplicateCallback": False,
            "notify": transition.notify,
            "reason": transition.reason,
            "task": m.task_to_json(transition.task),
        }

    def cancel(self, task_id: str, now_ms: float, body: object = None) -> Answer:
        """``POST /v1/tasks/{id}/cancel`` with the JSON ``body`` (``None``: no body at all)."""
        try:
            reason = parse_cancel(body)
        except InvalidRequest as error:
            return _error(error)
        task = self.tasks.get(task_id)
        if task is None:
            return _error(UnknownTask(task_id))
        transition = stamped(m.cancel_task(task, now_ms, reason), now_ms)
        self._record(transition, now_ms)
        return 200, {
            "changed": transition.changed,
            "duplicate": transition.duplicate,
            "notify": transition.notify,
            "reason": transition.reason,
            "task": m.task_to_json(transition.task),
        }

    def sweep(self, now_ms: float) -> list[str]:
        """The sweeper: expire every non-terminal task whose deadline has come. Returns the expired ids."""
        expired = []
        for task_id, task in sorted(self.tasks.items()):
            if not task.terminal and now_ms >= task.expires_at_ms:
                self._record(stamped(m.expire_task(task), task.expires_at_ms), task.expires_at_ms)
                expired.append(task_id)
        return expired

    def deliver(self, task_id: str, key: str, now_ms: float) -> Answer:
        """``POST /v1/tasks/{id}/deliveries``, ``Idempotency-Key: key``: protocol.md's Deliveries."""
        if m.is_blank(key):
            return _error(m.fail("idempotencyKey must not be blank"))
        if isinstance(now_ms, bool) or not math.isfinite(now_ms) or now_ms < 0:
            return _error(m.fail("nowMs must be a non-negative number"))
        existing = self.deliveries.get(key)
        if existing is not None:
            if existing["taskId"] != task_id:
                return _error(
                    Conflict("key-reused-for-other-task", f"idempotency key {key} was used for another task")
                )
            return 200, {
                "ok": True,
                "duplicate": True,
                "reason": "duplicate-delivery",
                "receipt": dict(existing),
            }
        task = self.tasks.get(task_id)
        if task is None:
            return _error(UnknownTask(task_id))
        if task.state != "succeeded" or task.result_ref is None or task.result_hash is None:
            return _error(Conflict("not-succeeded", f"task {task_id} has not succeeded"))
        receipt = {
            "taskId": task_id,
            "resultRef": task.result_ref,
            "resultHash": task.result_hash,
            "idempotencyKey": key,
            "deliveredAtMs": _num(now_ms),
        }
        self.deliveries[key] = receipt
        return 200, {"ok": True, "duplicate": False, "reason": "delivered", "receipt": dict(receipt)}

    def drain(self) -> Answer:
        """``POST /v1/notifications/drain``: every notification once, ordered by task id, then time."""
        notifications = sorted(self.outbox, key=lambda n: (_utf16(n["taskId"]), n["atMs"]))
        self.outbox = []
        return 200, notifications

    def history(self, task_id: str) -> list[dict[str, Any]]:
        """The task's whole history as Entry JSON (empty for an unknown task)."""
        return [m.entry_to_json(entry) for entry in self.histories.get(task_id, [])]
