"""``gateway`` with the garbage collection pauses of every process written down (bench/workloads/hundredk.py).

    BENCH_GC_DIR=DIR python -m bench.programs.gcwatched serve --workers N ...   (the arguments of ``gateway``)

Each process of the gateway (the ``--workers`` parent and every child: a spawned child runs this module
again, as ``__mp_main__``, before it runs its worker) writes ``DIR/PID.gc`` at start (so that a process
with no full collection is seen too), then one line per full collection (generation 2) and per younger
one that paused more than 10 ms: ``generation monotonic_end seconds 0 cpu_seconds`` (the pause, and the
CPU time of it: on a busy machine a pause is longer than the work it did), and with
``BENCH_GC_FROZEN_S=S`` every S seconds ``f monotonic 0 frozen_objects``. Not after each collection, and
off unless asked: counting the frozen objects walks every one of them holding the interpreter lock
(``gc.get_freeze_count``: 116 ms at 3 million objects here, and a process with 16,000 sockets tracks
millions), a pause of the event loop and CPU time the bench would count as the gateway's. The monotonic
clock is the machine's, so the bench compares each line with its own window. ``/metrics`` cannot do it:
with ``--workers`` it answers from whichever child accepted the connection, and a histogram says a
bucket, not the longest pause. Nothing else changes: the gateway runs as ``gateway serve`` does.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

from gateway import cli

YOUNG_NOTED_S = 0.010
FROZEN_EVERY_S = float(os.environ.get("BENCH_GC_FROZEN_S") or 0)  # 0: never (see above)


def _watch(folder: str) -> None:
    path = os.path.join(folder, f"{os.getpid()}.gc")
    with open(path, "a"):
        pass
    started = started_cpu = 0.0

    def on_gc(phase: str, info: dict[str, int]) -> None:
        nonlocal started, started_cpu
        if phase == "start":
            started = time.perf_counter()
            started_cpu = time.thread_time()
            return
        took = time.perf_counter() - started
        cpu = time.thread_time() - started_cpu
        generation = info["generation"]
        if generation == 2 or took > YOUNG_NOTED_S:
            with open(path, "a") as out:
                out.write(f"{generation} {time.monotonic():.6f} {took:.6f} 0 {cpu:.6f}\n")

    gc.callbacks.append(on_gc)

    def frozen() -> None:  # how many objects are frozen, now and then: whether closed sockets leave any
        while True:
            time.sleep(FROZEN_EVERY_S)
            with open(path, "a") as out:
                out.write(f"f {time.monotonic():.6f} 0 {gc.get_freeze_count()}\n")

    if FROZEN_EVERY_S > 0:
        threading.Thread(target=frozen, daemon=True).start()


if os.environ.get("BENCH_GC_DIR"):
    _watch(os.environ["BENCH_GC_DIR"])

if __name__ == "__main__":
    sys.exit(cli.main())
