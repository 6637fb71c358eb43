"""Example tests of the pure state machine (gateway/machine.py) against protocol.md's task life.

Values in, values out: every transition is compared whole (flags, reason, the resulting task, the new entry).
"""

from __future__ import annotations

import math
import re
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import pytest

from gateway.errors import InvalidRequest
from gateway.machine import (
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
    entry_to_json,
    event_from_json,
    event_to_json,
    expire_task,
    is_blank,
    resume_mode,
    task_from_json,
    task_to_json,
)

NOW = 1_000
TTL = 10_000
DEADLINE = NOW + TTL


def queued(max_attempts: int = 3) -> Task:
    return create_task(id="t1", now_ms=NOW, ttl_ms=TTL, max_attempts=max_attempts)


def step(task: Task, event: Start | Progress | Succeed | Fail | Expire) -> Task:
    """Apply an event that must change the task; return the new task."""
    tr = apply_event(task, event)
    assert tr.changed, tr
    return tr.task


def running(max_attempts: int = 3, progress: int = 0) -> Task:
    task = step(queued(max_attempts), Start(NOW + 10, "w1"))
    if progress:
        task = step(task, Progress(NOW + 20, progress, "c"))
    return task


def succeeded() -> Task:
    return step(running(), Succeed(NOW + 30, "ref-1", "hash-1"))


def failed() -> Task:
    return step(running(), Fail(NOW + 30, "boom", False))


def expired() -> Task:
    return expire_task(running()).task


def changed(task: Task, reason: str, event: object, *, notify: bool = False, **patch: object) -> Transition:
    """The expected transition of a change from ``task``: version + 1 and one entry at that version."""
    version = task.version + 1
    return Transition(
        task=replace(task, version=version, **patch),  # type: ignore[arg-type]
        changed=True,
        duplicate=False,
        notify=notify,
        reason=reason,
        entry=Entry(version, event),  # type: ignore[arg-type]
    )


def unchanged(task: Task, reason: str, *, duplicate: bool = False) -> Transition:
    return Transition(task=task, changed=False, duplicate=duplicate, notify=False, reason=reason, entry=None)


def invalid(message: str) -> AbstractContextManager[Any]:
    """Expect ``InvalidRequest`` with exactly this message, naming the client's field, with no prefix."""
    return pytest.raises(InvalidRequest, match=f"^{re.escape(message)}$")


# --- create_task ------------------------------------------------------------------------------------


def test_create_task_is_queued_at_version_zero() -> None:
    assert queued() == Task(
        id="t1",
        state="queued",
        expires_at_ms=DEADLINE,
        attempts=0,
        max_attempts=3,
        progress=0,
        version=0,
        result_ref=None,
        result_hash=None,
        error=None,
    )


def test_create_task_accepts_zero_now_and_integral_float_max_attempts() -> None:
    task = create_task(id="x", now_ms=0, ttl_ms=1, max_attempts=2.0)
    assert task.expires_at_ms == 1
    assert task.max_attempts == 2
    assert type(task.max_attempts) is int


@pytest.mark.parametrize(
    "blank", ["", " ", "\t\n\r\v\f", "\u00a0", "\ufeff", "\u2028", "\u2029", "\u3000", "\u1680", " \u202f "]
)
def test_create_task_rejects_blank_id_with_js_whitespace(blank: str) -> None:
    with invalid("id must not be blank"):
        create_task(id=blank, now_ms=NOW, ttl_ms=TTL, max_attempts=1)


@pytest.mark.parametrize("not_blank", ["\x85", "\x1c", "\u200b", "\u180e", " a "])
def test_create_task_id_blank_means_js_trim_not_python_strip(not_blank: str) -> None:
    # Python's str.strip() also strips \x85 and \x1c-\x1f; JavaScript's trim() does not.
    assert not is_blank(not_blank)
    assert create_task(id=not_blank, now_ms=NOW, ttl_ms=TTL, max_attempts=1).id == not_blank


@pytest.mark.parametrize("now_ms", [-1, -0.5, math.nan, math.inf, -math.inf])
def test_create_task_rejects_bad_now(now_ms: float) -> None:
    with invalid("nowMs must be a non-negative number"):
        create_task(id="t", now_ms=now_ms, ttl_ms=TTL, max_attempts=1)


@pytest.mark.parametrize("ttl_ms", [0, -1, 0.0, math.nan, math.inf, -math.inf])
def test_create_task_rejects_non_positive_ttl(ttl_ms: float) -> None:
    with invalid("ttlMs must be a positive number"):
        create_task(id="t", now_ms=NOW, ttl_ms=ttl_ms, max_attempts=1)


@pytest.mark.parametrize("max_attempts", [0, -1, 1.5, 0.5, math.nan, math.inf])
def test_create_task_rejects_bad_max_attempts(max_attempts: float) -> None:
    with invalid("maxAttempts must be an integer >= 1"):
        create_task(id="t", now_ms=NOW, ttl_ms=TTL, max_attempts=max_attempts)


def test_create_task_checks_in_order() -> None:
    with invalid("id must not be blank"):
        create_task(id=" ", now_ms=-1, ttl_ms=0, max_attempts=0)
    with invalid("nowMs must be a non-negative number"):
        create_task(id="t", now_ms=-1, ttl_ms=0, max_attempts=0)
    with invalid("ttlMs must be a positive number"):
        create_task(id="t", now_ms=0, ttl_ms=0, max_attempts=0)


def test_invalid_request_is_the_400_invalid_request_error() -> None:
    with pytest.raises(InvalidRequest) as info:
        create_task(id="", now_ms=0, ttl_ms=1, max_attempts=1)
    assert info.value.code == "invalid-request"
    assert info.value.status == 400
    assert info.value.to_json() == {"error": {"code": "invalid-request", "message": "id must not be blank"}}


# --- one test per reason ---------------------------------------------------------------------------


def test_started() -> None:
    task = queued()
    event = Start(NOW + 10, "w1")
    assert apply_event(task, event) == changed(
        task, "started", event, state="running", attempts=1, progress=0
    )


def test_progress() -> None:
    task = running()
    event = Progress(NOW + 20, 30, "c1")
    tr = apply_event(task, event)
    assert tr == changed(task, "progress", event, progress=30)
    assert tr.task.version == 2
    assert tr.entry == Entry(2, Progress(NOW + 20, 30, "c1"))


def test_progress_to_exactly_100_is_accepted() -> None:
    task = running(progress=99)
    event = Progress(NOW + 30, 100, "c")
    assert apply_event(task, event) == changed(task, "progress", event, progress=100)


def test_integral_float_progress_is_accepted_and_stored_as_int() -> None:
    task = running()
    tr = apply_event(task, Progress(NOW + 20, 50.0, "c"))
    assert tr == changed(task, "progress", Progress(NOW + 20, 50, "c"), progress=50)
    assert type(tr.task.progress) is int
    assert tr.entry is not None
    assert isinstance(tr.entry.event, Progress)
    assert type(tr.entry.event.progress) is int
    assert event_to_json(tr.entry.event)["progress"] == 50


def test_succeeded() -> None:
    task = running(progress=40)
    event = Succeed(NOW + 30, "ref-1", "hash-1")
    assert apply_event(task, event) == changed(
        task,
        "succeeded",
        event,
        notify=True,
        state="succeeded",
        progress=100,
        result_ref="ref-1",
        result_hash="hash-1",
    )


def test_failed_not_retryable() -> None:
    task = running(progress=40)
    event = Fail(NOW + 30, "boom", False)
    # progress is kept on failure
    assert apply_event(task, event) == changed(
        task, "failed", event, notify=True, state="failed", error="boom"
    )


def test_failed_when_retryable_but_attempts_equal_max_attempts() -> None:
    task = running(max_attempts=1, progress=10)
    assert task.attempts == task.max_attempts == 1
    event = Fail(NOW + 30, "again", True)
    assert apply_event(task, event) == changed(
        task, "failed", event, notify=True, state="failed", error="again"
    )


def test_requeued() -> None:
    task = running(max_attempts=2, progress=70)
    event = Fail(NOW + 30, "flaky", True)
    assert apply_event(task, event) == changed(
        task, "requeued", event, state="queued", progress=0, error="flaky"
    )


def test_start_after_requeue_increments_attempts_and_keeps_error() -> None:
    task = step(running(max_attempts=2, progress=70), Fail(NOW + 30, "flaky", True))
    event = Start(NOW + 40, "w2")
    tr = apply_event(task, event)
    assert tr == changed(task, "started", event, state="running", attempts=2, progress=0)
    assert tr.task.error == "flaky"
    # the second attempt's fail is final: attempts == maxAttempts
    final = apply_event(tr.task, Fail(NOW + 50, "again", True))
    assert final == changed(
        tr.task, "failed", Fail(NOW + 50, "again", True), notify=True, state="failed", error="again"
    )
    assert final.task.attempts == 2


def test_succeed_after_requeue_keeps_the_old_error() -> None:
    task = step(running(max_attempts=2), Fail(NOW + 30, "flaky", True))
    task = step(task, Start(NOW + 40, "w2"))
    tr = apply_event(task, Succeed(NOW + 50, "r", "h"))
    assert tr.task.state == "succeeded"
    assert tr.task.error == "flaky"
    assert task_to_json(tr.task)["error"] == "flaky"


def test_expired_by_expire_event_is_pinned_to_the_deadline() -> None:
    task = running(progress=20)
    tr = apply_event(task, Expire(NOW + 50))
    assert tr == changed(task, "expired", Expire(DEADLINE), notify=True, state="expired")


def test_expired_by_expire_task() -> None:
    task = queued()
    assert expire_task(task) == changed(task, "expired", Expire(DEADLINE), notify=True, state="expired")


@pytest.mark.parametrize(
    "event",
    [
        Start(DEADLINE, "w"),
        Progress(DEADLINE + 5, 50, "c"),
        Succeed(DEADLINE, "ref", "hash"),
        Fail(DEADLINE + 1_000_000, "e", True),
        Progress(DEADLINE, 101, "c"),  # the expiry check comes before the range check
        Progress(DEADLINE, -1, "c"),
        Succeed(DEADLINE, "", ""),  # ... and before the blank check
    ],
)
def test_late_callback_expires_the_task_with_an_expire_entry_at_the_deadline(event: object) -> None:
    task = running(progress=20)
    assert apply_event(task, event) == changed(  # type: ignore[arg-type]
        task, "expired", Expire(DEADLINE), notify=True, state="expired"
    )


def test_late_start_expires_a_queued_task() -> None:
    task = queued()
    assert apply_event(task, Start(DEADLINE + 1, "w")) == changed(
        task, "expired", Expire(DEADLINE), notify=True, state="expired"
    )


def test_one_millisecond_before_the_deadline_is_still_accepted() -> None:
    task = running()
    event = Succeed(DEADLINE - 1, "r", "h")
    assert apply_event(task, event).reason == "succeeded"


def test_duplicate_result() -> None:
    task = succeeded()
    assert apply_event(task, Succeed(NOW + 40, "ref-1", "hash-1")) == unchanged(
        task, "duplicate-result", duplicate=True
    )


def test_duplicate_result_compares_only_the_hash() -> None:
    task = succeeded()
    assert apply_event(task, Succeed(NOW + 40, "other-ref", "hash-1")) == unchanged(
        task, "duplicate-result", duplicate=True
    )


def test_duplicate_result_even_after_the_deadline() -> None:
    # terminal checks come before the deadline
    task = succeeded()
    assert apply_event(task, Succeed(DEADLINE + 99, "ref-1", "hash-1")) == unchanged(
        task, "duplicate-result", duplicate=True
    )


def test_duplicate_expire() -> None:
    task = expired()
    assert apply_event(task, Expire(DEADLINE + 5)) == unchanged(task, "duplicate-expire", duplicate=True)
    assert expire_task(task) == unchanged(task, "duplicate-expire", duplicate=True)


@pytest.mark.parametrize(
    ("make", "event"),
    [
        (succeeded, Succeed(NOW + 40, "ref-1", "hash-2")),
        (succeeded, Start(NOW + 40, "w")),
        (succeeded, Progress(NOW + 40, 100, "c")),
        (succeeded, Fail(NOW + 40, "e", True)),
        (succeeded, Expire(NOW + 40)),
        (failed, Succeed(NOW + 40, "r", "h")),
        (failed, Start(NOW + 40, "w")),
        (failed, Fail(NOW + 40, "boom", False)),
        (failed, Expire(DEADLINE)),
        (expired, Start(NOW + 40, "w")),
        (expired, Succeed(NOW + 40, "r", "h")),
        (expired, Progress(NOW + 40, 10, "c")),
        # terminal checks come before the deadline: no expiry of a terminal task
        (succeeded, Start(DEADLINE + 1, "w")),
        (failed, Progress(DEADLINE, 5, "c")),
        # ... and before range and blank checks
        (succeeded, Progress(NOW + 40, 101, "c")),
        (failed, Succeed(NOW + 40, "", "")),
    ],
)
def test_terminal_conflict(make: object, event: object) -> None:
    task = make()  # type: ignore[operator]
    assert apply_event(task, event) == unchanged(task, "terminal-conflict")  # type: ignore[arg-type]


@pytest.mark.parametrize("make", [succeeded, failed])
def test_expire_task_on_another_terminal_state_is_a_terminal_conflict(make: object) -> None:
    task = make()  # type: ignore[operator]
    assert expire_task(task) == unchanged(task, "terminal-conflict", duplicate=False)


def test_already_running() -> None:
    task = running(progress=30)
    assert apply_event(task, Start(NOW + 50, "w2")) == unchanged(task, "already-running", duplicate=True)


def test_not_startable_when_attempts_equal_max_attempts() -> None:
    # A queued task with attempts == maxAttempts is not reachable by transitions (requeue needs
    # attempts < maxAttempts), but the check is the task life's (protocol.md: not-startable).
    task = Task(
        id="t", state="queued", expires_at_ms=DEADLINE, attempts=2, max_attempts=2, progress=0, version=4
    )
    assert apply_event(task, Start(NOW, "w")) == unchanged(task, "not-startable")


@pytest.mark.parametrize(
    "event",
    [
        Progress(NOW + 5, 10, "c"),
        Progress(NOW + 5, 101, "c"),  # not-running comes before the range check
        Progress(NOW + 5, -1, "c"),
        Progress(NOW + 5, 1.5, "c"),
        Succeed(NOW + 5, "r", "h"),
        Succeed(NOW + 5, "", " "),  # not-running comes before the blank check
        Fail(NOW + 5, "e", True),
        Fail(NOW + 5, "e", False),
    ],
)
def test_not_running_on_a_queued_task(event: object) -> None:
    task = queued()
    assert apply_event(task, event) == unchanged(task, "not-running")  # type: ignore[arg-type]


def test_not_running_after_requeue() -> None:
    task = step(running(max_attempts=2), Fail(NOW + 30, "flaky", True))
    assert apply_event(task, Progress(NOW + 40, 101, "c")) == unchanged(task, "not-running")
    assert apply_event(task, Succeed(NOW + 40, "r", "h")) == unchanged(task, "not-running")


def test_stale_progress() -> None:
    task = running(progress=50)
    for stale in (40, 49, 0, 0.0):
        assert apply_event(task, Progress(NOW + 30, stale, "c")) == unchanged(
            task, "stale-progress", duplicate=False
        )


def test_duplicate_progress() -> None:
    task = running(progress=50)
    assert apply_event(task, Progress(NOW + 30, 50, "other")) == unchanged(
        task, "duplicate-progress", duplicate=True
    )
    assert apply_event(task, Progress(NOW + 30, 50.0, "c")) == unchanged(
        task, "duplicate-progress", duplicate=True
    )


def test_progress_zero_on_a_fresh_start_is_a_duplicate() -> None:
    task = running()
    assert apply_event(task, Progress(NOW + 30, 0, "c")) == unchanged(
        task, "duplicate-progress", duplicate=True
    )


# --- invalid events -----------------------------------------------------------------------------------


@pytest.mark.parametrize("at_ms", [-1, -0.001, math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("make", [queued, running, succeeded, failed, expired])
def test_bad_at_ms_is_rejected_first_in_every_state(at_ms: float, make: object) -> None:
    task = make()  # type: ignore[operator]
    for event in (
        Start(at_ms, "w"),
        Progress(at_ms, 10, "c"),
        Succeed(at_ms, "r", "h"),
        Fail(at_ms, "e", True),
        Expire(at_ms),
    ):
        with invalid("event.atMs must be a non-negative number"):
            apply_event(task, event)


def test_at_ms_zero_is_accepted() -> None:
    task = create_task(id="t", now_ms=0, ttl_ms=5, max_attempts=1)
    assert apply_event(task, Start(0, "w")).reason == "started"


@pytest.mark.parametrize("progress", [-1, 1.5, 0.5, 99.99, math.nan, math.inf, -math.inf])
def test_progress_must_be_a_non_negative_integer_when_running(progress: float) -> None:
    task = running(progress=10)
    with invalid("progress must be an integer >= 0"):
        apply_event(task, Progress(NOW + 30, progress, "c"))


@pytest.mark.parametrize("progress", [101, 101.0, 1000, 10**30])
def test_progress_must_not_exceed_100_when_running(progress: float) -> None:
    task = running(progress=10)
    with invalid("progress must not exceed 100"):
        apply_event(task, Progress(NOW + 30, progress, "c"))


def test_range_check_comes_before_stale_check() -> None:
    # -1 is both negative and below the current progress: the range check wins
    with invalid("progress must be an integer >= 0"):
        apply_event(running(progress=50), Progress(NOW + 30, -1, "c"))


@pytest.mark.parametrize(
    ("ref", "hash_"),
    [("", "h"), ("r", ""), (" ", "h"), ("r", "\u00a0"), ("\ufeff", "h"), ("r", "\t\n"), ("", "")],
)
def test_blank_result_ref_or_hash_is_rejected_when_running(ref: str, hash_: str) -> None:
    task = running()
    with invalid("resultRef and resultHash must not be blank"):
        apply_event(task, Succeed(NOW + 30, ref, hash_))


def test_rejected_events_leave_the_task_unchanged() -> None:
    task = running(progress=10)
    snapshot = replace(task)
    for event in (Progress(NOW + 30, 101, "c"), Succeed(NOW + 30, "", "h"), Start(-1, "w")):
        with pytest.raises(InvalidRequest):
            apply_event(task, event)
    assert task == snapshot


# --- resume_mode -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "cursor", "expected"),
    [
        (0, 0, ("caught-up", None)),
        (5, 5, ("caught-up", None)),
        (5, 4, ("delta", None)),
        (5, 0, ("delta", None)),
        (8, 0, ("delta", None)),  # version - cursor == retention: still a delta
        (9, 1, ("delta", None)),
        (9, 0, ("snapshot", "retention")),  # version - cursor > retention
        (100, 91, ("snapshot", "retention")),
        (100, 92, ("delta", None)),
        (5, 6, ("snapshot", "cursor-ahead")),  # protocol.md: ahead is a snapshot, not caught-up
        (0, 1, ("snapshot", "cursor-ahead")),
        (5, 3.0, ("delta", None)),  # an integral float is an integer, as Number.isInteger says
    ],
)
def test_resume_mode(version: int, cursor: object, expected: tuple[str, str | None]) -> None:
    assert resume_mode(version, cursor, 8) == expected


def test_resume_mode_uses_the_given_retention() -> None:
    assert resume_mode(5, 2, 2) == ("snapshot", "retention")
    assert resume_mode(5, 3, 2) == ("delta", None)
    assert resume_mode(5, 4, 0) == ("snapshot", "retention")


@pytest.mark.parametrize("cursor", [-1, 1.5, "3", None, True, math.nan, math.inf, [1]])
def test_resume_mode_rejects_a_cursor_that_is_not_a_non_negative_integer(cursor: object) -> None:
    with invalid("cursorVersion must be an integer >= 0"):
        resume_mode(5, cursor, 8)


# --- JSON ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("event", "data"),
    [
        (Start(5, "w1"), {"type": "start", "atMs": 5, "worker": "w1"}),
        (Progress(6, 42, "c9"), {"type": "progress", "atMs": 6, "progress": 42, "cursor": "c9"}),
        (Succeed(7, "r", "h"), {"type": "succeed", "atMs": 7, "resultRef": "r", "resultHash": "h"}),
        (Fail(8, "e", True), {"type": "fail", "atMs": 8, "error": "e", "retryable": True}),
        (Fail(8, "e", False), {"type": "fail", "atMs": 8, "error": "e", "retryable": False}),
        (Expire(9), {"type": "expire", "atMs": 9}),
        (Start(5.5, "w"), {"type": "start", "atMs": 5.5, "worker": "w"}),
    ],
)
def test_event_json_round_trip(event: Event, data: dict[str, object]) -> None:
    assert event_to_json(event) == data
    assert event_from_json(data) == event
    assert event_from_json(event_to_json(event)) == event


def test_integral_float_times_travel_as_json_integers() -> None:
    data = event_to_json(Expire(1000.0))
    assert data == {"type": "expire", "atMs": 1000}
    assert type(data["atMs"]) is int


def test_event_from_json_rejects_an_unknown_type() -> None:
    with pytest.raises(ValueError, match="unknown event type"):
        event_from_json({"type": "explode", "atMs": 1})


def test_entry_to_json() -> None:
    assert entry_to_json(Entry(3, Progress(6, 42, "c"))) == {
        "version": 3,
        "event": {"type": "progress", "atMs": 6, "progress": 42, "cursor": "c"},
    }


def test_task_to_json_omits_absent_optional_fields() -> None:
    data = task_to_json(queued())
    assert data == {
        "id": "t1",
        "state": "queued",
        "expiresAtMs": DEADLINE,
        "attempts": 0,
        "maxAttempts": 3,
        "progress": 0,
        "version": 0,
        # The gateway's own fields, always there: none and 0 until the book sets them (create_task does not).
        "tags": [],
        "createdAtMs": 0,
        # Beside the history (issue 34): always there, {} and 0 for none.
        "metadata": {},
        "revision": 0,
    }
    assert "resultRef" not in data and "resultHash" not in data and "error" not in data


def test_task_to_json_includes_present_optional_fields() -> None:
    assert task_to_json(succeeded()) == {
        "id": "t1",
        "state": "succeeded",
        "expiresAtMs": DEADLINE,
        "attempts": 1,
        "maxAttempts": 3,
        "progress": 100,
        "version": 2,
        "tags": [],
        "createdAtMs": 0,
        "resultRef": "ref-1",
        "resultHash": "hash-1",
        "metadata": {},
        "revision": 0,
    }
    assert task_to_json(failed())["error"] == "boom"
    assert "resultRef" not in task_to_json(failed())


def test_a_tasks_tags_and_creation_time_travel_in_its_json_and_outlive_its_transitions() -> None:
    tagged = replace(queued(), tags=("owner:u42", "project:7"), created_at_ms=NOW)
    data = task_to_json(tagged)
    assert (data["tags"], data["createdAtMs"]) == (["owner:u42", "project:7"], NOW)
    assert task_from_json(data) == tagged
    done = step(step(tagged, Start(NOW + 10, "w1")), Succeed(NOW + 20, "r", "h"))
    assert (done.tags, done.created_at_ms) == (tagged.tags, NOW)
    assert task_from_json(task_to_json(done)) == done


def test_task_to_json_keeps_an_empty_error_string() -> None:
    task = step(running(), Fail(NOW + 30, "", False))
    assert task_to_json(task)["error"] == ""
