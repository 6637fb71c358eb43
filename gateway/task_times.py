"""What the gateway records of a task's runs for the task list (protocol.md, Shapes): the worker and the
time of its last start, and when it became terminal. Beside the history, never in it: stamped on a
transition's task after the machine decided it, so that no event's outcome depends on them. Pure."""

from __future__ import annotations

from dataclasses import replace

from gateway.machine import Start, Transition


def stamped(transition: Transition, notify_at_ms: float) -> Transition:
    """``transition`` with its task's ``worker``/``startedAtMs`` set by a start entry, and ``endedAtMs`` by a
    terminal one (``notify_at_ms``: the time of its notification, which retention counts from)."""
    entry = transition.entry
    if entry is None:
        return transition
    task = transition.task
    if isinstance(entry.event, Start):
        task = replace(task, worker=entry.event.worker, started_at_ms=int(entry.event.at_ms))
    elif transition.notify:
        task = replace(task, ended_at_ms=int(notify_at_ms))
    else:
        return transition
    return replace(transition, task=task)
