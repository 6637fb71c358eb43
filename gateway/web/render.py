"""The routes' answers as JSON, built with orjson (the answers' shapes, for OpenAPI, are ``answers.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from gateway.book.outcomes import CallbackOutcome, Delivery
from gateway.lease import Lease
from gateway.machine import Resume, Transition, task_to_json
from gateway.store.base import Notification


def cancel_json(t: Transition) -> dict[str, Any]:
    """A cancel's answer: a callback's, without ``duplicateCallback`` (a cancel has no callback id)."""
    return {
        "changed": t.changed,
        "duplicate": t.duplicate,
        "notify": t.notify,
        "reason": t.reason,
        "task": task_to_json(t.task),
    }


def callback_json(outcome: CallbackOutcome) -> dict[str, Any]:
    t = outcome.transition
    answer = {
        "changed": t.changed,
        "duplicate": t.duplicate,
        "duplicateCallback": outcome.duplicate_callback,
        "notify": t.notify,
        "reason": t.reason,
        "task": task_to_json(t.task),
    }
    lease = outcome.lease
    if lease is not None and lease.heartbeat_ms is not None:  # a running attempt that holds a lease
        answer.update(lease_json(lease))
    return answer


def lease_json(lease: Lease | None) -> dict[str, Any]:
    """``{"leaseUntilMs", "heartbeatMs"}``: both null for a task created without a lease."""
    if lease is None:
        return {"leaseUntilMs": None, "heartbeatMs": None}
    return {"leaseUntilMs": lease.until_ms, "heartbeatMs": lease.heartbeat_ms}


def resume_json(resume: Resume) -> bytes:
    """``{"mode", "version", "events", "task", "reason"?}``; stored entries are spliced in as stored."""
    head: dict[str, Any] = {"mode": resume.mode, "version": resume.task.version}
    if resume.reason is not None:
        head["reason"] = resume.reason
    head["task"] = task_to_json(resume.task)
    return orjson.dumps(head)[:-1] + b',"events":' + resume.entries_json() + b"}"


def delivery_json(delivery: Delivery) -> dict[str, Any]:
    r = delivery.receipt
    return {
        "ok": delivery.ok,
        "duplicate": delivery.duplicate,
        "reason": delivery.reason,
        "receipt": {
            "taskId": r.task_id,
            "resultRef": r.result_ref,
            "resultHash": r.result_hash,
            "idempotencyKey": r.idempotency_key,
            "deliveredAtMs": r.delivered_at_ms,
        },
    }


def notification_json(n: Notification) -> dict[str, Any]:
    return {"taskId": n.task_id, "state": n.state, "atMs": n.at_ms, "version": n.version}


def notifications_body(notifications: Sequence[Notification]) -> bytes:
    """A drain's answer: its notifications as a JSON array."""
    return orjson.dumps([notification_json(n) for n in notifications])
