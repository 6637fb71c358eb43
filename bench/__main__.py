"""``python -m bench``: the one entry point of the benchmarks and the bench checks.

    python -m bench [--smoke] [--only 1,2,...] [--procs N] [--pg-admin-url URL]   every workload (bench.suite)
    python -m bench checks [--only NAME,...]                                       the bounds (bench.checks)
    python -m bench WORKLOAD [its options]                                         one workload alone

where WORKLOAD is one of: callbacks, celery_progress, expiry, fanout, hundredk, pg_ceiling, retention,
streams, stream_live, tags, workers_cost (``python -m bench WORKLOAD --help``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from typing import cast

# The workloads that run alone, with options of their own: each module's ``command(argv)``. Imported only
# when asked for (celery_progress needs Celery, the test extra's).
ALONE = (
    "callbacks",
    "celery_progress",
    "expiry",
    "fanout",
    "hundredk",
    "pg_ceiling",
    "streams",
    "retention",
    "tags",
    "workers_cost",
    "stream_live",
)


def main(argv: Sequence[str]) -> int:
    if argv[:1] == ["checks"]:
        from bench import checks

        return checks.command(argv[1:])
    if argv[:1] and argv[0] in ALONE:
        module = importlib.import_module(f"bench.workloads.{argv[0]}")
        return cast(Callable[[Sequence[str]], int], module.command)(argv[1:])
    if argv[:1] and not argv[0].startswith("-"):
        print(__doc__, file=sys.stderr)
        return 2
    from bench import suite

    return suite.command(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
