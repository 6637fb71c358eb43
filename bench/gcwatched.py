"""``gateway`` with the garbage collection pauses of every process written down (bench/hundredk.py).

    BENCH_GC_DIR=DIR python bench/gcwatched.py serve --workers N ...   (the arguments of ``gateway``)

Each process of the gateway (the ``--workers`` parent and every child: a spawned child runs this module
again, as ``__mp_main__``, before it runs its worker) writes ``DIR/PID.gc`` at start (so that a process
with no full collection is seen too), then one line per full collection (generation 2) and per younger
one that paused more than 10 ms: ``generation monotonic_end seconds``. The monotonic clock is the
machine's, so the bench compares each line with its own window. ``/metrics`` cannot do it: with
``--workers`` it answers from whichever child accepted the connection, and a histogram says a bucket, not
the longest pause. Nothing else changes: the gateway runs as ``gateway serve`` does.
"""

from __future__ import annotations

import gc
import os
import sys
import time

from gateway import cli

YOUNG_NOTED_S = 0.010


def _watch(folder: str) -> None:
    path = os.path.join(folder, f"{os.getpid()}.gc")
    with open(path, "a"):
        pass
    started = 0.0

    def on_gc(phase: str, info: dict[str, int]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
            return
        took = time.perf_counter() - started
        generation = info["generation"]
        if generation == 2 or took > YOUNG_NOTED_S:
            with open(path, "a") as out:
                out.write(f"{generation} {time.monotonic():.6f} {took:.6f}\n")

    gc.callbacks.append(on_gc)


if os.environ.get("BENCH_GC_DIR"):
    _watch(os.environ["BENCH_GC_DIR"])

if __name__ == "__main__":
    sys.exit(cli.main())
