"""The Celery worker of the Celery progress() workload (bench/workloads/celery_progress.py):

    celery -A bench.programs.celery_worker worker ...   (with the BENCH_CELERY_* variables set)

Its app's task ``bench.loop`` hashes 32 KiB per iteration and reports each iteration with ``progress()``;
in the ``floor`` variant the integration is not installed, and ``progress`` is a function that does
nothing. Each task's time, from ``task_prerun`` to ``task_postrun``, is written to a file named by its id.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from celery import Celery, signals

REDIS = "redis://127.0.0.1:6379/11"
BLOCK = b"\x5a" * 32 * 1024  # hashed once per iteration


def make_app(variant: str, queue: str, prefix: str, gateway: str, times: Path) -> Celery:
    """The bench's app: ``loop`` reports each iteration with ``progress()``; in the ``floor`` variant the
    integration is not installed, and ``progress`` is a function that does nothing."""
    app = Celery("celery_progress", broker=REDIS)
    app.conf.update(
        task_default_queue=queue,
        broker_transport_options={"global_keyprefix": prefix},
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        task_ignore_result=True,
    )
    started: dict[str, float] = {}

    def before(task_id: str | None = None, **_: Any) -> None:
        started[str(task_id)] = time.perf_counter()

    def after(task_id: str | None = None, **_: Any) -> None:
        took = time.perf_counter() - started.pop(str(task_id))
        (times / f"{task_id}.tmp").write_text(repr(took))
        (times / f"{task_id}.tmp").rename(times / str(task_id))  # whole, or not there

    signals.task_prerun.connect(before, weak=False)  # before the integration's handler: its start counts
    if variant == "floor":

        def report(value: int, cursor: str = "") -> None:
            pass

    else:
        from gateway.integrations.celery import install, progress

        install(app, url=gateway, api_key=None)
        report = progress
    signals.task_postrun.connect(after, weak=False)  # after the integration's: its finish counts

    @cast(Callable[[Callable[..., Any]], Any], app.task(name="bench.loop"))  # typed (Celery is not)
    def loop(iterations: int) -> str:
        digest = b""
        for i in range(iterations):
            digest = hashlib.sha256(BLOCK + digest).digest()
            report(i * 100 // iterations, cursor=str(i))
        return digest.hex()

    return app


if "BENCH_CELERY_VARIANT" in os.environ:
    app = make_app(
        os.environ["BENCH_CELERY_VARIANT"],
        os.environ["BENCH_CELERY_QUEUE"],
        os.environ["BENCH_CELERY_PREFIX"],
        os.environ["BENCH_CELERY_GATEWAY"],
        Path(os.environ["BENCH_CELERY_TIMES"]),
    )
