"""**retention-growth**: the database stays the same size under steady churn (docs/deploy.md, "The space is
reused"), on SQLite and on PostgreSQL (a cluster of the check's own whose autovacuum is on, set as
docs/deploy.md advises: this machine's shared server runs with it off).

bench/workloads/retention.py's churn at a size CI runs: 6,000 tasks in three rounds of ten steps, created,
run, finished and drained while the retention loop deletes those a retention old, each step waiting for
autovacuum to catch up with its deletes (as it has time to where the retention is hours and autovacuum
looks every minute). Held to: the size after the third round within 1.2x the size after the first; on
PostgreSQL autovacuum ran on every table round after round; the churn's own checks (no row of a task past
the retention, every drain exact, undrained tasks kept) found nothing.

The suite holds what retention does without the size (tests/integration/test_retention.py: a task past its
retention is unknown everywhere once drained, an undrained one is kept and counted until drained).
"""

from __future__ import annotations

from bench.lib.verdict import Figure
from bench.workloads import retention

TASKS = 6_000


async def growth() -> list[Figure]:
    found = []
    for backend in ("sqlite", "postgresql"):
        async with retention.database(backend) as url:
            result = await retention.churn(url, TASKS, say=lambda line: None, each_step=True)
        check = f"retention-growth ({result.backend})"
        detail = retention.report([result])
        found.append(
            Figure(
                check,
                "size after round 3 / after round 1",
                result.growth,
                "x",
                retention.MAX_GROWTH,
                digits=2,
                detail=detail,
            )
        )
        found.append(
            Figure(
                check,
                "problems the churn found",
                len(result.problems),
                "",
                0,
                detail="; ".join(result.problems),
            )
        )
        if result.backend == "PostgreSQL":  # autovacuum did the work, on every table, round after round
            first, last = result.rounds[0].autovacuums, result.rounds[-1].autovacuums
            idle = [table for table in retention.TABLES if last[table] <= first[table]]
            found.append(
                Figure(
                    check,
                    "tables autovacuum left alone after round 1",
                    len(idle),
                    "",
                    0,
                    detail=", ".join(idle),
                )
            )
    return found
