"""The gateway's own event, ``cancel`` (gateway/machine.py ``Cancel``, ``cancel_task``): example tests and
Hypothesis properties.

A cancel is decided in ``apply_event``'s order, like any callback: a terminal task does not change
(``terminal-conflict``), a cancel at or after the deadline expires the task instead, and otherwise a queued
or running task ends ``failed`` with ``error: "cancelled"`` through one ``cancel`` entry that carries the
reason, with a notification. It never changes how the task machine's own events behave (protocol.md, The
task's life): after a cancel every one of them is a ``terminal-conflict``, as after any failure.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import InvalidRequest
from gateway.machine import (
    CANCELLED,
    Cancel,
    Entry,
    Event,
    Expire,
    Fail,
    Progress,
    Start,
    Succeed,
    Task,
    Transition,
    apply_event,
    cancel_task,
    entry_to_json,
    event_from_json,
    event_to_json,
    expire_task,
)
from tests.unit.test_machine import DEADLINE, NOW, expired, failed, invalid, queued, running, step, succeeded
from tests.unit.test_machine_properties import EXAMPLES, Op, created_tasks, run, sequences


def cancelled(task: Task, at_ms: float, reason: str | None = None) -> Transition:
    """The expected transition of a cancel that takes: failed, error "cancelled", one cancel entry."""
    version = task.version + 1
    return Transition(
        task=replace(task, state="failed", error=CANCELLED, version=version),
        changed=True,
        duplicate=False,
        notify=True,
        reason="cancelled",
        entry=Entry(version, Cancel(at_ms, reason)),
    )


def requeued() -> Task:
    return step(running(), Fail(NOW + 30, "boom", True))


# --- examples ----------------------------------------------------------------------------------------


def test_a_queued_task_is_cancelled() -> None:
    task = queued()
    assert cancel_task(task, NOW + 5, "wrong export") == cancelled(task, NOW + 5, "wrong export")


def test_a_running_task_keeps_its_attempt_and_progress_when_cancelled() -> None:
    task = running(progress=40)
    tr = cancel_task(task, NOW + 50)
    assert tr == cancelled(task, NOW + 50)
    assert (tr.task.state, tr.task.error, tr.task.attempts, tr.task.progress) == (
        "failed",
        "cancelled",
        1,
        40,
    )


def test_a_task_waiting_for_its_retry_is_cancelled_and_the_workers_error_replaced() -> None:
    task = requeued()
    assert (task.state, task.attempts, task.error) == ("queued", 1, "boom")
    tr = cancel_task(task, NOW + 40, "runaway")
    assert tr == cancelled(task, NOW + 40, "runaway")
    assert tr.task.error == "cancelled"  # what clients test; the reason is in the entry


def test_cancel_task_is_apply_event_of_a_cancel() -> None:
    task = running()
    assert cancel_task(task, NOW + 50, "r") == apply_event(task, Cancel(NOW + 50, "r"))
    assert cancel_task(task, NOW + 50) == apply_event(task, Cancel(NOW + 50))


@pytest.mark.parametrize("ended", [succeeded, failed, expired, lambda: cancel_task(running(), NOW + 50).task])
def test_a_task_that_has_ended_does_not_change(ended: object) -> None:
    task = ended()  # type: ignore[operator]
    tr = cancel_task(task, NOW + 60, "too late")
    assert tr == Transition(task, changed=False, duplicate=False, notify=False, reason="terminal-conflict")
    assert tr.task is task


@pytest.mark.parametrize("late", [0, 1, 10**6])
def test_a_cancel_at_or_after_the_deadline_expires_the_task_instead(late: int) -> None:
    for task in (queued(), running(progress=40)):
        tr = cancel_task(task, DEADLINE + late, "late")
        assert tr == expire_task(task)
        assert tr.entry == Entry(task.version + 1, Expire(DEADLINE))
        assert (tr.task.state, tr.reason, tr.notify) == ("expired", "expired", True)


def test_a_cancel_just_before_the_deadline_cancels() -> None:
    task = running()
    assert cancel_task(task, DEADLINE - 1) == cancelled(task, DEADLINE - 1)


@pytest.mark.parametrize("at_ms", [-1, -0.5, math.nan, math.inf, -math.inf])
def test_a_cancel_at_an_invalid_time_is_refused_with_the_machines_message(at_ms: float) -> None:
    with invalid("event.atMs must be a non-negative number"):
        cancel_task(running(), at_ms)


def test_the_time_is_checked_before_the_state_as_for_every_event() -> None:
    with pytest.raises(InvalidRequest):
        cancel_task(succeeded(), -1)


@pytest.mark.parametrize(
    "event",
    [
        Start(NOW + 70, "w2"),
        Progress(NOW + 70, 90, "c"),
        Succeed(NOW + 70, "ref", "hash"),
        Fail(NOW + 70, "boom", True),
        Fail(NOW + 70, "boom", False),
        Cancel(NOW + 70, "again"),
    ],
)
def test_after_a_cancel_every_event_is_a_terminal_conflict(event: Event) -> None:
    task = cancel_task(running(), NOW + 50).task
    assert apply_event(task, event) == Transition(task, False, False, False, "terminal-conflict")
    assert expire_task(task) == Transition(task, False, False, False, "terminal-conflict")


def test_the_cancel_entry_in_json_carries_the_reason_only_when_given() -> None:
    assert event_to_json(Cancel(1_000, "wrong export")) == {
        "type": "cancel",
        "atMs": 1_000,
        "reason": "wrong export",
    }
    assert event_to_json(Cancel(1_000.0)) == {"type": "cancel", "atMs": 1_000}
    assert entry_to_json(Entry(3, Cancel(5))) == {"version": 3, "event": {"type": "cancel", "atMs": 5}}
    for event in (Cancel(1_000, "why"), Cancel(1_000)):
        assert event_from_json(event_to_json(event)) == event


def test_replaying_a_history_with_a_cancel_reproduces_the_task() -> None:
    task = running(progress=40)
    tr = cancel_task(task, NOW + 50, "stop")
    assert tr.entry is not None
    again = apply_event(task, event_from_json(event_to_json(tr.entry.event)))
    assert again == tr


# --- properties ----------------------------------------------------------------------------------------

reasons = st.one_of(st.none(), st.text(max_size=20))
# A cancel's time relative to the deadline: mostly before it, sometimes at it or after it.
offsets = st.one_of(st.integers(-5_000, -1), st.sampled_from([0, 1, 10**6]))


@settings(max_examples=EXAMPLES, deadline=None)
@given(created_tasks(), sequences, offsets, reasons)
def test_a_cancel_from_any_reachable_task(
    created: Task, sequence: list[Op], offset: int, reason: str | None
) -> None:
    """Whatever happened before (every event type, retries, expiry, other cancels), a cancel ends a live
    task failed/cancelled before its deadline, expires it at or after, and leaves an ended task alone."""
    task = run(created, sequence).final
    at = max(task.expires_at_ms + offset, 0)
    tr = cancel_task(task, at, reason)
    if task.terminal:
        assert tr == Transition(task, False, False, False, "terminal-conflict")
    elif at >= task.expires_at_ms:
        assert tr == expire_task(task)
    else:
        assert tr == cancelled(task, at, reason)
        # the fields a cancel may not touch are as they were
        assert (tr.task.attempts, tr.task.progress, tr.task.result_ref, tr.task.result_hash) == (
            task.attempts,
            task.progress,
            None,
            None,
        )
    # The entry, if any, replays to the same task from its JSON (the store's and the wire's form).
    if tr.entry is not None:
        assert apply_event(task, event_from_json(event_to_json(tr.entry.event))).task == tr.task


@settings(max_examples=EXAMPLES, deadline=None)
@given(created_tasks(), sequences, reasons)
def test_a_cancelled_task_answers_every_later_event_with_terminal_conflict(
    created: Task, sequence: list[Op], reason: str | None
) -> None:
    result = run(created, sequence)
    task = result.final
    if task.terminal:
        return
    ended = cancel_task(task, task.expires_at_ms - 1, reason).task
    # The same random events again, now on the cancelled task: nothing takes.
    after = run(ended, sequence)
    assert after.final is ended
    assert all(s.transition.reason == "terminal-conflict" for s in after.steps)
