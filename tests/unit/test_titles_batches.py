"""What a queue job's task is called and how a queue's group becomes a batch, pure: a job's default title
(its name and arguments, shortened), what overrides it, the ticket that carries it to the worker, and the
decisions that end a group's or a chord's parent."""

from __future__ import annotations

from typing import Any

import pytest
from celery.canvas import Signature

from gateway.integrations.batch import Batch, chord_end, group_title, parent_end
from gateway.integrations.celery_canvas import carry, chord_body, group_jobs, message_body, meta_progress
from gateway.integrations.ticket import GatewayConfig, Ticket, clean_title, gateway_config, job_title, titled

CONFIG = GatewayConfig(url="http://gw.example")


def test_a_jobs_title_is_its_name_and_arguments_as_a_call_reads_shortened() -> None:
    assert job_title("reports.tasks.export_report", (42,), {"fmt": "pdf"}) == "export_report(42, fmt='pdf')"
    rows = list(range(2000))
    assert job_title("build", (rows, "x" * 500)) == "build([0, 1, 2, ...], 'xxxxxxxxx...xxxxxxxxxx')"
    long = job_title("f", tuple(range(100)))
    assert len(long) == 80 and long.endswith("…")
    assert job_title("", ()) == "job()"


def test_a_title_is_cleaned_to_what_the_gateway_takes() -> None:
    assert clean_title("Monthly\nsales\texport ") == "Monthly sales export"
    assert clean_title("x" * 300) == "x" * 199 + "…"
    assert clean_title("  ") is None and clean_title(None) is None and clean_title(42) is None


def test_a_jobs_own_title_wins_then_installs_function_then_the_default() -> None:
    def named(name: str, args: Any, kwargs: Any) -> str | None:
        return None if args == (0,) else f"Report {args[0]}"

    config = gateway_config(url="http://gw.example", title=named)
    assert titled({"title": "Monthly sales"}, config, "export", (42,), {}) == "Monthly sales"
    assert titled({"title": None}, CONFIG, "export", (42,), {}) is None  # a job that asks for none
    assert titled({}, config, "export", (42,), {}) == "Report 42"
    assert titled(None, config, "export", (0,), {}) is None
    assert titled(None, CONFIG, "export", (42,), {}) == "export(42)"
    with pytest.raises(ValueError, match="title: must be a function"):
        gateway_config(url="http://gw.example", title="Report")  # type: ignore[arg-type]


def test_the_ticket_carries_what_the_task_was_made_with_to_the_worker() -> None:
    batch = Batch("g1", "ptok", 20, None).to_header()
    ticket = Ticket("tok", 1000, 2, None, ("a",), "export(1)", {"n": 1}, "g1", True, batch)
    header = ticket.to_header()
    assert header == {
        "tags": ["a"],
        "ttlMs": 1000,
        "maxAttempts": 2,
        "token": "tok",
        "title": "export(1)",
        "metadata": {"n": 1},
        "parent": "g1",
        "progressFromChildren": True,
        "batch": {"id": "g1", "token": "ptok", "size": 20},
    }
    assert Ticket.from_header(header) == ticket
    carried = Ticket.from_header(header)
    assert carried is not None and carried.batch == batch
    assert ticket.create_options()["progress_from_children"] is True
    plain = Ticket(None, 1000, 1, None, ())
    assert Ticket.from_header(plain.to_header()) == plain and "title" not in plain.to_header()


def test_a_batch_header_round_trips_and_refuses_what_is_not_one() -> None:
    chord = Batch("g1", "ptok", 3, "body-1")
    assert Batch.from_header(chord.to_header()) == chord
    assert Batch.from_header({"id": "g1"}) == Batch("g1", None)
    assert Batch.from_header({"id": "g1", "size": True, "token": 5}) == Batch("g1", None)
    assert Batch.from_header({"token": "t"}) is None and Batch.from_header("g1") is None


def test_a_groups_title_names_its_jobs_its_size_and_a_chords_body() -> None:
    assert group_title(["tasks.export_report"] * 20, 20) == "export_report: 20 jobs"
    assert group_title(["a.x", "a.y", "a.x"], 3, "a.merge") == "x, y: 3 jobs, then merge"
    assert group_title(["a", "b", "c", "d"], None) == "a, b, c, …"
    assert group_title([], 1) == "group: 1 job"


def children(**counts: int) -> dict[str, int]:
    base = {"total": 0, "queued": 0, "running": 0, "succeeded": 0, "failed": 0, "expired": 0}
    return {**base, **counts}


def test_a_groups_parent_ends_once_the_whole_group_has_ended() -> None:
    parent = {"id": "g1", "state": "running"}
    succeeded = parent_end({**parent, "children": children(total=3, succeeded=3)}, 3)
    assert succeeded is not None and (succeeded["type"], succeeded["resultRef"]) == ("succeed", "batch://g1")
    failed = parent_end({**parent, "children": children(total=3, succeeded=1, failed=1, expired=1)}, 3)
    assert failed == {"type": "fail", "error": "2 of 3 jobs did not succeed", "retryable": False}
    # Not yet: a job still running, the group not all published, the size unknown, the parent ended.
    assert parent_end({**parent, "children": children(total=3, succeeded=2, running=1)}, 3) is None
    assert parent_end({**parent, "children": children(total=2, succeeded=2)}, 3) is None
    assert parent_end({**parent, "children": children(total=3, succeeded=3)}, None) is None
    assert parent_end({"state": "succeeded", "children": children(total=1, succeeded=1)}, 1) is None
    assert parent_end(parent, 3) is None


def test_a_chords_parent_ends_with_its_body_or_a_header_jobs_final_failure() -> None:
    chord = Batch("g1", "ptok", 2, "body")
    done = {"type": "succeed", "resultRef": "s3://merged", "resultHash": "h"}
    assert chord_end(chord, "body", done) == done
    assert chord_end(chord, "job-1", done) is None  # a header job's success ends nothing
    failed = {"type": "fail", "error": "ValueError: x", "retryable": False}
    assert chord_end(chord, "job-1", failed) == {
        "type": "fail",
        "error": "the chord's job job-1 failed: ValueError: x",
        "retryable": False,
    }
    body_failed = chord_end(chord, "body", failed)
    assert body_failed is not None and body_failed["error"] == "the chord's body failed: ValueError: x"
    assert chord_end(chord, "body", {**failed, "retryable": True}) is None  # it runs again
    assert chord_end(chord, "body", None) is None
    assert chord_end(Batch("g1", "ptok", 2), "body", done) is None  # a group: its children end it


def test_what_celery_publishes_is_read_as_celery_sends_it() -> None:
    body = Signature("tasks.merge", options={"task_id": "body-1"})
    assert message_body(((1, 2), {"a": 1}, {"chord": body})) == ((1, 2), {"a": 1}, {"chord": body})
    assert message_body("not protocol 2") == ((), {}, {})
    assert chord_body({"chord": body}) == (body, "tasks.merge", "body-1")
    assert chord_body({}) == (None, None, None)
    carry(body, Batch("g1", "ptok", 2, "body-1"))
    batch = {"id": "g1", "token": "ptok", "size": 2, "body": "body-1"}
    assert body.options["headers"]["gateway"]["batch"] == batch
    carry({"options": None}, Batch("g1", None))  # nothing to write into: nothing written
    assert group_jobs(None) == (None, [])
    from celery import group

    assert group_jobs(group(Signature("a.x"), Signature("a.y"))) == (2, ["a.x", "a.y"])


def test_update_states_meta_moves_progress_by_current_over_total() -> None:
    assert meta_progress({"current": 3, "total": 12}) == 25
    assert meta_progress({"current": 30, "total": 12}) == 100
    for meta in ({"current": 1}, {"current": 1, "total": 0}, {"current": True, "total": 2}):
        assert meta_progress(meta) is None
    assert meta_progress({"current": "1", "total": 2}) is None
    assert meta_progress({"current": float("nan"), "total": 2}) is None
    assert meta_progress({"current": 1, "total": float("inf")}) is None
