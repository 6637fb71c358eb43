"""Leases that run out under load, against ``gateway serve`` on SQLite and on PostgreSQL: tasks with 2 s
leases (and an hour to live) created and started from several clients at once while busy workers
(tests/support/busy_workers.py, a process of their own) post callbacks as fast as the gateway answers
them; then their workers vanish (nothing renews the leases). Each task's subscriber, in place from before
its start, is pushed the attempt's ``fail`` (``heartbeat-timeout``, stamped at the lease's end, the
start's ``leaseUntilMs``) and the task ends ``failed`` (one attempt each); the gateway's
``gateway_lease_lateness_seconds`` counts each once.

How late (within 1 s of the lease's end, 300 leases under 20 busy workers) is no test: a loaded machine
can miss it. It is the bench check ``lease-load`` (bench/checks/under_load.py, ``python -m bench
checks``), whose run this is, small and without the bound.
"""

from __future__ import annotations

import pytest

from bench.checks.under_load import Sizes, leases

SIZES = Sizes(tasks=30, workers=2, creators=5, warm=20)


@pytest.mark.anyio
async def test_every_lease_that_runs_out_fails_its_attempt_pushed_and_counted_under_busy_workers(
    database_url: str,
) -> None:
    result = await leases(database_url, SIZES)
    assert sorted(result.pushed) == [f"lease-{i:04d}" for i in range(SIZES.tasks)]
    assert min(result.pushed.values()) >= 0, "a fail pushed before its lease's end"
    assert result.buckets["+Inf"] == SIZES.tasks, result.buckets


@pytest.mark.anyio
async def test_a_lease_whose_fail_is_pushed_before_its_starts_answer_is_read_is_checked_all_the_same(
    sqlite_url: str,
) -> None:
    """On a loaded machine a lease's ``fail`` frame can reach its subscriber before the start's answer
    (which tells the lease's end) is read: the frame is checked against the end once both are in, not
    when it comes (a ``KeyError`` then). Here every start's answer is read only after its fail frame."""
    sizes = Sizes(tasks=3, workers=0, creators=3, ttl_ms=1_000)
    result = await leases(sqlite_url, sizes, read_starts_late=True)
    assert sorted(result.pushed) == [f"lease-{i:04d}" for i in range(sizes.tasks)]
