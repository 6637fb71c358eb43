"""What the queue integrations put on the wire, with no gateway: the ticket a job's headers carry, a result's
reference and hash, an error's words, and Celery's TTL and attempts; a run's coalescing, driven by hand."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime, timedelta

import pytest
from celery import Celery

from gateway.client import TaskCancelled
from gateway.integrations.celery import _max_attempts, _ttl_ms
from gateway.integrations.run import Run
from gateway.integrations.ticket import (
    MAX_ERROR_CHARS,
    GatewayConfig,
    Ticket,
    error_text,
    requested,
    result_hash,
    result_ref,
)


def test_a_ticket_travels_in_a_header_and_back() -> None:
    ticket = Ticket("tok", 60_000, 3, 2000, ("owner:u42",))
    header = ticket.to_header()
    assert header == {
        "tags": ["owner:u42"],
        "ttlMs": 60_000,
        "maxAttempts": 3,
        "heartbeatMs": 2000,
        "token": "tok",
    }
    assert Ticket.from_header(header) == ticket
    # No null in a header: what is not known is left out.
    assert Ticket(None, 1, 1, None, ()).to_header() == {"tags": [], "ttlMs": 1, "maxAttempts": 1}
    assert Ticket.from_header(Ticket(None, 1, 1, None, ()).to_header()) == Ticket(None, 1, 1, None, ())


def test_a_header_the_user_wrote_is_not_a_ticket_but_says_what_the_task_asks() -> None:
    header = {"tags": ["project:7"], "heartbeatMs": 5000}
    assert Ticket.from_header(header) is None
    assert Ticket.from_header(None) is None
    config = GatewayConfig(url="http://gw", tags=("default",), heartbeat_ms=None)
    assert requested(header, config) == (("project:7",), 5000)
    assert requested(None, config) == (("default",), None)


def test_a_result_is_referred_to_by_its_string_or_the_queues_address() -> None:
    assert result_ref("s3://reports/42.pdf", "celery", "t1") == "s3://reports/42.pdf"
    assert result_ref("  ", "celery", "t1") == "celery://t1"
    assert result_ref({"rows": 3}, "rq", "t1") == "rq://t1"
    assert result_hash({"b": 1, "a": "é"}) == hashlib.sha256('{"a":"é","b":1}'.encode()).hexdigest()
    assert result_hash(None) == hashlib.sha256(b"null").hexdigest()


def test_an_error_says_its_type_and_message_within_what_the_gateway_takes() -> None:
    assert error_text(ValueError("bad row 7")) == "ValueError: bad row 7"
    assert error_text("cancelled by hand") == "cancelled by hand"
    assert len(error_text(RuntimeError("x" * 10 * MAX_ERROR_CHARS))) == MAX_ERROR_CHARS


def test_celery_expires_is_the_ttl_and_max_retries_the_attempts() -> None:
    expires = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
    assert 290_000 < _ttl_ms(expires, 1) <= 300_000
    assert _ttl_ms(None, 1234) == 1234
    assert _ttl_ms("not a time", 1234) == 1234
    app = Celery("t", broker="memory://")

    @app.task(name="t.two", max_retries=2)  # type: ignore[untyped-decorator]  # Celery is untyped
    def two() -> None:
        pass

    @app.task(name="t.forever", max_retries=None)  # type: ignore[untyped-decorator]
    def forever() -> None:
        pass

    assert _max_attempts(app, "t.two") == 3
    assert _max_attempts(app, "t.forever") == 2**53
    assert _max_attempts(app, "t.unknown") == 4  # Celery's default max_retries, 3


def _run() -> Run:
    config = GatewayConfig(url="http://gw", min_interval_s=10.0)
    ticket = Ticket("tok", 60_000, 1, None, ())
    return Run(
        "t1", worker="w", ticket=ticket, scheme="celery", config=config, wake=lambda: None, cancel=print
    )


def test_progress_is_coalesced_and_the_latest_goes_before_the_outcome() -> None:
    run = _run()
    run.attempt = 1
    run.progress(10)
    first = run.take(now=100.0)
    assert first == ("t1:1:p1", {"type": "progress", "progress": 10, "cursor": ""})
    run.inflight = None  # answered
    run.progress(20)
    run.progress(30, "row-30")
    assert run.take(now=101.0) == 110.0  # not before min_interval_s
    run.succeed("s3://x")
    assert run.take(now=101.0) == ("t1:1:p2", {"type": "progress", "progress": 30, "cursor": "row-30"})
    run.inflight = None
    end = run.take(now=101.0)
    assert isinstance(end, tuple) and end[0] == "t1:1:end" and end[1]["type"] == "succeed"


def test_a_repeated_progress_is_not_sent_again() -> None:
    run = _run()
    run.attempt = 1
    run.progress(10)
    assert isinstance(run.take(now=100.0), tuple)
    run.inflight = None
    run.progress(10)
    assert run.take(now=200.0) is None
    assert run.asked  # it asks whether the task is still wanted instead


def test_progress_refuses_a_value_out_of_range_and_raises_once_cancelled() -> None:
    run = _run()
    with pytest.raises(ValueError):
        run.progress(101)
    run.cancelled = TaskCancelled("progress", "terminal-conflict", {"id": "t1", "state": "failed"})
    with pytest.raises(TaskCancelled):
        run.progress(50)
