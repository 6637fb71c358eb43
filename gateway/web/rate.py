"""Callbacks per second per task: a token bucket per task id, in this process's memory.

Each task may post ``rate`` callbacks per second, with a burst of one second's worth; past it the callback
is refused with ``429 rate-limited`` and a ``Retry-After`` before its body is read. The key is the task
id, not the token string: fresh tokens for the same task (``POST /v1/tasks`` again) share its bucket.
With several processes each keeps its own buckets, so the limit is per process.

The table is bounded: past ``MAX_KEYS`` tasks, buckets that have refilled (idle ones) are dropped, and if
that is not enough the oldest half; a dropped bucket starts full again, which only ever lets a task post
sooner.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from gateway.errors import RateLimited

MAX_KEYS = 100_000


class RateLimiter:
    def __init__(self, rate_per_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate_per_s
        self.burst = max(1.0, rate_per_s)
        self._clock = clock
        # key -> (tokens left, when they were counted); insertion order is least recently refilled first.
        self._buckets: dict[str, tuple[float, float]] = {}

    def take(self, key: str) -> None:
        """Count one request for ``key``, or raise ``RateLimited`` (nothing counted) past the rate."""
        if self.rate <= 0:
            return
        now = self._clock()
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens < 1.0:
            self._buckets[key] = (tokens, now)
            wait_s = max(1, math.ceil((1.0 - tokens) / self.rate))
            raise RateLimited(
                f"more than {self.rate:g} callbacks per second for this task; retry after {wait_s} s",
                wait_s,
            )
        self._buckets[key] = (tokens - 1.0, now)
        if len(self._buckets) > MAX_KEYS:
            self._prune(now)

    def _prune(self, now: float) -> None:
        full_after_s = self.burst / self.rate
        for key in [k for k, (_, at) in self._buckets.items() if now - at >= full_after_s]:
            del self._buckets[key]
        if len(self._buckets) > MAX_KEYS:
            for key in list(self._buckets)[: len(self._buckets) // 2]:
                del self._buckets[key]
