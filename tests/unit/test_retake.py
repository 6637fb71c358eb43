"""The clients' two shared rules, pure (``gateway.client.retry``, ``gateway.client.retake``): which answers
are tried again and after how long, and what a worker told its attempt is over does (take the task back, or
say the task went on without it, and what is lost)."""

from __future__ import annotations

import random
from typing import Any

from gateway.client.backoff import Backoff
from gateway.client.retake import TAKE_BACK, WentOn, lost, outlived
from gateway.client.retry import pause_s, retried, retry_after_s


def test_no_answer_a_5xx_and_a_429_are_tried_again_any_other_answer_is_the_answer() -> None:
    assert [status for status in (200, 201, 400, 404, 409, 429, 500, 502, 503) if retried(status)] == [
        429,
        500,
        502,
        503,
    ]


def test_the_wait_is_the_backoff_and_at_least_retry_after_in_seconds() -> None:
    assert (retry_after_s("3"), retry_after_s(" 2 "), retry_after_s(None)) == (3.0, 2.0, None)
    assert retry_after_s("Wed, 21 Oct 2026 07:28:00 GMT") is None  # a date is not the gateway's
    backoff = Backoff(base_s=0.05, cap_s=2.0, rng=random.Random(7))
    first = pause_s(backoff)
    assert 0 <= first <= 0.05 and backoff.failures == 1  # counted
    assert pause_s(backoff, "3") == 3.0  # the answer asks for longer than the backoff
    assert pause_s(Backoff(base_s=10.0, cap_s=10.0, rng=random.Random(1)), "0") > 0  # and for less


def task(state: str, attempts: int, **more: Any) -> dict[str, Any]:
    return {"id": "t1", "state": state, "attempts": attempts, "maxAttempts": 2, **more}


def test_a_task_its_lease_requeued_at_the_workers_attempt_is_taken_back() -> None:
    assert outlived(task("queued", 1, error="heartbeat-timeout"), 1) is TAKE_BACK


def test_a_task_that_went_on_without_the_worker_says_how() -> None:
    assert outlived(None, 1) == WentOn("another attempt has started since")
    assert outlived(task("running", 2), 1) == WentOn("attempt 2 has started since")
    assert outlived(task("queued", 2, error="heartbeat-timeout"), 1) == WentOn("attempt 2 has started since")
    assert outlived(task("queued", 1, error="operator"), 1) == WentOn(
        "attempt 1 was ended by a fail: operator"
    )
    assert outlived(task("failed", 2, error="heartbeat-timeout"), 2) == WentOn(
        "its lease ran out on attempt 2 of 2: no attempt left, the task failed"
    )
    assert outlived(task("failed", 1, error="cancelled"), 1) == WentOn("the task was cancelled")
    assert outlived(task("expired", 1), 1) == WentOn("the task is expired")
    assert outlived(task("succeeded", 1), 1) == WentOn("the task is succeeded")


def test_what_is_lost_is_said_in_words() -> None:
    assert lost({"type": "succeed", "resultRef": "s3://r/1", "resultHash": "h"}) == "its result s3://r/1"
    assert (
        lost({"type": "fail", "error": "ValueError: x", "retryable": False}) == "its failure (ValueError: x)"
    )
    assert lost({"type": "progress", "progress": 40, "cursor": ""}) == (
        "its progress 40% and what the job reports after it"
    )
    assert lost(None) == "what the job reports from here on"
