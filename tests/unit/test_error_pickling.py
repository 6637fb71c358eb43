"""The clients' worker errors survive pickling: a queue keeps a job's exception (arq stores it as the job's
result, Celery's result backends too), and one that cannot be read back breaks the queue's own readers."""

from __future__ import annotations

import pickle

from gateway.client.errors import (
    AttemptOver,
    CallbackError,
    CallbackIgnored,
    TaskAlreadyRunning,
    TaskCancelled,
)

TASK = {"id": "report-42", "state": "failed", "error": "cancelled", "attempts": 1}


def test_ignored_callbacks_pickle_as_made() -> None:
    for kind in (CallbackIgnored, TaskAlreadyRunning, TaskCancelled):
        error = kind("progress", "terminal-conflict", TASK)
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is kind
        assert (str(copy), copy.event_type, copy.reason, copy.task, copy.task_id) == (
            str(error),
            "progress",
            "terminal-conflict",
            TASK,
            "report-42",
        )


def test_refused_callbacks_pickle_as_made() -> None:
    for kind in (CallbackError, AttemptOver):
        error = kind(409, "stale-attempt", "attempt 1 is over", task_id="report-42", task=TASK)
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is kind
        assert (str(copy), copy.status, copy.code, copy.reason, copy.task, copy.task_id) == (
            str(error),
            409,
            "stale-attempt",
            "stale-attempt",
            TASK,
            "report-42",
        )


def test_a_cancelled_task_is_said_to_be_cancelled() -> None:
    """What a job's log shows when ``progress()`` raises: the task was cancelled, and how the worker learned
    it (pickled and read back the same)."""
    error = TaskCancelled("progress", "terminal-conflict", TASK)
    expected = "task report-42 was cancelled (progress callback answered terminal-conflict; attempt 1)"
    assert str(error) == str(pickle.loads(pickle.dumps(error))) == expected
    beat = TaskCancelled("heartbeat", "not-running", TASK)
    assert str(beat) == "task report-42 was cancelled (heartbeat answered not-running; attempt 1)"
