"""Exponential backoff with full jitter, shared by the subscriber and the worker clients."""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    base_s: float = 0.1
    cap_s: float = 10.0
    failures: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def next_delay(self) -> float:
        """The wait before the next try: uniform in [0, min(cap, base * 2**failures)]."""
        delay = self.rng.uniform(0, min(self.cap_s, self.base_s * 2**self.failures))
        self.failures += 1
        return delay

    def reset(self) -> None:
        self.failures = 0
