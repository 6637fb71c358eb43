"""What a queue job writes to its task's streams, through the integrations' sender core (``runstate``,
``run_protocol``, ``outbox``) with plain calls: appends after the start, 50 ms after the oldest write, all
of them before the outcome, the same batch again after a lost answer, and what each answer means for the
run (renewed, over, taken back, refused)."""

from __future__ import annotations

import json
import logging

from gateway.client.errors import AttemptOver
from gateway.client.stream_out import FLUSH_S, Batch
from gateway.integrations.outbox import Outbox
from gateway.integrations.run_protocol import Answer, Request, Wait
from gateway.integrations.runstate import OVER, RETAKE, RUNNING, STREAM_LIMIT_BYTES, RunState
from tests.unit.test_outbox import (
    CONFIG,
    LEASE_MS,
    NOW,
    WALL_MS,
    lines,
    make_run,
    refused,
    said,
    sent,
    started,
    task,
)


def appended(offset: int, count: int, *, duplicate: bool = False, **more: object) -> Answer:
    body = {"stream": "output", "attempt": 1, "offset": offset, "nextOffset": offset + count}
    return Answer(200, {**body, "duplicate": duplicate, **more}, NOW)


def running(lease_ms: int | None = LEASE_MS) -> tuple[Outbox, RunState]:
    box, run = Outbox(CONFIG), make_run(lease_ms=lease_ms)
    box.add(run)
    started(box, run, lease_ms=lease_ms)
    return box, run


def test_writes_go_as_one_append_50_ms_after_the_oldest_and_before_the_outcome() -> None:
    box, run = running()
    assert run.write_kept("output", "Hello", NOW) and run.write_kept("output", ", world", NOW + 0.01)
    assert box.next(run, NOW + 0.02, WALL_MS) == Wait(NOW + FLUSH_S)
    append = sent(box, run, NOW + FLUSH_S)
    assert append == Request(
        "append",
        "/v1/tasks/t1/streams/output",
        {"attempt": 1, "seq": 0, "chunks": ["Hello", ", world"]},
        "tok",
    )
    assert run.unsent() == 1 and "2 chunks of its streams' text" in run.unreported()
    box.answered(run, append, appended(0, 2, heartbeatMs=LEASE_MS, leaseUntilMs=1), NOW + 0.1)
    assert run.renewed_at == NOW  # the append's answer renewed the lease, from when it was sent
    # The outcome waits for what was written before it, which goes at once.
    run.write_kept("output", "!", NOW + 0.2)
    run.outcome = {"type": "succeed", "resultRef": "s3://r", "resultHash": "h"}
    last = sent(box, run, NOW + 0.2)
    assert (last.kind, last.body) == ("append", {"attempt": 1, "seq": 1, "chunks": ["!"]})
    box.answered(run, last, appended(2, 1), NOW)
    end = sent(box, run, NOW + 0.2)
    assert end.kind == "callback" and end.body is not None and end.body["event"] == run.outcome
    box.answered(run, end, said("succeeded", task("succeeded")), NOW)
    assert run.phase == OVER and not run.write_kept("output", "late", NOW)


def test_a_finished_job_sends_what_it_wrote_at_once_and_a_lost_answer_sends_the_same_batch() -> None:
    box, run = running(lease_ms=None)
    run.write_kept("log", "line 1\n", NOW)
    run.finished = True
    append = sent(box, run, NOW)  # finished: no 50 ms wait
    box.unanswered(run, append, "ReadTimeout", NOW)
    assert sent(box, run, run.retry_at) == append  # the same seq, the same chunks
    box.answered(run, append, appended(0, 1, duplicate=True), NOW)  # a duplicate answer is success
    assert run.idle() and run.written()
    assert "cannot reach" in lines(box, logging.WARNING)[0]


def test_an_append_answered_that_the_attempt_is_over_cancels_takes_back_or_says_what_is_lost() -> None:
    # Cancelled: the job's next write raises.
    box, run = running()
    run.write_kept("output", "a", NOW)
    cancelled = task("failed", error="cancelled")
    box.answered(run, sent(box, run, NOW + 1), refused(409, "not-running", cancelled), NOW)
    assert run.cancelled is not None and run.phase == OVER

    # Its lease ran out while it ran: taken back, the batch goes again as the new attempt's first.
    box, run = running()
    run.write_kept("output", "a", NOW)
    requeued = task("queued", error="heartbeat-timeout")
    box.answered(run, sent(box, run, NOW + 1), refused(409, "not-running", requeued), NOW)
    assert run.phase == RETAKE
    start = sent(box, run, NOW + 1)
    box.answered(run, start, said("started", task(attempts=2)), NOW)
    again = sent(box, run, NOW + 1)
    assert again.body == {"attempt": 2, "seq": 0, "chunks": ["a"]}

    # Another attempt has started: said at ERROR, with the text lost; the job's next write raises.
    box, run = running()
    run.write_kept("output", "a", NOW)
    box.answered(run, sent(box, run, NOW + 1), refused(409, "stale-attempt"), NOW)
    assert run.phase == OVER and isinstance(run.gone, AttemptOver)
    (error,) = lines(box, logging.ERROR)
    assert "went on without this run" in error and "1 chunks of its streams' text" in error


def test_a_refused_stream_is_said_once_and_dropped_and_a_gap_takes_the_expected_seq() -> None:
    box, run = running()
    run.write_kept("output", "a", NOW)
    first = sent(box, run, NOW + 1)
    gap = Answer(409, {"error": {"code": "seq-gap", "message": "m"}, "expectedSeq": 0}, NOW)
    run.streams["output"].inflight = Batch("output", 1, 3, ("a",))  # as if numbered past a missing one
    box.answered(run, first, gap, NOW)
    assert sent(box, run, NOW + 1).body == {"attempt": 1, "seq": 0, "chunks": ["a"]}
    full = refused(413, "stream-full")
    box.answered(run, first, full, NOW)
    (warning,) = lines(box, logging.WARNING)
    assert "stream output of task t1 refused: 413 stream-full" in warning
    assert not run.write_kept("output", "more", NOW) and run.written()
    assert run.write_kept("log", "other streams go on", NOW)


def test_a_runs_unsent_text_is_bounded_and_goes_to_another_process_with_its_numbers() -> None:
    box, run = running()
    assert run.write_kept("output", "x" * STREAM_LIMIT_BYTES, NOW)
    assert not run.write_kept("output", "y", NOW)  # 16 MiB wait: dropped, the job never waits
    box, run = running()
    run.write_kept("output", "a", NOW)
    first = sent(box, run, NOW + 1)
    box.answered(run, first, appended(0, 1), NOW)
    run.write_kept("output", "b", NOW + 1)
    run.finished = True
    pending = json.loads(json.dumps(run.pending()))
    assert box.next(run, NOW + 2, WALL_MS).__class__.__name__ == "Done"  # handed: sends nothing more
    there = make_run()
    there.resume(pending)
    assert (there.phase, there.attempt) == (RUNNING, 1)
    assert there.take_append(NOW) is not None
    box2 = Outbox(CONFIG)
    box2.add(there)
    assert sent(box2, there, NOW).body == {"attempt": 1, "seq": 1, "chunks": ["b"]}
    # A run with nothing left of its text hands nothing over.
    box3, idle = running()
    idle.write_kept("output", "c", NOW)
    box3.answered(idle, sent(box3, idle, NOW + 1), appended(0, 1), NOW)
    assert idle.pending() is None


def test_each_stream_goes_when_its_own_buffer_is_due() -> None:
    box, run = running(lease_ms=None)
    run.write_kept("output", "a", NOW)
    box.answered(run, sent(box, run, NOW + FLUSH_S), appended(0, 1), NOW)
    run.write_kept("log", "b", NOW + 1)  # "output" has nothing left: "log" alone is waited for
    assert box.next(run, NOW + 1, WALL_MS) == Wait(NOW + 1 + FLUSH_S)
    assert sent(box, run, NOW + 1 + FLUSH_S).path == "/v1/tasks/t1/streams/log"
