"""Heartbeat leases: the gateway's own rule for a running attempt whose worker has gone silent. Pure: no I/O,
no clock.

A task created with ``heartbeatMs`` holds a lease while it is ``running``: it ends ``heartbeatMs`` after the
attempt's latest sign of life (its start, any callback of it, a heartbeat), by the gateway's clock. A lease
that runs out is ended with the task machine's own event (protocol.md, The task's life), ``fail`` with
``error: "heartbeat-timeout"`` and ``retryable: true``, stamped at the lease's end and decided by
:func:`gateway.machine.apply_event` like any other fail: requeued while attempts remain, else failed. The
lease is the gateway's state, not the task machine's (protocol.md, Heartbeat leases): it is kept beside the
task (its row), never in :class:`gateway.machine.Task`, and a lease end on a task that is no longer running
means nothing (it is renewed when an attempt starts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from gateway.errors import Conflict
from gateway.machine import Fail, Task, Transition, apply_event, task_to_json

# The shortest lease a task may ask for: a heartbeat at a third of it stays well apart from network delays.
MIN_HEARTBEAT_MS: Final = 1_000
TIMEOUT_ERROR: Final = "heartbeat-timeout"


@dataclass(frozen=True, slots=True)
class Lease:
    """The lease of a running attempt, as its worker is told: when it ends and what renews it by how much.
    ``until_ms`` is ``None`` for a task created without ``heartbeatMs`` (nothing to renew)."""

    until_ms: int | None
    heartbeat_ms: int | None


def renewal(task: Task, heartbeat_ms: int | None, now_ms: int) -> int | None:
    """The lease end a callback or heartbeat applied at ``now_ms`` leaves on ``task`` (as it is after it):
    ``now + heartbeatMs`` while the task runs and has a lease; ``None`` when there is none to write."""
    if heartbeat_ms is None or task.state != "running":
        return None
    return now_ms + heartbeat_ms


def lease_of(task: Task, heartbeat_ms: int | None, until_ms: int | None) -> Lease | None:
    """What a worker is told of its lease: only while the task runs (``None`` otherwise)."""
    if task.state != "running":
        return None
    return Lease(until_ms if heartbeat_ms is not None else None, heartbeat_ms)


def fence(task: Task, attempt: int | None) -> None:
    """``409 stale-attempt`` when a worker's ``attempt`` (``None``: a callback that carries none) is not the
    task's current one: a worker whose attempt was requeued cannot write into the next one (its callbacks,
    heartbeats and stream appends alike)."""
    if attempt is not None and attempt != task.attempts:
        raise Conflict(
            "stale-attempt", f"attempt {attempt} is not the task's current attempt ({task.attempts})"
        )


def heartbeat(task: Task) -> Transition:
    """A heartbeat on ``task``, its attempt already matched: it renews only a running attempt, and changes
    nothing of the task (its answer is the lease, never this transition's reason). Else ``409
    not-running``, saying what became of the attempt and carrying the task as it is (a worker tells a
    cancelled task, ``failed`` with ``error: "cancelled"``, from an attempt that merely ran out)."""
    if task.state == "running":
        return Transition(task, changed=False, duplicate=False, notify=False, reason="heartbeat")
    if task.state == "queued":
        why = "it was requeued (its lease ran out, or it failed) and waits for a start"
    else:
        why = f"it has ended ({task.state}" + (f", error {task.error!r})" if task.error else ")")
    raise Conflict(
        "not-running",
        f"task {task.id} is {task.state}, not running: attempt {task.attempts} is over, {why}",
        task=task_to_json(task),
    )


def timed_out(task: Task, lease_until_ms: int) -> Transition:
    """The gateway's end of a lease: the retryable fail of protocol.md's task life, at the lease's end."""
    return apply_event(task, Fail(lease_until_ms, TIMEOUT_ERROR, True))
