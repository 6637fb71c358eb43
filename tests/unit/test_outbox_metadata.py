"""What a queue job merges into its task's metadata (``Run.metadata``, ``message``), through the
integrations' sender core (``runstate``, ``run_protocol``, ``outbox``) with plain calls: patches as the
run's attempt, after the progress the job reported before them and before the outcome, those waiting sent as
one, the same again after a lost answer, and what each answer means (taken, refused, over, taken back)."""

from __future__ import annotations

import logging

from gateway.integrations.outbox import Outbox
from gateway.integrations.run_protocol import Answer, Request, Wait
from gateway.integrations.runstate import OVER, RETAKE, RunState
from gateway.integrations.ticket import Ticket
from tests.unit.test_outbox import (
    CONFIG,
    NOW,
    TTL_MS,
    WALL_MS,
    lines,
    make_run,
    refused,
    said,
    sent,
    started,
    task,
)


def running() -> tuple[Outbox, RunState]:
    box, run = Outbox(CONFIG), make_run()
    box.add(run)
    started(box, run)
    return box, run


def patched(**more: object) -> Answer:
    return Answer(200, {"task": task(metadata={"rows": 3}, revision=1), **more}, NOW)


def test_a_patch_goes_as_the_runs_attempt_and_patches_waiting_meanwhile_go_as_one() -> None:
    box, run = running()
    assert run.metadata_kept({"message": "Reading rows"})
    first = sent(box, run)
    assert first == Request(
        "metadata", "/v1/tasks/t1/metadata", {"attempt": 1, "patch": {"message": "Reading rows"}}, "tok"
    )
    for n in range(1, 4):  # while the first is on its way: one patch of the three
        run.metadata_kept({"rows": n, "message": f"Row {n}"})
    assert run.unsent() == 2 and "2 metadata patches" in run.unreported()
    box.unanswered(run, first, "ReadTimeout", NOW)
    assert sent(box, run, run.retry_at) == first  # the same patch again after a lost answer
    box.answered(run, first, patched(heartbeatMs=3000), NOW + 1)
    assert run.renewed_at == NOW  # its answer renewed the lease, from when it was sent
    second = sent(box, run, NOW + 1)
    assert second.body == {"attempt": 1, "patch": {"rows": 3, "message": "Row 3"}}
    box.answered(run, second, patched(), NOW + 1)
    assert run.written() and run.unsent() == 0


def test_a_patch_goes_after_the_progress_reported_before_it_and_the_outcome_after_both() -> None:
    box, run = running()
    run.latest = (10, "")
    box.answered(run, sent(box, run), said("progress"), NOW)  # p1 at NOW: the next waits min_interval
    run.latest = (20, "")
    assert run.reporting()
    run.metadata_kept({"current": 2})  # made after progress 20, which waits
    assert run.unsent() == 2
    # The patch waits for progress 20's turn.
    assert box.next(run, NOW + 0.1, WALL_MS) == Wait(NOW + CONFIG.min_interval_s)
    progress = sent(box, run, NOW + CONFIG.min_interval_s)
    assert progress.kind == "callback" and progress.body is not None
    assert progress.body["event"]["progress"] == 20
    run.metadata_kept({"current": 3})  # made while progress 20 is on its way: after it too
    run.outcome = {"type": "succeed", "resultRef": "s3://r", "resultHash": "h"}
    box.answered(run, progress, said("progress"), NOW)
    patch = sent(box, run, NOW + 1)
    assert (patch.kind, patch.body) == ("metadata", {"attempt": 1, "patch": {"current": 3}})
    box.answered(run, patch, patched(), NOW + 1)
    end = sent(box, run, NOW + 1)
    assert end.body is not None and end.body["event"] == run.outcome
    assert not run.metadata_kept({"late": True})  # the outcome is taken: nothing more goes
    box.answered(run, end, said("succeeded", task("succeeded")), NOW)
    assert run.phase == OVER and not run.metadata_kept({"late": True})


def test_a_patch_the_gateway_refuses_is_dropped_and_said() -> None:
    box, run = running()
    run.metadata_kept({"blob": "x" * 100, "a": None})
    run.metadata_kept({"a": {"b": 1}})  # not one patch with the one before: after it
    first = sent(box, run)
    assert first.body == {"attempt": 1, "patch": {"blob": "x" * 100, "a": None}}
    box.answered(run, first, refused(413, "metadata-too-large"), NOW)
    warned = lines(box, logging.WARNING)
    assert warned == [
        "task-gateway: metadata patch of task t1 refused: 413 metadata-too-large: it is metadata-too-large; "
        "the patch is dropped"
    ]
    assert sent(box, run).body == {"attempt": 1, "patch": {"a": {"b": 1}}}


def test_a_patch_answered_that_the_attempt_is_over_takes_the_task_back_and_goes_as_the_new_one() -> None:
    box, run = running()
    run.metadata_kept({"rows": 1})
    first = sent(box, run)
    # The lease ran out while the job ran: requeued at its attempt, which nobody else started.
    requeued = task("queued", attempts=1, error="heartbeat-timeout")
    box.answered(run, first, refused(409, "not-running", requeued), NOW)
    assert run.phase == RETAKE and run.unsent() == 2  # the start, then the patch again
    start = sent(box, run)
    assert start.kind == "start"
    box.answered(run, start, said("started", task(attempts=2)), NOW)
    again = sent(box, run)
    assert again.body == {"attempt": 2, "patch": {"rows": 1}}


def test_a_patch_of_a_cancelled_task_ends_the_run_and_what_waited_is_said_lost() -> None:
    box, run = running()
    run.metadata_kept({"a": None})
    run.metadata_kept({"a": {"b": 1}})
    assert "2 metadata patches" in run.unreported()
    first = sent(box, run)
    box.answered(run, first, refused(409, "stale-attempt"), NOW)  # no task: another attempt has started
    assert run.phase == OVER and run.gone is not None
    assert "2 metadata patches" in lines(box, logging.ERROR)[0]
    cancelled = make_run()
    box.add(cancelled)
    started(box, cancelled)
    cancelled.metadata_kept({"rows": 1})
    patch = sent(box, cancelled)
    box.answered(cancelled, patch, refused(409, "not-running", task("failed", error="cancelled")), NOW)
    assert cancelled.cancelled is not None and cancelled.phase == OVER


def test_waiting_patches_go_with_a_run_handed_to_another_process_in_their_order() -> None:
    _, run = running()
    run.metadata_kept({"a": None})
    run.metadata_kept({"a": {"b": 1}})
    run.finished = True
    pending = run.pending()
    assert pending is not None and pending["patches"] == [{"a": None}, {"a": {"b": 1}}]
    assert not run.metadata_kept({"late": 1})  # handed: this process sends nothing more of it
    other = make_run()
    other.resume(pending)
    assert other.take_patch() == {"a": None}


def test_a_worker_that_creates_the_task_makes_it_as_the_producer_asked() -> None:
    ticket = Ticket(None, TTL_MS, 1, None, ("owner:u42",), "export_report(42)", {"n": 1}, "batch-1", True)
    run = RunState(
        "t1", worker="w1", ticket=ticket, scheme="celery", config=CONFIG, expires_at_ms=WALL_MS + TTL_MS
    )
    box = Outbox(CONFIG)
    box.add(run)
    create = sent(box, run)
    assert create.body == {
        "id": "t1",
        "ttlMs": TTL_MS,
        "maxAttempts": 1,
        "tags": ["owner:u42"],
        "title": "export_report(42)",
        "metadata": {"n": 1},
        "parent": "batch-1",
        "progressFromChildren": True,
    }
