"""The pure parts of the limits: the callback rate per task and the redaction of tokens in log lines."""

from __future__ import annotations

import logging

import pytest

from gateway.errors import RateLimited
from gateway.server.serve import RedactTokens, redact_query
from gateway.web.rate import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_task_gets_a_burst_of_one_second_then_its_rate() -> None:
    clock = Clock()
    limiter = RateLimiter(10, clock=clock)
    for _ in range(10):
        limiter.take("t")
    with pytest.raises(RateLimited) as refused:
        limiter.take("t")
    assert refused.value.retry_after_s == 1 and refused.value.status == 429
    assert refused.value.headers() == {"Retry-After": "1"}
    limiter.take("other")  # another task has its own bucket
    clock.now += 0.1  # a tenth of a second: one more callback
    limiter.take("t")
    with pytest.raises(RateLimited):
        limiter.take("t")


def test_a_slow_rate_says_how_long_to_wait() -> None:
    clock = Clock()
    limiter = RateLimiter(0.25, clock=clock)  # one every 4 s, a burst of one
    limiter.take("t")
    with pytest.raises(RateLimited) as refused:
        limiter.take("t")
    assert refused.value.retry_after_s == 4


def test_rate_zero_is_no_limit_and_the_table_stays_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    unlimited = RateLimiter(0)
    for _ in range(1000):
        unlimited.take("t")
    import gateway.web.rate

    monkeypatch.setattr(gateway.web.rate, "MAX_KEYS", 100)
    clock = Clock()
    limiter = RateLimiter(5, clock=clock)
    for i in range(1000):
        limiter.take(f"t{i}")
        clock.now += 0.001
    assert len(limiter._buckets) <= 100


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("/v1/tasks/t?token=abc", "/v1/tasks/t?token=[redacted]"),
        ("/?task=a&token=T1&task=b&token=T2", "/?task=a&token=[redacted]&task=b&token=[redacted]"),
        ("/v1/tasks/t/events?cursor=0&tok%65n=x", "/v1/tasks/t/events?cursor=0&tok%65n=[redacted]"),
        ("/v1/tasks/t?TOKEN=abc&tokens=keep", "/v1/tasks/t?TOKEN=[redacted]&tokens=keep"),
        ("/v1/tasks/t?cursor=1", "/v1/tasks/t?cursor=1"),
        ('WebSocket /v1/ws?token=abc" [accepted]', 'WebSocket /v1/ws?token=[redacted]" [accepted]'),
    ],
)
def test_token_query_values_are_redacted(line: str, expected: str) -> None:
    assert redact_query(line) == expected


def test_the_filter_rewrites_uvicorns_access_arguments() -> None:
    record = logging.LogRecord(
        "uvicorn.access",
        logging.INFO,
        __file__,
        1,
        '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", "/?task=t&token=secret", "1.1", 200),
        None,
    )
    assert RedactTokens().filter(record)
    assert "secret" not in record.getMessage() and "token=[redacted]" in record.getMessage()
