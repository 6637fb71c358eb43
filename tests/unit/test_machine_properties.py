"""Properties of the pure state machine over random event sequences (Hypothesis).

A sequence starts from a created task and applies random events: every type, times around the deadline,
progress in and out of range, blank and non-blank results, random ``retryable`` flags, maxAttempts 1..4,
with now and then a sweeper's ``expire_task`` or a ``cancel`` (the gateway's own event, not the task
machine's). Events the machine rejects (``InvalidRequest``) are skipped, as a caller does: they must
leave the task as it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TypeVar

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import InvalidRequest
from gateway.machine import (
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
    create_task,
    event_from_json,
    event_to_json,
    expire_task,
    is_blank,
)
from tests.support.examples import examples
from tests.support.model import MACHINE_MESSAGE

EXAMPLES = examples(150)
T = TypeVar("T")


def weighted(*choices: tuple[int, st.SearchStrategy[T]]) -> st.SearchStrategy[T]:
    """One of the strategies, each picked with its weight."""
    total = sum(weight for weight, _ in choices)

    def pick(k: int) -> st.SearchStrategy[T]:
        for weight, strategy in choices:
            if k < weight:
                return strategy
            k -= weight
        raise AssertionError(k)

    return st.integers(0, total - 1).flatmap(pick)


# A time is given relative to the deadline: mostly before it, sometimes right at it or after it, rarely
# invalid (negative, NaN, infinite) or fractional.
deltas: st.SearchStrategy[object] = weighted(
    (90, st.integers(-2_000, -1)),
    (3, st.sampled_from([-1, 0, 1, 10**6])),
    (3, st.sampled_from([0.5, -0.5, math.nan, math.inf, -math.inf, "negative"])),
)
progresses: st.SearchStrategy[object] = weighted(
    (85, st.integers(0, 100)),
    (10, st.sampled_from([0, 10, 50, 100])),
    (15, st.sampled_from([-1, 101, 1.5, 50.0, 100.0, 101.0, math.nan, math.inf])),
)
results = st.sampled_from(["r1", "r1", "r1", "r2", "", " ", "\u00a0", "\ufeff"])
hashes = st.sampled_from(["h1", "h1", "h1", "h2", "", "\u3000"])


@dataclass(frozen=True)
class Op:
    """One step: an event type with a time relative to the deadline and its fields, or the sweeper."""

    kind: str
    delta: object = 0
    a: object = None
    b: object = None

    def event(self, task: Task) -> Event:
        if self.delta == "negative":
            at: float = -1
        else:
            at = task.expires_at_ms + self.delta  # type: ignore[operator]
        if self.kind == "start":
            return Start(at, str(self.a))
        if self.kind == "progress":
            return Progress(at, self.a, "cursor")  # type: ignore[arg-type]
        if self.kind == "succeed":
            return Succeed(at, str(self.a), str(self.b))
        if self.kind == "fail":
            return Fail(at, str(self.a), bool(self.b))
        if self.kind == "cancel":
            return Cancel(at, None if self.a is None else str(self.a))
        return Expire(at)


ops = weighted(
    (20, st.builds(Op, st.just("start"), deltas, st.sampled_from(["w1", "w2"]))),
    (30, st.builds(Op, st.just("progress"), deltas, progresses)),
    (12, st.builds(Op, st.just("succeed"), deltas, results, hashes)),
    (10, st.builds(Op, st.just("fail"), deltas, st.sampled_from(["e1", "e2"]), st.booleans())),
    (1, st.builds(Op, st.just("expire"), deltas)),
    (2, st.builds(Op, st.just("cancel"), deltas, st.sampled_from([None, "wrong export", ""]))),
    (1, st.just(Op("sweep"))),
)


@st.composite
def created_tasks(draw: st.DrawFn) -> Task:
    return create_task(
        id=draw(st.sampled_from(["t1", "task-2", "ä"])),
        now_ms=draw(st.integers(0, 5_000)),
        ttl_ms=draw(weighted((9, st.integers(2_000, 5_000)), (1, st.integers(1, 50)))),
        max_attempts=draw(st.integers(1, 4)),
    )


# Hypothesis keeps lists short by default; draw the length first so that long histories are common.
sequences = st.integers(0, 40).flatmap(lambda n: st.lists(ops, min_size=n, max_size=n))


@dataclass(frozen=True)
class Step:
    before: Task
    transition: Transition


@dataclass(frozen=True)
class Run:
    created: Task
    steps: list[Step]
    rejected: int
    final: Task


def _invalid_input(event: Event) -> bool:
    """Whether the event carries a value the machine can reject (a necessary condition of an error)."""
    at = event.at_ms
    if not math.isfinite(at) or at < 0:
        return True
    if isinstance(event, Progress):
        p = event.progress
        return not math.isfinite(p) or p != int(p) or not 0 <= p <= 100
    if isinstance(event, Succeed):
        return is_blank(event.result_ref) or is_blank(event.result_hash)
    return False


def run(created: Task, sequence: list[Op]) -> Run:
    task = created
    steps: list[Step] = []
    rejected = 0
    for op in sequence:
        if op.kind == "sweep":
            transition = expire_task(task)
        else:
            event = op.event(task)
            snapshot = replace(task)
            try:
                transition = apply_event(task, event)
            except InvalidRequest as error:
                # a rejected event changes nothing: the caller keeps the task it had
                assert task == snapshot
                assert MACHINE_MESSAGE.match(error.message), error.message
                assert _invalid_input(event), (task, event)
                rejected += 1
                continue
        steps.append(Step(task, transition))
        task = transition.task
    return Run(created, steps, rejected, task)


def _check_task_invariants(task: Task) -> None:
    assert 0 <= task.attempts <= task.max_attempts
    assert 0 <= task.progress <= 100
    assert type(task.progress) is int
    if task.state == "succeeded":
        assert task.progress == 100
        assert task.result_ref is not None and not is_blank(task.result_ref)
        assert task.result_hash is not None and not is_blank(task.result_hash)
    else:
        assert task.result_ref is None and task.result_hash is None
    if task.state == "queued":
        assert task.progress == 0
    if task.state in ("running", "succeeded"):
        assert task.attempts >= 1


@settings(max_examples=EXAMPLES, deadline=None)
@given(created_tasks(), sequences)
def test_a_each_change_adds_exactly_one_entry_at_the_next_version(created: Task, sequence: list[Op]) -> None:
    result = run(created, sequence)
    for s in result.steps:
        tr = s.transition
        if tr.changed:
            assert tr.entry is not None
            assert tr.entry.version == s.before.version + 1
            assert tr.task.version == tr.entry.version
            assert tr.duplicate is False
            if tr.reason == "progress":
                # progress only moves forward within an attempt
                assert s.before.state == tr.task.state == "running"
                assert tr.task.progress > s.before.progress
            # only the fields a transition may touch change
            assert (tr.task.id, tr.task.expires_at_ms, tr.task.max_attempts) == (
                s.before.id,
                s.before.expires_at_ms,
                s.before.max_attempts,
            )
        else:
            assert tr.task is s.before
            assert tr.entry is None
            assert tr.notify is False
        _check_task_invariants(tr.task)


@settings(max_examples=EXAMPLES, deadline=None)
@given(created_tasks(), sequences)
def test_b_a_terminal_task_never_changes_again(created: Task, sequence: list[Op]) -> None:
    result = run(created, sequence)
    terminal: Task | None = None
    for s in result.steps:
        if terminal is not None:
            assert s.before is terminal
            assert s.transition.changed is False
            assert s.transition.entry is None
            assert s.transition.task is terminal
            assert s.transition.reason in ("terminal-conflict", "duplicate-result", "duplicate-expire")
        elif s.transition.task.terminal:
            terminal = s.transition.task
    if terminal is not None:
        assert result.final is terminal


@settings(max_examples=EXAMPLES, deadline=None)
@given(created_tasks(), sequences)
def test_c_notify_exactly_once_on_entering_a_terminal_state(created: Task, sequence: list[Op]) -> None:
    result = run(created, sequence)
    notified = 0
    for s in result.steps:
        tr = s.transition
        entering = not s.before.terminal and tr.task.terminal
        assert tr.notify is entering
        notified += tr.notify
        if tr.notify:
            assert tr.reason in ("succeeded", "failed", "expired", "cancelled")
    assert notified <= 1
    assert notified == (1 if result.final.terminal else 0)


@settings(max_examples=EXAMPLES, deadline=None)
@given(created_tasks(), sequences)
def test_d_replaying_the_history_reproduces_the_task(created: Task, sequence: list[Op]) -> None:
    result = run(created, sequence)
    history: list[Entry] = [s.transition.entry for s in result.steps if s.transition.entry is not None]

    for through_json in (False, True):
        task = created
        for entry in history:
            event = event_from_json(event_to_json(entry.event)) if through_json else entry.event
            tr = apply_event(task, event)
            assert tr.changed
            assert tr.entry == entry
            task = tr.task
        assert task == result.final

    for entry in history:
        if isinstance(entry.event, Expire):
            # an expiry, by the sweeper or by a late callback, is recorded at the deadline
            assert entry.event.at_ms == created.expires_at_ms
        else:
            assert entry.event.at_ms < created.expires_at_ms


@settings(max_examples=EXAMPLES, deadline=None)
@given(created_tasks(), sequences)
def test_e_versions_are_contiguous_from_one(created: Task, sequence: list[Op]) -> None:
    result = run(created, sequence)
    versions = [s.transition.entry.version for s in result.steps if s.transition.entry is not None]
    assert versions == list(range(1, len(versions) + 1))
    assert result.final.version == len(versions)


@settings(max_examples=EXAMPLES, deadline=None)
@given(created_tasks(), sequences)
def test_unchanged_reasons_and_duplicate_flags(created: Task, sequence: list[Op]) -> None:
    duplicate_reasons = {"duplicate-result", "duplicate-expire", "already-running", "duplicate-progress"}
    other_reasons = {"terminal-conflict", "not-startable", "not-running", "stale-progress"}
    result = run(created, sequence)
    for s in result.steps:
        tr = s.transition
        if tr.changed:
            assert tr.reason in {
                "started",
                "progress",
                "succeeded",
                "failed",
                "requeued",
                "expired",
                "cancelled",
            }
        else:
            assert tr.reason in duplicate_reasons | other_reasons
            assert tr.duplicate is (tr.reason in duplicate_reasons)
