"""What ``progress()`` costs a Celery task: a task that calls it 10,000 times in a loop (hashing 32 KiB per
iteration, the same work in every variant) reported to a gateway, beside the same task in a worker without
the integration (the floor), measured in the same run; and the same task with the gateway stopped.

Three ``celery worker --pool prefork --concurrency 1`` processes, one per variant, each on a Redis queue of
its own (db 11, every key under a prefix of the run's own, deleted at the end); the bench publishes the
task to each in turn, ``--runs`` times, so that the machine's noise falls on all three alike. A task's time
is what its worker spends on it from ``task_prerun`` (before the integration's own handler) to
``task_postrun`` (after it): the integration's start, every progress call, its outcome and its wait for
the gateway's answer included. Medians are printed with their ratio to the floor (target: 1.1x).

    python -m bench celery_progress [--iterations 10000] [--runs 5] [--smoke]

A worker process runs bench/programs/celery_worker.py's app (``celery -A bench.programs.celery_worker
worker``), made from the ``BENCH_CELERY_*`` variables.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from celery import Celery

from bench.lib import harness
from bench.lib.report import Report, Row
from bench.programs.celery_worker import REDIS

VARIANTS = ("floor", "gateway", "gateway stopped")
TARGET = 1.1


# --- the bench's side --------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def worker(variant: str, queue: str, prefix: str, gateway: str, times: Path) -> AsyncIterator[int]:
    """A worker process of one variant, ready; yields its pid."""
    env = {
        **os.environ,
        "BENCH_CELERY_VARIANT": variant,
        "BENCH_CELERY_QUEUE": queue,
        "BENCH_CELERY_PREFIX": prefix,
        "BENCH_CELERY_GATEWAY": gateway,
        "BENCH_CELERY_TIMES": str(times),
    }
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "bench.programs.celery_worker",
        "worker",
        "--pool",
        "prefork",
    ]
    command += ["--concurrency", "1", "--loglevel", "WARNING", "--queues", queue, "-n", f"{queue}@%h"]
    command += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
    log_path = times / f"{queue}.log"
    with log_path.open("wb") as log:
        process = await harness.spawn(command, env=env, stdout=log, stderr=log)
    try:
        yield process.pid
    finally:
        await harness.stop(process)


async def measure(iterations: int, runs: int, *, timeout_s: float = 300.0) -> dict[str, Any]:
    """Median task time per variant (s), every run's, and the ratios to the floor."""
    from celery import Celery as Producer

    prefix = f"bench-{uuid.uuid4().hex[:10]}-"
    queues = {variant: f"bench-{variant.replace(' ', '-')}-{uuid.uuid4().hex[:6]}" for variant in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="gw-bench-celery-") as tmp:
        times = Path(tmp)
        producer = Producer("bench-producer", broker=REDIS)
        producer.conf.update(broker_transport_options={"global_keyprefix": prefix}, task_ignore_result=True)
        try:
            async with harness.gateway() as gw, contextlib.AsyncExitStack() as stack:
                stopped = f"http://127.0.0.1:{harness.free_port()}"  # nothing listens there
                urls = {"floor": gw.http, "gateway": gw.http, "gateway stopped": stopped}
                for variant in VARIANTS:
                    await stack.enter_async_context(
                        worker(variant, queues[variant], prefix, urls[variant], times)
                    )
                took: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
                # One untimed run each first: the worker's child imports and connects on its first task.
                for n in range(runs + 1):
                    for variant in VARIANTS:
                        task_id = f"bench-{variant.replace(' ', '-')}-{n}-{uuid.uuid4().hex[:8]}"
                        seconds = await _run(producer, queues[variant], task_id, iterations, times, timeout_s)
                        if n:
                            took[variant].append(seconds)
        finally:
            producer.close()
            _delete_keys(prefix)
    medians = {variant: statistics.median(values) for variant, values in took.items()}
    return {
        "iterations": iterations,
        "runs": took,
        "median_s": medians,
        "ratio": medians["gateway"] / medians["floor"],
        "ratio_stopped": medians["gateway stopped"] / medians["floor"],
    }


async def _run(
    producer: Celery, queue: str, task_id: str, iterations: int, times: Path, timeout_s: float
) -> float:
    """Publish one task and wait for its worker to record its time."""
    await asyncio.to_thread(
        lambda: producer.send_task("bench.loop", (iterations,), queue=queue, task_id=task_id)
    )
    deadline = time.monotonic() + timeout_s
    done = times / task_id
    while not done.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{task_id} did not finish within {timeout_s:.0f} s (see the worker logs)")
        await asyncio.sleep(0.01)  # the worker writes the file: nothing to wait on but looking again
    return float(done.read_text())


def _delete_keys(prefix: str) -> None:
    from redis import Redis

    client = Redis.from_url(REDIS)
    try:
        for key in client.scan_iter(match=f"{prefix}*", count=500):
            client.delete(key)
    finally:
        client.close()


async def workload(iterations: int, runs: int, report: Report) -> None:
    """Workload 8 of bench/suite.py: the figures as rows beside their floor."""
    result = await measure(iterations, runs)
    medians = result["median_s"]
    report.rows.append(
        Row(
            8,
            f"Celery task calling progress() {iterations:,} times (floor: without the integration)",
            medians["gateway"] * 1e3,
            medians["floor"] * 1e3,
            "ms",
            f"<= {TARGET}x",
        )
    )
    report.rows.append(
        Row(
            8,
            "the same, its gateway stopped (floor: without the integration)",
            medians["gateway stopped"] * 1e3,
            medians["floor"] * 1e3,
            "ms",
            "finishes",
        )
    )
    for variant in VARIANTS:
        report.figure(f"Celery progress() {variant}", medians[variant])
    report.details.append(f"Celery progress(): {summary(result)}")


def summary(result: dict[str, Any]) -> str:
    medians = result["median_s"]
    return (
        f"{result['iterations']:,} progress() calls, median of {len(result['runs']['floor'])} runs: floor "
        f"{medians['floor'] * 1e3:,.1f} ms, with the integration {medians['gateway'] * 1e3:,.1f} ms "
        f"({result['ratio']:.3f}x), gateway stopped {medians['gateway stopped'] * 1e3:,.1f} ms "
        f"({result['ratio_stopped']:.3f}x); target <= {TARGET}x"
    )


def command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench celery_progress", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--iterations", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="1,000 iterations, 1 run: that it runs")
    args = parser.parse_args(argv)
    if args.smoke:
        args.iterations, args.runs = 1000, 1
    if shutil.which("redis-cli") is None:
        print("(redis-cli not found: Redis is expected at 127.0.0.1:6379)", file=sys.stderr)
    try:
        result = asyncio.run(measure(args.iterations, args.runs))
    finally:
        harness.kill_all()
    for variant in VARIANTS:
        runs = ", ".join(f"{s * 1e3:,.1f}" for s in result["runs"][variant])
        print(f"{variant:>16}: {runs} ms")
    print(summary(result))
    return 0
