"""The bench checks: bounds of time and size the project promises, each figure printed beside its target.

    python -m bench checks [--only lease-load,expiry-load,...]

A bound that a loaded machine can miss is no test (the suite runs beside other work; it holds the
behaviour under each bound instead): it is measured here, by ``.ci/run`` after the test suite, when CI has
its machine to itself. Exit 1 when a figure missed its target or a check could not run.
"""

from __future__ import annotations

import argparse
import os
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence

from bench.checks import (
    db_deadline,
    dead_link,
    dead_link_pages,
    expiry,
    flood,
    heartbeats,
    keepalive,
    retention,
    tag_across,
    under_load,
)
from bench.lib import harness
from bench.lib.verdict import Figure

Check = Callable[[], Awaitable[list[Figure]]]

# By name, in the order they run: each starts what it needs (gateways, busy workers, databases) and stops
# it after.
CHECKS: dict[str, Check] = {
    "expiry-on-time": expiry.on_time,
    "expiry-wakes": expiry.wakes,
    "expiry-at-restart": expiry.at_restart,
    "expiry-busy-loop": expiry.busy_loop,
    "expiry-load": under_load.expiry_load,
    "lease-load": under_load.lease_load,
    "worker-heartbeats": heartbeats.held,
    "retention-growth": retention.growth,
    "db-deadline": db_deadline.answered,
    "db-partition": db_deadline.partition,
    "tag-across-processes": tag_across.seen,
    "ws-keepalive": keepalive.dropped,
    "watch-dead-link": dead_link.watch_replaced,
    "page-dead-link": dead_link_pages.page_replaced,
    "tag-page-back": dead_link_pages.tag_page_back,
    "flood": flood.costs_little,
}


async def run(names: Sequence[str]) -> int:
    figures: list[Figure] = []
    failures: list[str] = []
    started = time.monotonic()
    for name in names:
        print(f"[{time.monotonic() - started:6.1f} s] {name} ...", flush=True)
        try:
            found = await CHECKS[name]()
        except Exception as exc:
            traceback.print_exc()
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        for figure in found:
            print(f"  {figure.line()}", flush=True)
        figures += found
    print()
    print(f"bench checks, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}:")
    for figure in figures:
        print(figure.line())
        if figure.detail and not figure.kept:
            print(f"        {figure.detail}")
    for failure in failures:
        print(f"FAILED  {failure}")
    missed = [figure for figure in figures if not figure.kept]
    kept = len(figures) - len(missed)
    print(
        f"checks {'FAILED' if missed or failures else 'passed'}: {kept} of {len(figures)} figures kept their "
        f"targets, {len(failures)} checks could not run ({time.monotonic() - started:.0f} s)"
    )
    return 1 if missed or failures else 0


def command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench checks", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--only", default="", help=f"comma-separated: {', '.join(CHECKS)}")
    args = parser.parse_args(argv)
    names = [name for name in args.only.split(",") if name] or list(CHECKS)
    unknown = [name for name in names if name not in CHECKS]
    if unknown:
        parser.error(f"no such check: {', '.join(unknown)} (there are: {', '.join(CHECKS)})")
    return harness.run_to_the_end(run(names))
