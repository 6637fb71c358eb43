"""Expiry under load, against ``gateway serve`` on SQLite and on PostgreSQL: tasks with 2 s TTLs created
from several clients at once while busy workers (tests/support/busy_workers.py, a process of their own)
post callbacks as fast as the gateway answers them, each task followed by a subscriber of its own from
before its deadline. Every task is listed expired (``GET /v1/tasks?state=expired``), pushed to its
subscriber (the ``expire`` entry pinned at its ``expiresAtMs``) and counted once by the gateway's
``gateway_expiry_lateness_seconds``.

How late (within 1 s of the deadline, 300 tasks under 20 busy workers) is no test: a loaded machine can
miss it. It is the bench check ``expiry-load`` (bench/checks/under_load.py, ``python -m bench checks``),
whose run this is, small and without the bound.
"""

from __future__ import annotations

import pytest

from bench.checks.under_load import Sizes, expiries

SIZES = Sizes(tasks=30, workers=2, creators=5, warm=20)


@pytest.mark.anyio
async def test_every_task_expires_listed_pushed_and_counted_under_busy_workers(database_url: str) -> None:
    result = await expiries(database_url, SIZES)
    ids = [f"exp-{i:04d}" for i in range(SIZES.tasks)]
    assert sorted(result.committed) == ids and sorted(result.pushed) == ids
    assert min(result.committed.values()) >= 0 and min(result.pushed.values()) >= 0, (
        "expired before its deadline"
    )
    assert result.buckets["+Inf"] == SIZES.tasks, result.buckets
