"""Tests of the in-memory model of the HTTP API (tests/support/model.py), the oracle of the model-based
tests."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.machine import apply_event, create_task, event_from_json, task_to_json
from tests.support.examples import examples
from tests.support.model import Model, json_equal

TTL = 10_000


def code(answer: tuple[int, Any]) -> tuple[int, str]:
    status, body = answer
    return status, body["error"]["code"]


@pytest.fixture
def model() -> Model:
    book = Model()
    assert book.create("t1", 1_000, TTL, 2)[0] == 201
    return book


def start(model: Model, task_id: str = "t1", now: int = 1_010, **kw: Any) -> tuple[int, Any]:
    return model.callback(task_id, now, {"type": "start", "worker": "w1"}, **kw)


def succeed(model: Model, task_id: str = "t1", now: int = 1_030, **kw: Any) -> tuple[int, Any]:
    return model.callback(task_id, now, {"type": "succeed", "resultRef": "r1", "resultHash": "h1"}, **kw)


# --- create / get ------------------------------------------------------------------------------------


def test_create_and_get(model: Model) -> None:
    task = {
        "id": "t1",
        "state": "queued",
        "expiresAtMs": 11_000,
        "attempts": 0,
        "maxAttempts": 2,
        "progress": 0,
        "version": 0,
        "tags": [],
        "createdAtMs": 1_000,
        "metadata": {},
        "revision": 0,
    }
    assert model.get("t1") == (200, task)
    assert model.create("t2", 0, 5, 1) == (
        201,
        {"task": {**task, "id": "t2", "expiresAtMs": 5, "maxAttempts": 1, "createdAtMs": 0}},
    )


def test_create_is_idempotent_with_the_same_parameters(model: Model) -> None:
    start(model)
    # later, with the same parameters: the current task, its deadline unchanged
    status, body = model.create("t1", 5_000, TTL, 2)
    assert status == 200
    assert body["task"] == model.get("t1")[1]
    assert body["task"]["state"] == "running"
    assert body["task"]["expiresAtMs"] == 11_000


@pytest.mark.parametrize(("ttl", "max_attempts"), [(TTL + 1, 2), (TTL, 3)])
def test_create_with_other_parameters_is_task_exists(model: Model, ttl: int, max_attempts: int) -> None:
    assert code(model.create("t1", 1_000, ttl, max_attempts)) == (409, "task-exists")
    assert model.get("t1")[1]["maxAttempts"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("\u00a0", 0, 1, 1), "id must not be blank"),
        (("t", -1, 1, 1), "nowMs must be a non-negative number"),
        (("t", 0, 0, 1), "ttlMs must be a positive number"),
        (("t", 0, 1, 1.5), "maxAttempts must be an integer >= 1"),
    ],
)
def test_create_rejects_what_the_machine_rejects(args: tuple[Any, ...], message: str) -> None:
    book = Model()
    assert book.create(*args) == (400, {"error": {"code": "invalid-request", "message": message}})
    assert book.get(args[0])[0] == 404


def test_unknown_task() -> None:
    book = Model()
    assert code(book.get("nope")) == (404, "unknown-task")
    assert code(book.events("nope", 0)) == (404, "unknown-task")
    assert code(start(book, "nope")) == (404, "unknown-task")
    assert book.history("nope") == []


# --- callbacks ---------------------------------------------------------------------------------------


def test_callback_answers_the_transition_and_records_the_entry(model: Model) -> None:
    status, body = start(model, callback_id="cb1")
    assert status == 200
    assert body == {
        "changed": True,
        "duplicate": False,
        "duplicateCallback": False,
        "notify": False,
        "reason": "started",
        "task": {**model.get("t1")[1], "state": "running", "attempts": 1, "version": 1},
    }
    assert model.history("t1") == [{"version": 1, "event": {"type": "start", "atMs": 1_010, "worker": "w1"}}]


def test_callback_id_dedup(model: Model) -> None:
    start(model, callback_id="cb1")
    progress = {"type": "progress", "progress": 5, "cursor": "c"}
    assert model.callback("t1", 1_020, progress, callback_id="cb2")[1]["reason"] == "progress"
    task = model.get("t1")[1]
    # a retry, even later and with 5.0 for 5 (the same parsed JSON), changes nothing
    again = model.callback(
        "t1", 1_500, {"type": "progress", "progress": 5.0, "cursor": "c"}, callback_id="cb2"
    )
    assert again == (
        200,
        {
            "changed": False,
            "duplicate": True,
            "duplicateCallback": True,
            "notify": False,
            "reason": "duplicate-callback",
            "task": task,
        },
    )
    assert len(model.history("t1")) == 2


def test_callback_id_is_remembered_even_when_nothing_changed(model: Model) -> None:
    progress = {"type": "progress", "progress": 5, "cursor": "c"}
    assert model.callback("t1", 1_020, progress, callback_id="cb1")[1]["reason"] == "not-running"
    start(model)
    assert model.callback("t1", 1_030, progress, callback_id="cb1")[1]["reason"] == "duplicate-callback"
    assert model.get("t1")[1]["progress"] == 0


def test_callback_id_reused_with_another_body(model: Model) -> None:
    model.create("t2", 1_000, TTL, 1)
    start(model, callback_id="cb1")
    assert code(start(model, "t2", callback_id="cb1")) == (409, "callback-id-reused")  # another task
    other_worker = model.callback("t1", 1_020, {"type": "start", "worker": "w2"}, callback_id="cb1")
    assert code(other_worker) == (409, "callback-id-reused")  # another event
    assert model.get("t2")[1]["state"] == "queued"
    progress = {"type": "progress", "progress": 5, "cursor": "c"}
    assert model.callback("t1", 1_030, progress, callback_id="cb2", attempt=1)[1]["reason"] == "progress"
    again = model.callback("t1", 1_040, progress, callback_id="cb2", attempt=2)
    assert code(again) == (409, "callback-id-reused")  # another attempt


def test_invalid_event_does_not_remember_the_callback_id(model: Model) -> None:
    start(model)
    too_far = {"type": "progress", "progress": 101, "cursor": "c"}
    assert model.callback("t1", 1_020, too_far, callback_id="cb1") == (
        400,
        {"error": {"code": "invalid-request", "message": "progress must not exceed 100"}},
    )
    ok = model.callback("t1", 1_030, {"type": "progress", "progress": 7, "cursor": "c"}, callback_id="cb1")
    assert ok[1]["reason"] == "progress"


def test_progress_101_on_a_queued_task_is_not_running(model: Model) -> None:
    status, body = model.callback("t1", 1_020, {"type": "progress", "progress": 101, "cursor": "c"})
    assert (status, body["reason"], body["changed"]) == (200, "not-running", False)


@pytest.mark.parametrize(
    "event",
    [
        {"type": "expire"},
        {"type": "start", "worker": "w", "atMs": 5},
        {"type": "explode"},
        {"type": "start"},
        {"type": "start", "worker": 5},
        {"type": "progress", "progress": True, "cursor": "c"},
        {"type": "fail", "error": "e", "retryable": 1},
    ],
)
def test_malformed_events_are_rejected(model: Model, event: dict[str, Any]) -> None:
    assert code(model.callback("t1", 1_020, event, callback_id="cb1")) == (400, "invalid-request")
    assert start(model, callback_id="cb1")[1]["reason"] == "started"


def test_stale_attempt(model: Model) -> None:
    start(model)
    fail = {"type": "fail", "error": "flaky", "retryable": True}
    assert model.callback("t1", 1_020, fail, attempt=1)[1]["reason"] == "requeued"
    start(model, now=1_030)
    # the first attempt's worker cannot write into the second
    assert code(succeed(model, now=1_040, attempt=1, callback_id="cb1")) == (409, "stale-attempt")
    assert model.get("t1")[1]["state"] == "running"
    # nothing was remembered: the id is free for the current attempt
    assert succeed(model, now=1_050, attempt=2, callback_id="cb1")[1]["reason"] == "succeeded"
    # without an attempt there is no fencing
    late = model.callback("t1", 1_060, {"type": "progress", "progress": 1, "cursor": "c"})
    assert late[1]["reason"] == "terminal-conflict"


def test_attempt_on_a_start_is_a_bad_request(model: Model) -> None:
    # Only progress, succeed and fail are fenced: a start naming an attempt is refused and changes nothing.
    status, body = start(model, attempt=7)
    assert (status, body["error"]["code"]) == (400, "invalid-request")
    assert model.get("t1")[1]["version"] == 0


def test_terminal_conflict_is_a_200_answer(model: Model) -> None:
    start(model)
    succeed(model)
    status, body = model.callback("t1", 1_040, {"type": "fail", "error": "e", "retryable": False})
    assert (status, body["reason"], body["changed"], body["duplicate"]) == (
        200,
        "terminal-conflict",
        False,
        False,
    )
    status, body = succeed(model, now=20_000)
    assert (status, body["reason"], body["duplicate"]) == (200, "duplicate-result", True)


def test_late_callback_expires_the_task(model: Model) -> None:
    start(model)
    status, body = succeed(model, now=11_000)
    assert (status, body["reason"], body["notify"]) == (200, "expired", True)
    assert model.history("t1")[-1] == {"version": 2, "event": {"type": "expire", "atMs": 11_000}}
    # the notification is at the callback's time (protocol.md, Notifications)
    status, body = start(model, now=11_500)
    assert body["reason"] == "terminal-conflict"
    assert model.drain() == (200, [{"taskId": "t1", "state": "expired", "atMs": 11_000, "version": 2}])
    model.create("t2", 0, 100, 1)
    start(model, "t2", now=250)
    assert model.drain()[1] == [{"taskId": "t2", "state": "expired", "atMs": 250, "version": 1}]
    assert model.history("t2") == [{"version": 1, "event": {"type": "expire", "atMs": 100}}]


# --- cancel (the gateway's own event) ----------------------------------------------------------------


def test_cancel_ends_a_running_task_with_one_entry_and_one_notification(model: Model) -> None:
    start(model)
    model.callback("t1", 1_020, {"type": "progress", "progress": 40, "cursor": "c"})
    status, body = model.cancel("t1", 1_050, {"reason": "wrong export"})
    assert (status, body["changed"], body["duplicate"], body["notify"], body["reason"]) == (
        200,
        True,
        False,
        True,
        "cancelled",
    )
    assert "duplicateCallback" not in body
    assert body["task"] == {
        "id": "t1",
        "state": "failed",
        "expiresAtMs": 11_000,
        "attempts": 1,
        "maxAttempts": 2,
        "progress": 40,
        "version": 3,
        "tags": [],
        "createdAtMs": 1_000,
        "error": "cancelled",
        "metadata": {},
        "revision": 0,
        "worker": "w1",
        "startedAtMs": 1_010,
        "endedAtMs": 1_050,
    }
    assert model.history("t1")[-1] == {
        "version": 3,
        "event": {"type": "cancel", "atMs": 1_050, "reason": "wrong export"},
    }
    assert model.drain()[1] == [{"taskId": "t1", "state": "failed", "atMs": 1_050, "version": 3}]
    # the worker's next callback, and a second cancel: terminal-conflict, nothing more
    assert succeed(model, now=1_060)[1]["reason"] == "terminal-conflict"
    assert model.cancel("t1", 1_070)[1]["reason"] == "terminal-conflict"
    assert model.drain() == (200, [])


def test_cancel_without_a_body_or_reason_and_its_bad_bodies(model: Model) -> None:
    assert model.cancel("t1", 1_010)[1]["reason"] == "cancelled"
    assert model.history("t1") == [{"version": 1, "event": {"type": "cancel", "atMs": 1_010}}]
    bad_bodies: list[object] = [[], "x", {"reason": 5}, {"reason": ""}, {"reason": "x" * 1025}, {"why": "x"}]
    for bad in bad_bodies:
        assert code(model.cancel("t1", 1_020, bad)) == (400, "invalid-request")
    assert code(model.cancel("nope", 1_020, {})) == (404, "unknown-task")
    assert code(model.cancel("nope", 1_020, [])) == (400, "invalid-request")  # the body first


def test_cancel_after_the_deadline_expires_the_task(model: Model) -> None:
    status, body = model.cancel("t1", 11_000, {"reason": "late"})
    assert (status, body["reason"], body["task"]["state"]) == (200, "expired", "expired")
    assert model.history("t1") == [{"version": 1, "event": {"type": "expire", "atMs": 11_000}}]


# --- sweep, drain -------------------------------------------------------------------------------------


def test_sweep_expires_overdue_tasks_at_their_deadline(model: Model) -> None:
    model.create("t0", 0, 500, 1)
    model.create("t2", 0, 50_000, 1)
    model.create("t3", 0, 100, 1)
    start(model, "t3", now=10)
    succeed(model, "t3", now=20)
    assert model.sweep(10_999) == ["t0"]
    assert model.sweep(11_000) == ["t1"]  # >= the deadline
    assert model.sweep(20_000) == []
    assert model.get("t1")[1]["state"] == "expired"
    assert model.get("t2")[1]["state"] == "queued"
    assert model.history("t1") == [{"version": 1, "event": {"type": "expire", "atMs": 11_000}}]
    assert model.drain() == (
        200,
        [
            {"taskId": "t0", "state": "expired", "atMs": 500, "version": 1},
            {"taskId": "t1", "state": "expired", "atMs": 11_000, "version": 1},
            {"taskId": "t3", "state": "succeeded", "atMs": 20, "version": 2},
        ],
    )


def test_drain_returns_each_notification_once(model: Model) -> None:
    model.create("a", 0, TTL, 1)
    start(model, "a", now=5)
    start(model)
    model.callback("a", 6, {"type": "fail", "error": "e", "retryable": True})  # failed: attempts == max
    succeed(model)
    assert model.drain() == (
        200,
        [
            {"taskId": "a", "state": "failed", "atMs": 6, "version": 2},
            {"taskId": "t1", "state": "succeeded", "atMs": 1_030, "version": 2},
        ],
    )
    assert model.drain() == (200, [])
    succeed(model, now=1_040)  # duplicate-result: no second notification
    model.sweep(1_000_000)
    assert model.drain() == (200, [])


def test_drain_orders_task_ids_as_javascript_does() -> None:
    book = Model()
    for task_id in ("\U0001f600", "\uffff", "b"):  # UTF-16: "b" < "\ud83d\ude00" < "\uffff"
        book.create(task_id, 0, 10, 1)
    book.sweep(10)
    assert [n["taskId"] for n in book.drain()[1]] == ["b", "\U0001f600", "\uffff"]


# --- events -------------------------------------------------------------------------------------------


def test_events_modes(model: Model) -> None:
    start(model)
    for p in range(1, 10):
        model.callback("t1", 1_010 + p, {"type": "progress", "progress": p, "cursor": "c"})
    task = model.get("t1")[1]
    assert task["version"] == 10
    assert model.events("t1", 10) == (200, {"mode": "caught-up", "version": 10, "events": [], "task": task})
    status, body = model.events("t1", 7)
    assert (status, body["mode"], [e["version"] for e in body["events"]]) == (200, "delta", [8, 9, 10])
    assert body["events"] == model.history("t1")[7:]
    assert "reason" not in body
    assert [e["version"] for e in model.events("t1", 2)[1]["events"]] == list(range(3, 11))
    assert model.events("t1", 1) == (
        200,
        {"mode": "snapshot", "version": 10, "events": [], "task": task, "reason": "retention"},
    )
    assert model.events("t1", 11)[1]["reason"] == "cursor-ahead"
    assert model.events("t1", 5, retention=2)[1]["mode"] == "snapshot"
    assert code(model.events("t1", -1)) == (400, "invalid-request")
    assert code(model.events("t1", "x")) == (400, "invalid-request")


def test_history_replays_to_the_task(model: Model) -> None:
    start(model)
    model.callback("t1", 1_020, {"type": "fail", "error": "e", "retryable": True})
    start(model, now=1_030)
    model.callback("t1", 1_040, {"type": "progress", "progress": 50.0, "cursor": "c"})
    succeed(model, now=1_050)
    task = create_task(id="t1", now_ms=1_000, ttl_ms=TTL, max_attempts=2)
    for entry in model.history("t1"):
        task = apply_event(task, event_from_json(entry["event"])).task
    assert task.version == 5 and task.state == "succeeded" and task.error == "e"
    assert model.history("t1")[3]["event"]["progress"] == 50


# --- deliveries ---------------------------------------------------------------------------------------


def test_deliveries(model: Model) -> None:
    model.create("t2", 0, TTL, 1)
    assert code(model.deliver("t1", "k1", 2_000)) == (409, "not-succeeded")
    start(model)
    succeed(model)
    receipt = {
        "taskId": "t1",
        "resultRef": "r1",
        "resultHash": "h1",
        "idempotencyKey": "k1",
        "deliveredAtMs": 2_000,
    }
    assert model.deliver("t1", "k1", 2_000) == (
        200,
        {"ok": True, "duplicate": False, "reason": "delivered", "receipt": receipt},
    )
    # the same key: the same receipt, its time unchanged
    assert model.deliver("t1", "k1", 3_000) == (
        200,
        {"ok": True, "duplicate": True, "reason": "duplicate-delivery", "receipt": receipt},
    )
    # another key delivers again, with the same hash
    second = model.deliver("t1", "k2", 3_000)[1]
    assert second["reason"] == "delivered" and second["receipt"]["resultHash"] == "h1"
    # the key checks come before the task's existence (protocol.md, Deliveries)
    assert code(model.deliver("t2", "k1", 3_000)) == (409, "key-reused-for-other-task")
    assert code(model.deliver("nope", "k1", 3_000)) == (409, "key-reused-for-other-task")
    assert code(model.deliver("nope", "k3", 3_000)) == (404, "unknown-task")
    assert model.deliver("t1", "\ufeff", 3_000) == (
        400,
        {"error": {"code": "invalid-request", "message": "idempotencyKey must not be blank"}},
    )


def test_json_equal() -> None:
    assert json_equal({"a": [1, "x"], "b": None}, {"b": None, "a": [1.0, "x"]})
    assert not json_equal({"a": 1}, {"a": True})
    assert not json_equal({"a": 1}, {"a": 1, "b": 2})
    assert not json_equal([1], [1, 1])
    assert not json_equal("1", 1)


# --- the model under random operations ----------------------------------------------------------------

_ids = st.sampled_from(["t1", "t2"])
_events = st.one_of(
    st.builds(lambda w: {"type": "start", "worker": w}, st.sampled_from(["w1", "w2"])),
    st.builds(
        lambda p: {"type": "progress", "progress": p, "cursor": "c"},
        st.one_of(st.integers(-1, 101), st.just(1.5)),
    ),
    st.builds(
        lambda r, h: {"type": "succeed", "resultRef": r, "resultHash": h},
        st.sampled_from(["r", ""]),
        st.sampled_from(["h1", "h2"]),
    ),
    st.builds(lambda r: {"type": "fail", "error": "e", "retryable": r}, st.booleans()),
)
_operations = st.lists(
    st.one_of(
        st.tuples(st.just("create"), _ids, st.integers(1, 3)),
        st.tuples(
            st.just("callback"),
            _ids,
            _events,
            st.one_of(st.none(), st.sampled_from(["cb1", "cb2", "cb3"])),
            st.one_of(st.none(), st.integers(0, 3)),
        ),
        st.tuples(st.just("sweep")),
        st.tuples(st.just("cancel"), _ids, st.sampled_from([None, {}, {"reason": "r"}, {"reason": 1}])),
        st.tuples(st.just("drain")),
        st.tuples(st.just("deliver"), _ids, st.sampled_from(["k1", "k2"])),
        st.tuples(st.just("events"), _ids, st.integers(0, 12)),
    ),
    max_size=40,
)


@settings(max_examples=examples(100), deadline=None)
@given(_operations)
def test_model_invariants_under_random_operations(operations: list[tuple[Any, ...]]) -> None:
    book = Model()
    now = 0
    notified: dict[str, int] = {}
    for op in operations:
        now += 50
        kind = op[0]
        if kind == "create":
            status, _ = book.create(op[1], now, 1_000, op[2])
            assert status in (200, 201, 409)
        elif kind == "callback":
            _, task_id, event, callback_id, attempt = op
            before = book.history(task_id)
            status, body = book.callback(task_id, now, event, callback_id=callback_id, attempt=attempt)
            assert status in (200, 400, 404, 409)
            after = book.history(task_id)
            if status == 200 and body["changed"]:
                assert after[:-1] == before and after[-1]["version"] == len(after)
            else:
                assert after == before
        elif kind == "sweep":
            book.sweep(now)
        elif kind == "cancel":
            before = book.history(op[1])
            status, body = book.cancel(op[1], now, op[2])
            assert status in (200, 400, 404)
            after = book.history(op[1])
            if status == 200 and body["changed"]:
                assert body["task"]["state"] in ("failed", "expired")
                assert after[:-1] == before and after[-1]["version"] == len(after)
            else:
                assert after == before
        elif kind == "drain":
            for n in book.drain()[1]:
                notified[n["taskId"]] = notified.get(n["taskId"], 0) + 1
        elif kind == "deliver":
            status, body = book.deliver(op[1], op[2], now)
            if status == 200:
                assert book.get(body["receipt"]["taskId"])[1]["state"] == "succeeded"
        else:
            status, body = book.events(op[1], op[2])
            if status == 200 and body["mode"] == "delta":
                assert body["events"] == book.history(op[1])[op[2] :]
    for n in book.drain()[1]:
        notified[n["taskId"]] = notified.get(n["taskId"], 0) + 1
    for task_id, task in book.tasks.items():
        assert notified.get(task_id, 0) == (1 if task.terminal else 0)
        replayed = create_task(id=task_id, now_ms=0, ttl_ms=1, max_attempts=task.max_attempts)
        # Its deadline and creation time are the create's, which the history does not replay.
        replayed = replace(replayed, expires_at_ms=task.expires_at_ms, created_at_ms=task.created_at_ms)
        for entry in book.history(task_id):
            replayed = apply_event(replayed, event_from_json(entry["event"])).task
        # What the gateway records of the runs (worker, times) is beside the history, not replayed by it.
        assert replayed == replace(task, worker=None, started_at_ms=None, ended_at_ms=None)
        assert book.get(task_id) == (200, task_to_json(task))
