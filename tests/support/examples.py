"""How many examples the property tests try: every one they ask for in CI's run, a quarter of it in a
developer's default run (the suite's wall time is what a change costs to check; CI runs them all).

tests/conftest.py loads the profile (``ci`` where ``CI`` is set, ``dev`` otherwise; ``HYPOTHESIS_PROFILE``
names another); a test that sets its own count asks for it through :func:`examples`, so that it scales too.
"""

from __future__ import annotations

import os

from hypothesis import settings

# Hypothesis' own default, which the counts the tests ask for are relative to.
CI_EXAMPLES = 100

settings.register_profile("ci", max_examples=CI_EXAMPLES)
settings.register_profile("dev", max_examples=CI_EXAMPLES // 4)


def load_profile() -> None:
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))


def every_example() -> bool:
    """Whether the profile loaded is CI's (or asks for more): some generators (schemathesis's coverage
    phase, every boundary case the document defines) run whole or not at all."""
    return bool(settings().max_examples >= CI_EXAMPLES)


def examples(n: int) -> int:
    """``n`` examples in CI's profile, the same share of it in the one loaded."""
    return max(1, n * settings().max_examples // CI_EXAMPLES)
