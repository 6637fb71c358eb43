"""The history checker (tests/support/history.py) passes a history that keeps the invariants and names each
violation of one: a checker that cannot fail would prove nothing in the fault tests that use it."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.history import History

BASE = {"id": "t", "state": "queued", "expiresAtMs": 10**13, "attempts": 0, "maxAttempts": 1,
        "progress": 0, "version": 0}  # fmt: skip
START = {"type": "start", "atMs": 1, "worker": "w"}
DONE = {"type": "succeed", "atMs": 2, "resultRef": "s3://r", "resultHash": "sha256:1"}
RUNNING = BASE | {"state": "running", "attempts": 1, "version": 1}
SUCCEEDED = RUNNING | {"state": "succeeded", "progress": 100, "version": 2, "resultRef": "s3://r",
                       "resultHash": "sha256:1"}  # fmt: skip


def frame(kind: str, version: int, task: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": kind, "taskId": "t", "version": version, "task": task, **extra}


def good() -> History:
    seen = History()
    seen.created(BASE)
    seen.frame("s", frame("caught-up", 0, BASE))
    seen.frame("s", frame("event", 1, RUNNING, event=START))
    # a reconnect: a delta from the cursor held
    seen.frame("s", frame("delta", 2, SUCCEEDED, events=[{"version": 2, "event": DONE}]))
    seen.frame("late", frame("snapshot", 2, SUCCEEDED, reason="retention"))
    seen.callback("t", "cb-start", {"type": "start", "worker": "w"}, 200, {"changed": True, "task": RUNNING})
    done = {k: v for k, v in DONE.items() if k != "atMs"}
    seen.callback("t", "cb-done", done, None)  # its answer lost...
    seen.callback("t", "cb-done", done, 200, {"changed": False, "duplicateCallback": True, "task": SUCCEEDED})
    seen.delivery("k", 200, {"receipt": {"idempotencyKey": "k", "deliveredAtMs": 5}})
    seen.delivery("k", 200, {"receipt": {"idempotencyKey": "k", "deliveredAtMs": 5}})
    seen.notification({"taskId": "t", "state": "succeeded"})
    seen.notification({"taskId": "t", "state": "succeeded"}, "msg_1")
    seen.notification({"taskId": "t", "state": "succeeded"}, "msg_1")  # a relayed duplicate, same id
    seen.final(
        "t", {"mode": "delta", "events": [{"version": 1, "event": START}, {"version": 2, "event": DONE}]}
    )
    return seen


def test_a_history_that_keeps_the_invariants_passes() -> None:
    good().check()


@pytest.mark.parametrize(
    ("spoil", "says"),
    [
        (lambda h: h.frame("s", frame("event", 4, SUCCEEDED)), "after the terminal state"),
        (lambda h: h.frame("x", frame("caught-up", 0, BASE)) or h.frame("x", frame("event", 2, RUNNING)),
         "a skip"),
        (lambda h: h.frame("x", frame("event", 1, RUNNING)) or h.frame("x", frame("snapshot", 0, BASE)),
         "goes back"),
        (lambda h: h.notification({"taskId": "t", "state": "succeeded"}), "2 drained notifications"),
        (lambda h: h.notification({"taskId": "t", "state": "succeeded"}, "msg_2"), "2 relayed"),
        (lambda h: h.notification({"taskId": "t", "state": "failed"}), "more than one terminal state"),
        (lambda h: h.delivery("k", 200, {"receipt": {"idempotencyKey": "k", "deliveredAtMs": 6}}),
         "different receipts"),
        (lambda h: h.callback("t", "cb-p", {"type": "progress", "progress": 5}, 200,
                              {"changed": True, "task": RUNNING}), "0 times in the history"),
        (lambda h: h.final("t", {"mode": "delta", "events": [{"version": 1, "event": START},
                                                             {"version": 2, "event": DONE},
                                                             {"version": 3, "event": DONE}]}),
         "after the terminal state"),
    ],
)  # fmt: skip
def test_each_violation_is_named(spoil: Any, says: str) -> None:
    seen = good()
    spoil(seen)
    with pytest.raises(AssertionError, match=says):
        seen.check()


CANCEL = {"type": "cancel", "atMs": 3, "reason": "wrong export"}
CANCELLED = RUNNING | {"state": "failed", "error": "cancelled", "version": 2}


def cancelled_run() -> History:
    """A running task cancelled by the gateway (its own event), seen by a subscriber, the canceller, the
    worker's next callback and the relay."""
    seen = History()
    seen.created(BASE)
    seen.frame("s", frame("caught-up", 0, BASE))
    seen.frame("s", frame("event", 1, RUNNING, event=START))
    seen.frame("s", frame("event", 2, CANCELLED, event=CANCEL))
    seen.cancel("t", None)  # its answer lost ...
    seen.cancel("t", 200, {"changed": True, "reason": "cancelled", "task": CANCELLED})
    seen.cancel("t", 200, {"changed": False, "reason": "terminal-conflict", "task": CANCELLED})
    seen.callback("t", "cb-p", {"type": "progress", "progress": 5, "cursor": "c"}, 200,
                  {"changed": False, "reason": "terminal-conflict", "task": CANCELLED})  # fmt: skip
    seen.notification({"taskId": "t", "state": "failed"}, "msg_1")
    seen.final(
        "t", {"mode": "delta", "events": [{"version": 1, "event": START}, {"version": 2, "event": CANCEL}]}
    )
    return seen


def test_a_cancelled_history_passes() -> None:
    cancelled_run().check()


@pytest.mark.parametrize(
    ("spoil", "says"),
    [
        # answered as cancelled, but the store has no cancel entry
        (lambda h: h.final("t", {"mode": "delta", "events": [{"version": 1, "event": START}]}),
         "answered as cancelled, 0 cancel entries"),
        # a cancel entry that does not end the history
        (lambda h: h.final("t", {"mode": "delta", "events": [{"version": 1, "event": CANCEL},
                                                             {"version": 2, "event": START}]}),
         "not one ending the history"),
        # the task seen succeeded too
        (lambda h: h.cancel("t", 200, {"changed": False, "reason": "terminal-conflict", "task": SUCCEEDED}),
         "more than one terminal state"),
    ],
)  # fmt: skip
def test_each_cancel_violation_is_named(spoil: Any, says: str) -> None:
    seen = cancelled_run()
    spoil(seen)
    with pytest.raises(AssertionError, match=says):
        seen.check()
