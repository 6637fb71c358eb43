"""The relay's retry schedule: exponential backoff with full jitter, capped (``GATEWAY_NOTIFY_RETRY_*``)."""

from __future__ import annotations

from gateway.jobs.relay import backoff_ms


def test_the_wait_before_a_retry_is_random_up_to_a_doubling_capped_ceiling() -> None:
    ceilings = [backoff_ms(attempt, 500, 60_000, lambda: 1.0) for attempt in range(1, 12)]
    assert ceilings == [500, 1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 60_000, 60_000, 60_000, 60_000]
    assert backoff_ms(1_000_000, 500, 60_000, lambda: 1.0) == 60_000  # no overflow however many tries
    assert backoff_ms(5, 500, 60_000, lambda: 0.0) == 0  # full jitter: anywhere from zero
    assert backoff_ms(5, 500, 60_000, lambda: 0.5) == 4_000
