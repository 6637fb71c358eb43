"""The Celery app of the Celery tests: the tasks their ``celery worker`` processes run, reported to the
gateway by ``gateway.integrations.celery``.

A worker loads it through ``celery -A tests.jobs.celery_worker worker``, which makes the app from its
environment; the test process makes its own with :func:`make_app` and the same settings, to publish. Each
task's progress values rise and end at a value the test knows, so the history can be checked.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from celery import Celery, states
from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded

from gateway.integrations.celery import current_run, install, message, progress, write

# How long a task that waits for the test (to be revoked, to be killed) waits at most.
HOLD_S = 60.0
# The time limits of the tasks that overrun them: long enough for their first reports to reach the gateway
# before the limit (it stops the task wherever it is).
HARD_LIMIT_S = 5
SOFT_LIMIT_S = 3


class Flaky(Exception):
    """What the autoretried task raises on its first run."""


def work(rounds: int) -> str:
    """Some real work: hashing, ``rounds`` times."""
    digest = b"task-gateway"
    for _ in range(rounds):
        digest = hashlib.sha256(digest * 64).digest()
    return digest.hex()


# Each request the reporter sends would be an INFO line of the worker's log.
logging.getLogger("httpx").setLevel(logging.WARNING)


def say_pid(path: Path) -> None:
    """Write this process's pid to ``path`` whole: written aside, then renamed, so that a test that sees the
    file reads the pid (``write_text`` makes the file empty first, and a test polling for it could read
    that)."""
    aside = path.with_name(path.name + ".part")
    aside.write_text(str(os.getpid()))
    os.replace(aside, path)


def task(app: Celery, **options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``app.task(bind=True, **options)``, typed (Celery is not)."""
    return cast(Callable[[Callable[..., Any]], Any], app.task(bind=True, **options))


def make_app(
    *,
    broker: str,
    backend: str,
    queue: str,
    prefix: str,
    gateway: str,
    api_key: str | None,
    tags: tuple[str, ...] = (),
    shared: Path | None = None,
    timeout: float = 2.0,
) -> Celery:
    app = Celery("tests.jobs.celery_tasks", broker=broker, backend=backend)
    app.conf.update(
        task_default_queue=queue,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        result_expires=3600,
        task_track_started=False,
        worker_hijack_root_logger=False,
        # Every Redis key Celery makes (results; messages on a Redis broker) under the test's own prefix.
        result_backend_transport_options={"global_keyprefix": prefix},
        broker_transport_options={"global_keyprefix": prefix},
    )
    install(app, url=gateway, api_key=api_key, tags=tags, timeout=timeout)
    place = shared or Path(".")

    @task(app, name="tg.steps")
    def steps(self: Any, values: list[int], result: Any) -> Any:
        for value in values:
            work(20)
            progress(value, cursor=f"at-{value}")
            write("output", f"at-{value} ")  # the task's output, which the test reads back whole
        return result

    @task(app, name="tg.retry_once", max_retries=1)
    def retry_once(self: Any, values: list[int]) -> str:
        for value in values:
            work(20)
            progress(value, cursor=f"at-{value}")
        if self.request.retries == 0:
            raise self.retry(exc=ValueError("flaky first run"), countdown=0)
        return f"s3://retried/{self.request.id}"

    @task(
        app,
        name="tg.autoretry_once",
        autoretry_for=(Flaky,),
        max_retries=1,
        retry_kwargs={"countdown": 0},
    )
    def autoretry_once(self: Any, values: list[int]) -> str:
        for value in values:
            work(20)
            progress(value, cursor=f"at-{value}")
        if self.request.retries == 0:
            raise Flaky("first run")
        return f"s3://autoretried/{self.request.id}"

    @task(app, name="tg.doomed", max_retries=2)
    def doomed(self: Any, values: list[int]) -> None:
        for value in values:
            work(20)
            progress(value, cursor=f"at-{value}")
        raise RuntimeError(f"doomed {self.request.id}")

    @task(app, name="tg.hold")
    def hold(self: Any, value: int) -> str:
        """Reports ``value``, says it is holding (a file named for its id, holding its pid), then waits to
        be revoked (or cancelled: its progress() raises)."""
        progress(value, cursor="holding")
        say_pid(place / f"{self.request.id}.pid")
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline:
            work(5)
            progress(value, cursor="holding")
            time.sleep(0.02)
        return "not revoked"

    @task(app, name="tg.victim", acks_late=True, reject_on_worker_lost=True, max_retries=2)
    def victim(self: Any, first: list[int], second: list[int]) -> str:
        """Its first run reports ``first`` and holds until killed; the run after (its message redelivered)
        reports ``second`` and succeeds."""
        marker = place / f"{self.request.id}.first"
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            for value in second:
                work(20)
                progress(value, cursor=f"again-{value}")
            return f"s3://victim/{self.request.id}"
        os.close(fd)
        for value in first:
            work(20)
            progress(value, cursor=f"at-{value}")
        say_pid(place / f"{self.request.id}.pid")
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline:
            time.sleep(0.02)
        return "not killed"

    @task(app, name="tg.outlives", max_retries=1)
    def outlives(self: Any, first: list[int], rest: list[int]) -> str:
        """Reports ``first``, says where it is (a file named for its id, holding its pid), waits for the
        test's go (``<id>.go``: the test stops the gateway or this process meanwhile), reports ``rest``, says
        it is done (``<id>.done``) and succeeds."""
        for value in first:
            progress(value, cursor=f"at-{value}")
        say_pid(place / f"{self.request.id}.pid")
        deadline = time.monotonic() + HOLD_S
        while not (place / f"{self.request.id}.go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        for value in rest:
            progress(value, cursor=f"at-{value}")
        (place / f"{self.request.id}.done").touch()
        return f"s3://outlived/{self.request.id}"

    def overrun(value: int) -> None:
        """Reports ``value``, says it is holding (a file named for its id), then works past any limit."""
        progress(value, cursor="overrunning")
        say_pid(place / f"{app.current_task.request.id}.pid")
        deadline = time.monotonic() + HOLD_S
        while time.monotonic() < deadline:
            work(5)
            time.sleep(0.02)

    @task(app, name="tg.hard_limit", time_limit=HARD_LIMIT_S)
    def hard_limit(self: Any, value: int) -> str:
        """Killed by its hard time limit (the pool process is terminated: no exception in the task)."""
        overrun(value)
        return "not killed"

    @task(
        app,
        name="tg.hard_limit_requeued",
        time_limit=HARD_LIMIT_S,
        acks_late=True,
        acks_on_failure_or_timeout=False,
    )
    def hard_limit_requeued(self: Any, value: int) -> str:
        """Its first run is killed by its hard time limit, and Celery puts the message back in the queue
        (``acks_late`` without ``acks_on_failure_or_timeout``); the second run succeeds."""
        marker = place / f"{self.request.id}.first"
        if not marker.exists():
            marker.touch()
            overrun(value)
        progress(value + 10, cursor="again")
        return f"s3://in-time/{self.request.id}"

    @task(app, name="tg.soft_limit", soft_time_limit=SOFT_LIMIT_S)
    def soft_limit(self: Any, value: int) -> str:
        """Stopped by its soft time limit (``SoftTimeLimitExceeded`` raised in it), which it lets out."""
        overrun(value)
        return "not stopped"

    @task(
        app,
        name="tg.soft_limit_retried",
        soft_time_limit=SOFT_LIMIT_S,
        autoretry_for=(SoftTimeLimitExceeded,),
        max_retries=1,
        retry_kwargs={"countdown": 0},
    )
    def soft_limit_retried(self: Any, value: int) -> str:
        """Its first run overruns its soft time limit and is retried (autoretry); the second succeeds."""
        if self.request.retries == 0:
            overrun(value)
        progress(value + 10, cursor="again")
        return f"s3://in-time/{self.request.id}"

    @task(app, name="tg.ignored")
    def ignored(self: Any, value: int, stored: Any, reported: str | None = None) -> None:
        """Reports ``value``, stores ``stored`` as its result itself when given (``update_state``), or
        reports ``reported`` as its result through its run, then raises ``Ignore`` (Celery records nothing
        more and does not run it again)."""
        progress(value, cursor="ignoring")
        if stored is not None:
            self.update_state(state=states.SUCCESS, meta=stored)
        run = current_run()
        if reported is not None and run is not None:
            run.succeed(reported)
        raise Ignore()

    @task(app, name="tg.batch_item")
    def batch_item(self: Any, index: int, steps: int, pause_s: float = 0.0) -> str:
        """One job of a batch (tests/jobs/celery_batch.py): ``steps`` steps, each its progress and its status
        line (``Item <index>: step <n> of <steps>``), ``pause_s`` apart (the work, as people watch it)."""
        for step in range(1, steps + 1):
            work(20)
            progress(step * 100 // steps, cursor=f"step-{step}")
            message(f"Item {index}: step {step} of {steps}")
            time.sleep(pause_s)  # the step's work, at a pace a page can show
        return f"s3://batch/{self.request.id}"

    @task(app, name="tg.sheets")
    def sheets(self: Any, total: int) -> str:
        """Celery's own idiom: ``update_state(state="PROGRESS", meta=...)`` for each of ``total`` sheets."""
        for sheet in range(1, total + 1):
            work(20)
            meta = {"current": sheet, "total": total, "message": f"Sheet {sheet} of {total}"}
            self.update_state(state="PROGRESS", meta=meta)
        return f"s3://sheets/{self.request.id}"

    @task(app, name="tg.broken")
    def broken(self: Any, index: int) -> str:
        """A batch's job that fails for good."""
        message(f"Item {index}: failing")
        raise ValueError(f"broken {index}")

    @task(app, name="tg.merge")
    def merge(self: Any, results: list[Any]) -> str:
        """A chord's body: what its header's jobs returned, merged."""
        message(f"Merging {len(results)} results")
        return f"s3://merged/{len(results)}"

    @task(app, name="tg.rejected", acks_late=True)
    def rejected(self: Any, value: int, requeue: bool) -> str:
        """Reports ``value`` and rejects its message: dead-lettered (``requeue`` false), or put back in the
        queue once (its second run succeeds)."""
        marker = place / f"{self.request.id}.first"
        if requeue and marker.exists():
            progress(value + 10, cursor="again")
            return f"s3://requeued/{self.request.id}"
        marker.touch()
        progress(value, cursor="rejecting")
        raise Reject(f"rejected {self.request.id}", requeue=requeue)

    return app
