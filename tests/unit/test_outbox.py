"""The queue integrations' sender, Sans-I/O (``gateway.integrations.outbox``, ``run_protocol``,
``runstate``): runs, cancels and lost runs fed through the core with plain calls, every answer made by hand,
times numbers the test picks. No thread, socket or clock: what the core says to send is a value
(:class:`Request`), what it says to log is a value (:class:`Log`)."""

from __future__ import annotations

import logging
import math
from typing import Any

from gateway.client.errors import TaskCancelled
from gateway.integrations.outbox import MAX_RUNS, Cancel, Lost, Outbox
from gateway.integrations.run_protocol import ASK_S, WAIT_POLL_S, Answer, Done, Request, Send, Wait
from gateway.integrations.runstate import OVER, RETAKE, RUNNING, START, WAIT, RunState
from gateway.integrations.ticket import GatewayConfig, Ticket

CONFIG = GatewayConfig(url="http://gw.example", api_key="key", min_interval_s=0.25)
NOW = 1_000.0  # the monotonic clock, as the test has it
WALL_MS = 1_700_000_000_000.0  # the epoch, ms
TTL_MS = 60_000
LEASE_MS = 3_000


def make_run(
    task_id: str = "t1",
    *,
    token: str | None = "tok",
    lease_ms: int | None = LEASE_MS,
    rerun: bool = False,
    ticket: bool = True,
    config: GatewayConfig = CONFIG,
) -> RunState:
    made = Ticket(token, TTL_MS, 2, lease_ms, ("owner:u42",)) if ticket else None
    return RunState(
        task_id,
        worker="w1",
        ticket=made,
        scheme="celery",
        config=config,
        expires_at_ms=WALL_MS + TTL_MS,
        rerun=rerun,
    )


def task(state: str = "running", attempts: int = 1, **more: Any) -> dict[str, Any]:
    return {"id": "t1", "state": state, "attempts": attempts, "maxAttempts": 2, **more}


def said(reason: str, the_task: dict[str, Any] | None = None, **more: Any) -> Answer:
    """A callback's ``200``: its reason, the task after it."""
    return Answer(200, {"reason": reason, "task": the_task or task(), **more}, NOW)


def refused(status: int, code: str, the_task: dict[str, Any] | None = None) -> Answer:
    body: dict[str, Any] = {"error": {"code": code, "message": f"it is {code}"}}
    if the_task is not None:
        body["task"] = the_task
    return Answer(status, body, NOW)


def sent(box: Outbox, item: Any, now: float = NOW, wall_ms: float = WALL_MS) -> Request:
    decision = box.next(item, now, wall_ms)
    assert isinstance(decision, Send), decision
    return decision.request


def started(box: Outbox, run: RunState, attempt: int = 1, lease_ms: int | None = LEASE_MS) -> None:
    """The run's start, answered: it runs ``attempt``."""
    start = sent(box, run)
    assert start.kind == "start"
    lease = {} if lease_ms is None else {"heartbeatMs": lease_ms, "leaseUntilMs": 1}
    box.answered(run, start, said("started", task(attempts=attempt), **lease), NOW)
    assert (run.phase, run.attempt) == (RUNNING, attempt)


def lines(box: Outbox, level: int = logging.DEBUG) -> list[str]:
    return [log.message % log.args for log in box.take_logs() if log.level >= level]


# --- a run's life -------------------------------------------------------------------------------------------


def test_a_run_starts_then_sends_its_latest_progress_then_its_outcome_with_stable_ids() -> None:
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    start = sent(box, run)
    assert start == Request(
        "start",
        "/v1/tasks/t1/callbacks",
        {"callbackId": run.start_id, "event": {"type": "start", "worker": "w1"}},
        "tok",
    )
    box.answered(run, start, said("started", heartbeatMs=LEASE_MS), NOW)
    assert (run.phase, run.attempt, run.heartbeat_ms, run.renewed_at) == (RUNNING, 1, LEASE_MS, NOW)
    run.latest = (10, "row-10")
    first = sent(box, run)
    assert first.body == {
        "callbackId": "t1:1:p1",
        "attempt": 1,
        "event": {"type": "progress", "progress": 10, "cursor": "row-10"},
    }
    box.answered(run, first, said("progress"), NOW)
    run.latest = (20, "")
    run.latest = (30, "row-30")  # the job went on: only the latest goes, after min_interval_s
    assert box.next(run, NOW + 0.1, WALL_MS) == Wait(NOW + CONFIG.min_interval_s)
    run.outcome = {"type": "succeed", "resultRef": "s3://r", "resultHash": "h"}  # the outcome: at once
    second = sent(box, run, NOW + 0.1)
    assert second.body is not None and second.body["callbackId"] == "t1:1:p2"
    assert second.body["event"]["progress"] == 30
    box.answered(run, second, said("progress"), NOW)
    end = sent(box, run, NOW + 0.1)
    assert end.body == {"callbackId": "t1:1:end", "attempt": 1, "event": run.outcome}
    box.answered(run, end, said("succeeded", task("succeeded")), NOW)
    assert run.phase == OVER
    assert box.next(run, NOW, WALL_MS) == Done() and box.items == []


def test_a_job_that_has_finished_with_nothing_left_to_say_is_done() -> None:
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    started(box, run)
    run.finished = True
    assert isinstance(box.next(run, NOW, WALL_MS), Done)


def test_a_running_run_heartbeats_a_third_of_its_lease_after_it_was_renewed() -> None:
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    started(box, run)
    beat_at = NOW + LEASE_MS / 3000
    assert box.next(run, NOW, WALL_MS) == Wait(beat_at)
    beat = sent(box, run, beat_at)
    assert (beat.kind, beat.path, beat.body) == ("heartbeat", "/v1/tasks/t1/heartbeat", {"attempt": 1})
    box.answered(run, beat, Answer(200, {"leaseUntilMs": 1, "heartbeatMs": LEASE_MS}, beat_at), beat_at)
    assert run.renewed_at == beat_at
    # A heartbeat refused otherwise than by the attempt's end: tried again a beat later, said once.
    beat = sent(box, run, beat_at + 1)
    box.answered(run, beat, refused(401, "unauthorized"), beat_at + 1)
    assert run.renewed_at == beat_at + 1 and run.phase == RUNNING
    assert lines(box, logging.WARNING) == [
        "task-gateway: heartbeat of task t1 refused: 401 unauthorized: it is unauthorized"
    ]


def test_a_run_without_a_lease_asks_whether_it_is_still_wanted_when_its_job_repeats_itself() -> None:
    box, run = Outbox(CONFIG), make_run(lease_ms=None)
    box.add(run)
    started(box, run, lease_ms=None)
    assert box.next(run, NOW, WALL_MS) == Wait(math.inf)  # nothing to say, no lease: until woken
    run.latest = (10, "")
    box.answered(run, sent(box, run), said("progress"), NOW)
    run.latest = (10, "")  # the same again: a heartbeat asks instead of a callback
    assert box.next(run, NOW, WALL_MS) == Wait(NOW + ASK_S)
    ask = sent(box, run, NOW + ASK_S)
    assert ask.kind == "heartbeat" and not run.asked


def test_a_run_without_a_token_creates_its_task_first_with_the_tickets_parameters() -> None:
    box, run = Outbox(CONFIG), make_run(token=None)
    box.add(run)
    create = sent(box, run)
    assert create == Request(
        "create",
        "/v1/tasks",
        {"id": "t1", "ttlMs": TTL_MS, "maxAttempts": 2, "tags": ["owner:u42"], "heartbeatMs": LEASE_MS},
        "key",
    )
    box.answered(run, create, Answer(201, {"callbackToken": "made", "task": task("queued", 0)}, NOW), NOW)
    assert (run.token, run.phase) == ("made", START)


def test_a_run_with_no_ticket_creates_its_task_with_the_configs_parameters() -> None:
    config = GatewayConfig(url="http://gw.example", ttl_ms=5_000, tags=("a",))
    box, run = Outbox(config), make_run(ticket=False, config=config)
    box.add(run)
    create = sent(box, run)
    assert create.body == {"id": "t1", "ttlMs": 5_000, "maxAttempts": 1, "tags": ["a"]}
    assert create.token is None  # open mode: no API key
    box.answered(run, create, refused(409, "task-exists"), NOW)
    assert run.phase == OVER
    assert lines(box, logging.WARNING) == [
        "task-gateway: could not create task t1: 409 task-exists: it is task-exists"
    ]


def test_a_start_that_is_refused_or_finds_the_task_ended_reports_nothing_more() -> None:
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    box.answered(run, sent(box, run), Answer(403, {}, NOW), NOW)  # not the gateway's JSON (a proxy's page)
    assert run.phase == OVER
    assert lines(box) == ["task-gateway: could not start task t1: HTTP 403"]
    run = make_run()
    box.add(run)
    box.answered(run, sent(box, run), said("not-startable", task("failed", 2, error="boom")), NOW)
    assert run.phase == OVER
    assert lines(box) == [
        "task-gateway: task t1: start answered not-startable (the task is failed); this run reports nothing "
        "more"
    ]
    run = make_run()
    box.add(run)
    cancelled = task("failed", 1, error="cancelled")
    box.answered(run, sent(box, run), said("terminal-conflict", cancelled), NOW)
    assert isinstance(run.cancelled, TaskCancelled) and lines(box) == []


def test_a_start_whose_first_answer_was_lost_takes_the_attempt_it_began() -> None:
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    box.answered(run, sent(box, run), said("duplicate-callback", task(attempts=3)), NOW)
    assert (run.phase, run.attempt) == (RUNNING, 3)


def test_a_start_answered_already_running_waits_for_the_lease_or_takes_over_a_task_without_one() -> None:
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    box.answered(run, sent(box, run), said("already-running", heartbeatMs=LEASE_MS), NOW)
    assert (run.phase, run.running_attempt) == (WAIT, 1)
    assert lines(box) == ["task-gateway: task t1 is still running attempt 1; waiting for its lease"]
    box, run = Outbox(CONFIG), make_run(lease_ms=None)
    box.add(run)
    box.answered(run, sent(box, run), said("already-running"), NOW)
    assert (run.phase, run.attempt) == (RUNNING, 1) and run.nonce is not None
    assert run.callback_ids() == f"t1:1:{run.nonce}"
    assert "taking that attempt over" in lines(box, logging.WARNING)[0]


def test_a_rerun_reads_its_task_and_waits_out_the_lease_of_the_run_before_it() -> None:
    box, run = Outbox(CONFIG), make_run(rerun=True)
    assert run.phase == WAIT
    box.add(run)
    read = sent(box, run)
    assert read == Request("read", "/v1/tasks/t1", None, "key")
    box.answered(run, read, Answer(200, task("running", 1), NOW), NOW)
    assert run.running_attempt == 1 and "begun by an earlier run" in lines(box)[0]
    assert box.next(run, NOW, WALL_MS) == Wait(NOW + WAIT_POLL_S)
    read = sent(box, run, NOW + WAIT_POLL_S)
    box.answered(run, read, Answer(200, task("running", 1), NOW), NOW + WAIT_POLL_S)
    assert lines(box) == []  # said once
    first_id = run.start_id
    box.answered(run, sent(box, run, NOW + 1), Answer(200, task("queued", 1), NOW), NOW + 1)
    assert run.phase == START and run.start_id != first_id  # a start of its own
    box, run = Outbox(CONFIG), make_run(rerun=True)
    box.add(run)
    box.answered(run, sent(box, run), Answer(200, task("succeeded", 1), NOW), NOW)
    assert run.phase == OVER and "answered terminal-conflict (the task is succeeded)" in lines(box)[0]


def test_a_rerun_that_cannot_read_its_task_starts_or_takes_the_attempt_over() -> None:
    box, run = Outbox(CONFIG), make_run(rerun=True)
    box.add(run)
    box.answered(run, sent(box, run), refused(401, "unauthorized"), NOW)
    assert run.phase == START and "starting it" in lines(box)[0]
    box, run = Outbox(CONFIG), make_run(rerun=True)
    box.add(run)
    run.running_attempt = 2  # a start answered already-running told it
    box.answered(run, sent(box, run), refused(401, "unauthorized"), NOW)
    assert (run.phase, run.attempt) == (RUNNING, 2) and run.nonce is not None
    assert "taking attempt 2 over" in lines(box)[0]


def test_a_first_run_without_a_lease_never_reads_first() -> None:
    assert make_run(rerun=True, lease_ms=None).phase == START
    assert make_run(rerun=False).phase == START
    assert make_run(token=None, rerun=True).first_phase(LEASE_MS) == WAIT


def test_a_run_waits_for_the_runs_of_its_task_before_it_in_this_process() -> None:
    box, first, second, other = Outbox(CONFIG), make_run(), make_run(), make_run("t2")
    for run in (first, second, other):
        box.add(run)
    assert box.next(second, NOW, WALL_MS) == Wait(NOW + WAIT_POLL_S)
    assert sent(box, other).kind == "start"  # another task's run does not wait
    first.handed = True  # given to another process: this one sends nothing more of it
    assert sent(box, second).kind == "start"
    assert box.next(first, NOW, WALL_MS) == Done()


def test_a_callback_refused_is_said_and_the_run_goes_on() -> None:
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    started(box, run)
    run.latest = (10, "")
    box.answered(run, sent(box, run), refused(400, "invalid-request"), NOW)
    assert run.phase == RUNNING and run.inflight is None
    assert lines(box) == [
        "task-gateway: progress callback of task t1 refused: 400 invalid-request: it is invalid-request"
    ]


# --- a job that outlives its lease --------------------------------------------------------------------------


def test_a_run_whose_lease_ran_out_while_it_ran_takes_its_task_back_and_says_it_all_as_the_next_attempt() -> (
    None
):
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    started(box, run)
    run.latest = (50, "row-50")
    box.answered(run, sent(box, run), said("progress"), NOW)
    run.latest = (70, "row-70")
    run.outcome = {"type": "succeed", "resultRef": "s3://r", "resultHash": "h"}
    progress = sent(box, run)
    requeued = task("queued", 1, error="heartbeat-timeout")
    box.answered(run, progress, said("not-running", requeued), NOW)  # the gateway was away past the lease
    assert run.phase == RETAKE
    start = sent(box, run)
    assert start.kind == "start" and start.body is not None
    assert start.body["callbackId"] == run.start_id
    box.answered(run, start, said("started", task("running", 2), heartbeatMs=LEASE_MS), NOW)
    assert (run.phase, run.attempt) == (RUNNING, 2)
    assert lines(box, logging.WARNING) == [
        "task-gateway: task t1: the lease of attempt 1 ran out while this run still ran (the gateway "
        "requeued the task); took the task back as attempt 2"
    ]
    again = sent(box, run)  # the progress it had reached (its latest, here), then the outcome
    assert again.body is not None and (again.body["callbackId"], again.body["attempt"]) == ("t1:2:p1", 2)
    assert again.body["event"]["progress"] == 70
    box.answered(run, again, said("progress", task("running", 2)), NOW)
    end = sent(box, run)
    assert end.body is not None and (end.body["callbackId"], end.body["event"]) == ("t1:2:end", run.outcome)


def test_a_progress_the_job_reported_while_its_attempt_was_ending_goes_as_the_next_attempt() -> None:
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    started(box, run)
    run.latest = (50, "")
    progress = sent(box, run)
    run.latest = (80, "")  # while the 50 was on its way
    box.answered(run, progress, said("not-running", task("queued", 1, error="heartbeat-timeout")), NOW)
    box.answered(run, sent(box, run), said("started", task("running", 2)), NOW)
    again = sent(box, run, NOW + 1)
    assert again.body is not None and again.body["event"]["progress"] == 80


def test_a_run_told_by_its_heartbeat_takes_the_task_back_with_the_progress_it_had_reached() -> None:
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    started(box, run)
    run.latest = (40, "row-40")
    box.answered(run, sent(box, run), said("progress"), NOW)
    beat = sent(box, run, NOW + 10)
    box.answered(
        run, beat, refused(409, "not-running", task("queued", 1, error="heartbeat-timeout")), NOW + 10
    )
    box.answered(run, sent(box, run, NOW + 10), said("started", task("running", 2)), NOW + 10)
    again = sent(box, run, NOW + 10)
    assert again.body is not None and again.body["event"]["progress"] == 40  # a start set it back to 0


def test_a_run_whose_task_went_on_without_it_says_at_error_what_is_lost() -> None:
    box = Outbox(CONFIG)
    for answer, why, lost in [
        # The lease ended the last attempt.
        (
            said("terminal-conflict", task("failed", 2, error="heartbeat-timeout")),
            "its lease ran out on attempt 2 of 2: no attempt left, the task failed",
            "its result s3://r",
        ),
        # Another run began the next attempt meanwhile.
        (refused(409, "stale-attempt"), "another attempt has started since", "its result s3://r"),
        (said("expired", task("expired", 2)), "the task is expired", "its result s3://r"),
    ]:
        run = make_run()
        box.add(run)
        started(box, run, attempt=2)
        run.outcome = {"type": "succeed", "resultRef": "s3://r", "resultHash": "h"}
        box.answered(run, sent(box, run), answer, NOW)
        assert run.phase == OVER
        assert lines(box) == [f"task-gateway: task t1 went on without this run ({why}); lost: {lost}"]
        run.outcome = None
    run = make_run()
    box.add(run)
    started(box, run)
    beat = sent(box, run, NOW + 10)
    box.answered(run, beat, refused(409, "not-running", task("queued", 1, error="operator")), NOW)
    assert lines(box, logging.ERROR) == [
        "task-gateway: task t1 went on without this run (attempt 1 was ended by a fail: operator); lost: its "
        "progress and its outcome, once the job ends"
    ]


def test_a_take_back_that_another_run_beat_or_a_cancel_stopped_says_so() -> None:
    box = Outbox(CONFIG)
    for answer, error in [
        (said("already-running", task("running", 2)), "(attempt 2 has started since)"),
        (
            refused(401, "unauthorized"),
            "(it could not be started again: 401 unauthorized: it is unauthorized)",
        ),
        (said("expired", task("queued", 1, error="heartbeat-timeout")), "(its start was answered expired)"),
    ]:
        run = make_run()
        box.add(run)
        started(box, run)
        run.latest = (30, "")
        box.answered(
            run, sent(box, run), said("not-running", task("queued", 1, error="heartbeat-timeout")), NOW
        )
        box.answered(run, sent(box, run), answer, NOW)
        assert run.phase == OVER
        (line,) = lines(box, logging.ERROR)
        assert error in line and "its progress (30%) and its outcome" in line, line
    run = make_run()
    box.add(run)
    started(box, run)
    run.retake()
    box.answered(run, sent(box, run), said("terminal-conflict", task("failed", 1, error="cancelled")), NOW)
    assert isinstance(run.cancelled, TaskCancelled) and run.phase == OVER


def test_a_cancel_learned_by_a_callback_or_a_heartbeat_raises_in_the_job_and_nothing_is_logged() -> None:
    box = Outbox(CONFIG)
    cancelled = task("failed", 1, error="cancelled")
    for kind, answer in [
        ("progress", said("terminal-conflict", cancelled)),
        ("heartbeat", refused(409, "not-running", cancelled)),
    ]:
        run = make_run()
        box.add(run)
        started(box, run)
        if kind == "progress":
            run.latest = (10, "")
        request = sent(box, run, NOW + 10)
        assert request.kind == ("callback" if kind == "progress" else "heartbeat")
        box.answered(run, request, answer, NOW)
        assert isinstance(run.cancelled, TaskCancelled) and run.cancelled.event_type == kind
        assert run.phase == OVER and lines(box) == []


# --- retries, deadlines, reachability -----------------------------------------------------------------------


def test_an_unanswered_request_is_tried_again_with_backoff_and_said_once() -> None:
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    start = sent(box, run)
    box.unanswered(run, start, "ConnectError: refused", NOW)
    assert run.unreachable and NOW < run.retry_at <= NOW + 0.05
    assert lines(box, logging.WARNING) == [
        "task-gateway: cannot reach http://gw.example (ConnectError: refused); 1 reports wait and are "
        "retried until their task's deadline"
    ]
    assert box.next(run, NOW, WALL_MS) == Wait(run.retry_at)
    again = sent(box, run, run.retry_at)
    assert again == start  # the same request: the same start id
    box.answered(run, again, said("started"), NOW + 2)
    assert lines(box) == [
        "task-gateway: reached http://gw.example again after 2.0 s; sending the reports that waited"
    ]
    run.latest = (10, "")
    progress = sent(box, run, NOW + 3)
    box.unanswered(run, progress, "ReadTimeout", NOW + 3)
    assert sent(box, run, run.retry_at) == progress  # a callback's retry: the same id and body


def test_a_5xx_is_tried_again_and_said_once_until_the_gateway_answers() -> None:
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    start = sent(box, run)
    box.unanswered(run, start, "ConnectError: refused", NOW)
    box.take_logs()
    again = sent(box, run, run.retry_at)
    box.answered(run, again, Answer(503, {}, NOW), NOW + 1)
    assert lines(box, logging.WARNING) == []  # said once until the gateway answers
    box.answered(run, sent(box, run, run.retry_at), said("started"), NOW + 5)
    assert lines(box, logging.INFO) == [
        "task-gateway: reached http://gw.example again after 5.0 s; sending the reports that waited"
    ]
    assert (run.unreachable, run.failures) == (False, 0)


def test_a_429_is_tried_again_no_sooner_than_its_retry_after() -> None:
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    start = sent(box, run)
    box.answered(run, start, Answer(429, {}, NOW, retry_after="3"), NOW)
    assert run.retry_at >= NOW + 3 and run.phase == START
    assert lines(box, logging.WARNING) == []  # the gateway answered: it can be reached


def test_past_its_tasks_deadline_a_run_drops_what_it_has_not_sent() -> None:
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    run.latest = (10, "")
    assert box.next(run, NOW, run.expires_at_ms) == Done()
    assert lines(box) == ["task-gateway: task t1 passed its deadline; dropping its unsent reports"]
    run = make_run()
    box.add(run)
    started(box, run)
    box.answered(
        run, sent(box, run, NOW + 10), said("progress", task(expiresAtMs=5)), NOW
    )  # the gateway's word
    assert run.expires_at_ms == 5
    run.finished = True
    assert box.next(run, NOW, 5) == Done() and lines(box) == []  # nothing was left


def test_past_the_limit_the_oldest_items_are_dropped() -> None:
    box = Outbox(CONFIG)
    first = make_run("first")
    box.add(first)
    for n in range(MAX_RUNS):
        box.add(Cancel(f"c{n}", None, WALL_MS))
    assert first.phase == OVER and len(box.items) == MAX_RUNS
    assert lines(box) == [
        f"task-gateway: more than {MAX_RUNS} runs and cancels wait; dropping what first has not sent"
    ]
    box.add(Lost("l", "tok", "boom", WALL_MS))  # a cancel dropped: nothing to undo
    assert box.unsent() == MAX_RUNS


def test_what_waits_counts_a_runs_start_its_callback_its_latest_and_its_outcome() -> None:
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    box.add(Cancel("t1", None, WALL_MS))
    run.latest = (10, "")
    run.outcome = {"type": "fail", "error": "x", "retryable": False}
    assert box.unsent() == 4
    run.handed = True
    assert box.unsent() == 1


# --- cancels and lost runs ----------------------------------------------------------------------------------


def test_a_cancel_goes_after_its_runs_start_and_reported_progress_until_answered() -> None:
    box, run = Outbox(CONFIG), make_run()
    cancel = Cancel("t1", "revoked", WALL_MS + TTL_MS, after=run)
    box.add(run)
    box.add(cancel)
    assert box.next(cancel, NOW, WALL_MS) == Wait(NOW + WAIT_POLL_S)  # the run has not started
    started(box, run)
    run.latest = (10, "")
    assert box.next(cancel, NOW, WALL_MS) == Wait(NOW + WAIT_POLL_S)  # its progress goes first
    box.answered(run, sent(box, run), said("progress"), NOW)
    request = sent(box, cancel)
    assert request == Request("cancel", "/v1/tasks/t1/cancel", {"reason": "revoked"}, "key")
    box.unanswered(cancel, request, "ReadTimeout", NOW)
    assert box.next(cancel, NOW, WALL_MS) == Wait(cancel.retry_at)
    assert "cannot reach" in lines(box)[0]
    box.answered(cancel, request, refused(404, "unknown-task"), NOW)
    assert lines(box, logging.WARNING) == [
        "task-gateway: could not cancel task t1: 404 unknown-task: it is unknown-task"
    ]
    assert box.next(cancel, NOW, WALL_MS) == Done() and cancel not in box.items
    assert box.next(cancel, NOW, WALL_MS) == Done()  # forgotten already: nothing more


def test_a_cancel_without_a_reason_sends_none_and_gives_up_at_the_deadline() -> None:
    box, cancel = Outbox(CONFIG), Cancel("t/1", None, WALL_MS)
    box.add(cancel)
    request = sent(box, cancel, wall_ms=WALL_MS - 1)
    assert (request.path, request.body) == ("/v1/tasks/t%2F1/cancel", {})
    box.answered(cancel, request, said("cancelled"), NOW)
    assert box.next(cancel, NOW, WALL_MS) == Done() and lines(box, logging.WARNING) == []
    cancel = Cancel("t1", None, WALL_MS)
    box.add(cancel)
    assert box.next(cancel, NOW, WALL_MS) == Done()
    assert lines(box) == ["task-gateway: could not cancel task t1 before its deadline"]


def test_a_lost_runs_final_fail_is_sent_unfenced_and_a_requeued_task_is_cancelled_instead() -> None:
    box, lost = Outbox(CONFIG), Lost("t1", "tok", "TimeLimitExceeded", WALL_MS + 1)
    box.add(lost)
    request = sent(box, lost)
    assert request == Request(
        "lost",
        "/v1/tasks/t1/callbacks",
        {
            "callbackId": "t1:lost",
            "event": {"type": "fail", "error": "TimeLimitExceeded", "retryable": False},
        },
        "tok",
    )
    box.unanswered(lost, request, "ConnectError", NOW)
    assert box.next(lost, NOW, WALL_MS) == Wait(lost.retry_at)
    assert "cannot reach" in lines(box)[0]
    box.answered(lost, request, said("not-running", task("queued")), NOW)
    assert box.next(lost, NOW, WALL_MS) == Done()
    (cancel,) = box.items
    assert isinstance(cancel, Cancel) and cancel.reason == "its run was lost: TimeLimitExceeded"
    lost = Lost("t2", "tok", "x", WALL_MS + 1)
    box.add(lost)
    box.answered(lost, sent(box, lost), refused(401, "unauthorized"), NOW)
    assert "could not fail task t2, whose run was lost" in lines(box, logging.WARNING)[0]
    lost = Lost("t3", "tok", "x", WALL_MS + 1)
    box.add(lost)
    box.answered(lost, sent(box, lost), said("failed", task("failed")), NOW)
    assert box.next(lost, NOW, WALL_MS) == Done() and lines(box) == []
    late = Lost("t4", "tok", "x", WALL_MS)
    box.add(late)
    assert box.next(late, NOW, WALL_MS) == Done()
    assert lines(box) == ["task-gateway: could not fail task t4, whose run was lost, before its deadline"]


# --- a run's record -----------------------------------------------------------------------------------------


def test_a_runs_record_goes_to_another_process_and_on_from_where_it_was() -> None:
    run = make_run()
    assert repr(run) == "<Run t1 attempt None start>"
    assert run.pending() is not None and run.handed  # its start, not sent yet

    class Watched(RunState):
        unblocked = False

        def unblock(self) -> None:
            self.unblocked = True

    for phase, unblocked in [(RUNNING, True), (RETAKE, True), (START, False)]:
        other = Watched("t1", worker="w", ticket=None, scheme="rq", config=CONFIG, expires_at_ms=0)
        other.resume({"phase": phase, "startId": "s", "expiresAtMs": 1, "latest": [5, "c"]})
        assert (other.phase, other.latest, other.finished) == (phase, (5, "c"), True)
        assert other.unblocked == unblocked  # a started run's job need not wait for its start
    run = make_run()
    run.begin(1)
    assert run.pending() is None  # running, nothing to say
    run = make_run()
    run.over()
    assert run.pending() is None
    run = make_run()
    run.begin(1)
    run.outcome = {"type": "fail", "error": "x", "retryable": True}
    assert run.take(NOW) == ("t1:1:end", run.outcome)
    run.inflight = None  # answered
    assert run.pending() is None and run.take(NOW) is None
    assert not run.reporting()
