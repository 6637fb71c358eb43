"""A run handed from one process to another (an RQ work horse to its worker), with no gateway: what
``Run.pending()`` gives, as JSON, is what ``Run.resume()`` sends on, in the same order and with the same
callback ids; the run handed over sends nothing more here; a run with nothing left hands nothing; a handover
past the task's deadline is dropped."""

from __future__ import annotations

import json
import time

from gateway.integrations.report import Reporter
from gateway.integrations.run import Run
from gateway.integrations.runstate import RUNNING, START
from gateway.integrations.ticket import GatewayConfig, Ticket, result_hash

CONFIG = GatewayConfig(url="http://127.0.0.1:9", min_interval_s=10.0)


def _run(ticket: Ticket | None = None) -> Run:
    ticket = ticket or Ticket("tok", 60_000, 2, None, ("owner:u42",))
    return Run("t1", worker="w", ticket=ticket, scheme="rq", config=CONFIG, wake=lambda: None, cancel=print)


def _handed(run: Run) -> Run:
    """The run another process makes of ``run``'s pending reports (what ``Reporter.adopt`` does)."""
    pending = run.pending()
    assert pending is not None
    pending = json.loads(json.dumps(pending))  # it travels through Redis
    other = Run(
        pending["taskId"],
        worker=pending["worker"],
        ticket=Ticket.from_header(pending["ticket"]),
        scheme=pending["scheme"],
        config=CONFIG,
        wake=lambda: None,
        cancel=print,
    )
    other.resume(pending)
    return other


def test_a_running_runs_unanswered_reports_go_on_elsewhere_with_their_ids_in_order() -> None:
    run = _run()
    run.phase, run.attempt = RUNNING, 1
    run.progress(10)
    assert run.take(now=100.0) == ("t1:1:p1", {"type": "progress", "progress": 10, "cursor": ""})
    run.progress(20)  # p1 unanswered yet, 20 waits behind it
    run.succeed("s3://r/1")
    other = _handed(run)
    assert run.handed
    run.inflight = None  # p1 answered after all, here: this process sends nothing more of the run
    assert run.take(now=200.0) is None
    assert other.finished and other.started.is_set() and other.ticket == run.ticket
    assert other.token == "tok" and other.expires_at_ms == run.expires_at_ms
    taken = []
    while (item := other.take(now=101.0)) is not None:
        assert isinstance(item, tuple)
        taken.append(item)
        other.inflight = None
    assert taken == [
        ("t1:1:p1", {"type": "progress", "progress": 10, "cursor": ""}),  # again: a harmless repeat
        ("t1:1:p2", {"type": "progress", "progress": 20, "cursor": ""}),
        ("t1:1:end", {"type": "succeed", "resultRef": "s3://r/1", "resultHash": result_hash("s3://r/1")}),
    ]


def test_an_unstarted_run_hands_over_its_start_with_its_id() -> None:
    run = _run()
    run.progress(40)
    run.fail(ValueError("bad"), retryable=True)
    other = _handed(run)
    assert (other.phase, other.start_id, other.attempt) == (START, run.start_id, None)
    assert not other.started.is_set()
    assert (other.latest, other.outcome) == ((40, ""), run.outcome)


def test_a_run_with_everything_answered_hands_nothing_over() -> None:
    run = _run()
    run.phase, run.attempt = RUNNING, 3
    run.succeed({"rows": 3})
    assert run.take(now=1.0) == ("t1:3:end", run.outcome)
    run.inflight = None  # answered
    assert run.pending() is None


def test_reports_handed_over_past_the_tasks_deadline_are_dropped() -> None:
    run = _run()
    pending = run.pending()
    assert pending is not None
    pending["expiresAtMs"] = time.time() * 1000 - 1
    assert Reporter(CONFIG).adopt(pending) is None
