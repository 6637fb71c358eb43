"""A worker told its attempt is over while its job still runs or has just finished, pure: whether it takes
its task back or the task went on without it. The ``Worker`` and the queue integrations' sender
(``gateway.integrations.outbox``) both decide here.

The gateway ends an attempt whose heartbeat lease ran out (the gateway was down or out of reach past it,
the worker's process was stopped) with its own ``fail``, ``heartbeat-timeout``, retryable: the task is
queued for its next attempt, and the worker's next callback is answered ``not-running`` (a heartbeat, ``409
not-running``), with the task. But the job is still running, or has finished and its queue has the message
done: nothing else will start that next attempt, and the task would read "Retrying" until its deadline.
So a worker whose task is queued at the worker's own attempt by that lease's fail takes it back: a new
``start`` (the next attempt, counted against ``maxAttempts``), the progress it had reached, then what the
job reports. Otherwise the task went on without it (a newer attempt started, the lease ended the last
attempt, the task ended or was cancelled): what the job had to report is lost, and the worker says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.client.errors import cancelled

# The error of the gateway's fail when a lease runs out (protocol.md, Heartbeat leases).
HEARTBEAT_TIMEOUT = "heartbeat-timeout"


@dataclass(frozen=True)
class TakeBack:
    """Start the task again, as its next attempt: the lease ended while this worker still ran."""


@dataclass(frozen=True)
class WentOn:
    """The task went on without this worker; ``why``, in words."""

    why: str


TAKE_BACK = TakeBack()


def outlived(task: dict[str, Any] | None, attempt: int) -> TakeBack | WentOn:
    """What a worker of ``attempt`` does once told the attempt is over; ``task`` is the task the answer
    carries (``None`` for a ``409 stale-attempt``, which carries none: a newer attempt has started)."""
    if task is None:
        return WentOn("another attempt has started since")
    state, attempts, error = task.get("state"), task.get("attempts"), task.get("error")
    if isinstance(attempts, int) and attempts > attempt:
        return WentOn(f"attempt {attempts} has started since")
    if state == "queued" and error == HEARTBEAT_TIMEOUT:
        return TAKE_BACK
    if state == "queued":
        return WentOn(f"attempt {attempt} was ended by a fail: {error}")
    if state == "failed" and error == HEARTBEAT_TIMEOUT:
        return WentOn(
            f"its lease ran out on attempt {attempt} of {task.get('maxAttempts')}: no attempt left, the task "
            "failed"
        )
    if cancelled(task):
        return WentOn("the task was cancelled")
    return WentOn(f"the task is {state}")


def lost(event: dict[str, Any] | None) -> str:
    """What is lost with a report the gateway will not take (``None``: whatever the job reports next)."""
    if event is None:
        return "what the job reports from here on"
    kind = event.get("type")
    if kind == "succeed":
        return f"its result {event.get('resultRef')}"
    if kind == "fail":
        return f"its failure ({event.get('error')})"
    return f"its progress {event.get('progress')}% and what the job reports after it"
