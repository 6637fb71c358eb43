"""RQ jobs reported to the gateway: each job is a gateway task of the same id, its runs are the task's
attempts.

Producer and worker both call :func:`install` (in the module that defines the jobs, or the module a worker
is started with, ``rq worker -c``). The producer enqueues with :func:`enqueue`, which creates the gateway
task before the job is pushed; the worker is a :class:`GatewayWorker` running jobs as :class:`GatewayJob`
(``rq worker --worker-class gateway.integrations.rq.GatewayWorker --job-class
gateway.integrations.rq.GatewayJob``)::

    install(url="http://127.0.0.1:8000", api_key=KEY, heartbeat=5)
    enqueue(queue, build_report, rows, retry=Retry(max=2), gateway={"tags": ["owner:u42"]})

    def build_report(rows):
        ...; progress(40, cursor="row-400"); ...
        return "s3://reports/42.pdf"

The mapping is Celery's (docs/integrations.md), moment by moment:

- ``enqueue`` creates the task (id: the job's id; ``maxAttempts``: ``Retry(max=n)`` gives n + 1) and
  carries its callback token in ``job.meta["gateway"]``;
- a run starts an attempt (``worker``: the RQ worker's name) when the work horse performs the job;
- ``progress()`` reports (coalesced, never blocking);
- a return value succeeds (``resultRef``: a returned string, else ``rq://<id>``);
- an exception fails: retryable while the job has retries left (RQ enqueues it again, and its next run
  starts the next attempt), final otherwise; a returned ``Retry`` likewise;
- ``send_stop_job_command`` cancels the task (the job's ``on_stopped`` callback, in the worker's main
  process, which :func:`enqueue` attaches; a user's own ``on_stopped`` is called after it);
- a gateway cancel makes the job's next ``progress()`` raise ``TaskCancelled``, and RQ does not retry a
  job that raised it;
- a killed work horse sends nothing: RQ fails the job (and retries it when it has retries left); the task's
  heartbeat lease requeues the attempt, and the next run starts a new attempt once it has.

Why a job class rather than only job callbacks: RQ has no callback when a run starts, and its success and
failure callbacks are the user's to set; :meth:`GatewayJob.perform` wraps the one call that is the run.

Why a worker class: RQ's worker forks a work horse per job, which exits (``os._exit``) as soon as the job
has ended. A gateway that is down or slow must not hold the horse up (``Run.finish()`` waits a bounded
time), yet what the run could not send yet (its start, its latest progress, its outcome) must not die with
the horse. So the horse writes it (``Run.pending()``: the callback token, the attempt, the callback ids,
the task's deadline) to a Redis list of the job's own (``rq:gateway:pending:<job id>``, expiring with the
task), and :class:`GatewayWorker`'s main process, which outlives its horses, takes that list once the
horse has exited and hands it to its own reporter's sender thread (``Reporter.adopt``): sent in order, with
the same ids (a callback the horse got out after all is a harmless repeat), until the task's deadline. A
later run of the job (a retry another worker runs) takes a list left there first and sends it before its
own start.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any
from uuid import uuid4

from rq.callbacks import Callback
from rq.job import Job, Retry
from rq.queue import Queue
from rq.types import FunctionReferenceType
from rq.utils import import_attribute
from rq.worker import Worker

from gateway.client.errors import TaskCancelled
from gateway.integrations.report import (
    Reporter,
    Run,
    Ticket,
    activate,
    current_run,
    message,
    metadata,
    progress,
    write,
)
from gateway.integrations.ticket import Titler, asked_metadata, gateway_config, requested, titled

__all__ = [
    "GatewayJob",
    "GatewayWorker",
    "current_run",
    "enqueue",
    "install",
    "message",
    "metadata",
    "on_stopped",
    "progress",
    "write",
]

logger = logging.getLogger(__name__)

# The key of ``job.meta`` that carries the ticket (the ``gateway`` header of Celery's messages).
META = "gateway"
# Where a user's own ``on_stopped`` callback is kept (``job.meta``): :func:`on_stopped` calls it after ours.
USER_ON_STOPPED = "gateway_on_stopped"
SCHEME = "rq"
# The Redis list a work horse leaves a run's unsent reports in, for its worker's main process.
PENDING_KEY = "rq:gateway:pending:{}"
# ``Queue.enqueue``'s own keyword arguments (RQ 2 and 3): the rest are the function's.
RQ_OPTIONS = frozenset(
    {
        "job_timeout", "description", "result_ttl", "ttl", "failure_ttl", "depends_on", "job_id",
        "at_front", "meta", "retry", "repeat", "on_success", "on_failure", "on_stopped", "pipeline",
        "group_id", "timeout",
    }
)  # fmt: skip

_ABSENT = object()

_reporter: Reporter | None = None
# Set in a GatewayWorker's main process, so in each horse it forks: a worker will send what the horse leaves.
_handed_over = False


def install(
    *,
    url: str,
    api_key: str | None = None,
    ttl: float | timedelta | None = None,
    timeout: float = 2.0,
    min_interval: float = 0.25,
    heartbeat: float | None = None,
    tags: Sequence[str] = (),
    title: Titler | None = None,
) -> Reporter:
    """Report this process's RQ jobs to the gateway at ``url``: call it where the producer starts and where
    the worker's jobs are defined (or in the worker's ``-c`` settings module). The options are Celery's
    ``install()``'s, in seconds: ``ttl`` (a task's deadline, a day by default), ``timeout`` (the bound on
    the producer's create and on any wait of a job for the gateway), ``min_interval`` (between two progress
    callbacks), ``heartbeat`` (every task's lease, unless its ``gateway`` option says), ``tags``. Returns
    the reporter (one per process; a second install replaces it). An option the gateway would refuse (a
    heartbeat under a second, say) raises ``ValueError`` naming it, and installs nothing."""
    global _reporter
    _reporter = Reporter(
        gateway_config(
            url=url,
            api_key=api_key,
            ttl=ttl,
            timeout=timeout,
            min_interval=min_interval,
            heartbeat=heartbeat,
            tags=tags,
            title=title,
        )
    )
    return _reporter


def _installed() -> Reporter:
    if _reporter is None:
        raise RuntimeError("gateway.integrations.rq: call install(url=...) first")
    return _reporter


def enqueue(
    queue: Queue,
    f: FunctionReferenceType,
    *args: Any,
    gateway: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Job:
    """``queue.enqueue(f, *args, **kwargs)`` as a gateway task: created first (within the configured
    timeout; when it cannot be, a WARNING says so and the job is enqueued anyway, and its run creates the
    task), with the job's id (``job_id=``, else a fresh UUID). ``gateway`` takes ``tags``, ``heartbeatMs``,
    ``ttlMs``, ``title`` and ``metadata`` for this task; ``maxAttempts`` comes from ``retry=Retry(max=n)``
    (n + 1), else 1 (a job that returns ``Retry`` objects says its own: ``gateway={"maxAttempts": ...}``).
    The title is, unless ``gateway`` or ``install(title=...)`` says, the function's name and arguments."""
    reporter = _installed()
    config = reporter.config
    options = dict(gateway or {})
    job_id = kwargs.pop("job_id", None) or str(uuid4())
    retry = kwargs.get("retry")
    max_attempts = int(options.get("maxAttempts") or (retry.max + 1 if isinstance(retry, Retry) else 1))
    tags, heartbeat_ms = requested(options, config)
    if "args" in kwargs or "kwargs" in kwargs:  # RQ's explicit form: these are the function's
        shown_args, shown_kwargs = tuple(kwargs.get("args") or ()), dict(kwargs.get("kwargs") or {})
    else:
        shown_args, shown_kwargs = args, {k: v for k, v in kwargs.items() if k not in RQ_OPTIONS}
    name = f if isinstance(f, str) else str(getattr(f, "__qualname__", None) or getattr(f, "__name__", f))
    ticket = Ticket(
        token=None,
        ttl_ms=int(options.get("ttlMs") or config.ttl_ms),
        max_attempts=max_attempts,
        heartbeat_ms=heartbeat_ms,
        tags=tags,
        title=titled(options, config, name, shown_args, shown_kwargs),
        metadata=asked_metadata(options),
    )
    created = reporter.create_ticket(job_id, ticket)
    meta = dict(kwargs.pop("meta", None) or {})
    meta[META] = (created or ticket).to_header()
    user_stopped = kwargs.pop("on_stopped", None)
    if user_stopped is not None:
        meta[USER_ON_STOPPED] = (
            user_stopped if isinstance(user_stopped, Callback) else Callback(user_stopped)
        ).name
    return queue.enqueue(f, *args, job_id=job_id, meta=meta, on_stopped=Callback(on_stopped), **kwargs)


class GatewayJob(Job):
    """An RQ job whose run is reported: the worker's ``--job-class`` (``job_class=`` of a worker made in
    code). A job enqueued without :func:`enqueue` is reported too (its first run creates the task with the
    installed defaults and its ``Retry``'s attempts; ``send_stop_job_command`` does not cancel it, having
    no ``on_stopped``)."""

    def perform(self) -> Any:
        # Resolving the function imports its module first: an install() there has run by now.
        self.func  # noqa: B018
        if _reporter is None:
            logger.debug(
                "gateway.integrations.rq: not installed in this process; job %s not reported", self.id
            )
            return super().perform()
        worker = self.worker_name or f"rq@{socket.gethostname()}:{os.getpid()}"
        # What an earlier run of this job left unsent goes first (its worker's main process did not take it).
        earlier = _take_pending(self.connection, self.id)
        left = [run for run in (_reporter.adopt(pending) for pending in earlier) if run is not None]
        ticket = self._ticket(_reporter)
        run = _reporter.begin(self.id, worker=worker, ticket=ticket, scheme=SCHEME, rerun=self._rerun(ticket))
        activate(run)
        try:
            result = super().perform()
        except BaseException as exc:
            if isinstance(exc, TaskCancelled):
                self.retries_left = 0  # the work is no longer wanted: RQ must not run it again
            run.fail(exc, retryable=self.should_retry)
            raise
        else:
            _report_result(self, run, result)
            return result
        finally:
            activate(None)
            run.finish()
            self._leave([*left, run])

    def _leave(self, runs: list[Run]) -> None:
        """The run is over and this horse is about to exit: what ``runs`` (the runs of this job an earlier
        horse left, then this one) have not had answered goes to the job's pending list, for the worker's
        main process (a :class:`GatewayWorker`) to send. A worker of another class has no one to send it."""
        if not _handed_over:
            if any(not run.settled.is_set() for run in runs):
                logger.warning(
                    "task-gateway: job %s ended with reports the gateway has not answered; a work horse "
                    "that exits loses them: run workers with --worker-class "
                    "gateway.integrations.rq.GatewayWorker",
                    self.id,
                )
            return
        left = [pending for pending in (run.pending() for run in runs) if pending is not None]
        if not left:
            return
        key = PENDING_KEY.format(self.id)
        try:
            with self.connection.pipeline() as pipe:
                pipe.rpush(key, *(json.dumps(pending) for pending in left))
                pipe.pexpireat(key, round(max(p["expiresAtMs"] for p in left)))
                pipe.execute()
        except Exception:  # the job's outcome is RQ's to record: a lost report must not change it
            logger.exception("task-gateway: could not leave job %s's unsent reports to its worker", self.id)

    def save_meta(self) -> None:
        """RQ's ``job.save_meta()``; in the job's run, what it saved (``job.meta`` but the integration's own
        keys) is merged into the task's metadata too: the keys that changed, and ``None`` for those gone
        since the last save. A meta that is not JSON (or past 8 KiB) is not shown (a WARNING)."""
        super().save_meta()  # type: ignore[no-untyped-call]  # rq leaves save_meta unannotated
        run = current_run()
        if run is None or run.task_id != self.id:
            return
        shown = {k: v for k, v in self.meta.items() if k not in (META, USER_ON_STOPPED)}
        before: dict[str, Any] = getattr(self, "_gateway_shown", {})
        patch = {k: v for k, v in shown.items() if before.get(k, _ABSENT) != v}
        patch.update({k: None for k in before if k not in shown})
        if not patch:
            return
        try:
            run.metadata(patch)
        except ValueError as exc:
            logger.warning("task-gateway: job %s: its meta is not shown: %s", self.id, exc)
            return
        self._gateway_shown = shown

    def _rerun(self, ticket: Ticket) -> bool:
        """Whether this is not the job's first run: RQ has used one of its retries (an exception, a horse
        killed or a job abandoned: ``retries_left`` below the ticket's attempts less one) or the job returned
        a ``Retry`` (``number_of_retries``)."""
        used = self.retries_left is not None and self.retries_left < ticket.max_attempts - 1
        return used or bool(self.number_of_retries)

    def _ticket(self, reporter: Reporter) -> Ticket:
        """The ticket :func:`enqueue` gave the job; a job enqueued otherwise gets one on its first run, with
        what its ``meta["gateway"]`` asks (as :func:`enqueue`'s ``gateway``), else the installed defaults
        and its ``Retry``'s attempts (its retries left then, plus one), kept in its meta so that every
        later run creates the same task (a retry has fewer retries left)."""
        header = self.meta.get(META)
        ticket = Ticket.from_header(header)
        if ticket is None:
            config = reporter.config
            asked = header if isinstance(header, Mapping) else {}
            tags, heartbeat_ms = requested(asked, config)
            ttl_ms = int(asked.get("ttlMs") or config.ttl_ms)
            attempts = int(asked.get("maxAttempts") or (self.retries_left or 0) + 1)
            title = titled(asked, config, self.func_name or "job", self.args or (), self.kwargs or {})
            ticket = Ticket(None, ttl_ms, attempts, heartbeat_ms, tags, title, asked_metadata(asked))
            self.meta[META] = ticket.to_header()
            self.save_meta()
        return ticket


def _report_result(job: Job, run: Run, result: Any) -> None:
    if isinstance(result, Retry):
        # The job asked to be run again (RQ's returned Retry): its own limit decides whether it will be.
        again = (job.number_of_retries or 0) < result.max
        run.fail("Retry: the job asked to be run again", retryable=again)
    else:
        run.succeed(result)


def on_stopped(job: Job, connection: Any) -> None:
    """The job's ``on_stopped`` callback (:func:`enqueue` attaches it): ``send_stop_job_command`` stopped
    it, so its gateway task is cancelled. Runs in the worker's main process, not the killed horse."""
    try:
        job.func  # noqa: B018  (imports the job's module: its install() call)
    except Exception:  # a missing function must not hide the stop
        logger.debug("gateway.integrations.rq: could not import %s", job.func_name)
    if _reporter is None:
        logger.warning(
            "gateway.integrations.rq: job %s stopped, but the gateway is not installed here", job.id
        )
    else:
        # The worker's main process: handed to the reporter's thread (retried until the task's deadline).
        _reporter.cancel(job.id, "stopped", wait=False)
    user = job.meta.get(USER_ON_STOPPED)
    if isinstance(user, str):
        import_attribute(user)(job, connection)


def _take_pending(connection: Any, job_id: str) -> list[dict[str, Any]]:
    """The reports a work horse left for ``job_id`` (taken: nobody else sends them), in their order."""
    key = PENDING_KEY.format(job_id)
    try:
        with connection.pipeline() as pipe:  # a transaction: one taker
            pipe.lrange(key, 0, -1)
            pipe.delete(key)
            raw, _ = pipe.execute()
        return [json.loads(item) for item in raw]
    except Exception:
        logger.exception("task-gateway: could not read the reports left for job %s", job_id)
        return []


class GatewayWorker(Worker):
    """RQ's forking worker, whose main process sends what a work horse could not (the gateway was down or
    slow when the job ended): ``rq worker --worker-class gateway.integrations.rq.GatewayWorker`` (with
    ``--job-class gateway.integrations.rq.GatewayJob``, its default job class). Its jobs never wait longer
    for the gateway than the configured timeout; their reports reach it once it is back, until the task's
    deadline. On a warm shutdown it waits at most that timeout for what it still holds."""

    job_class = GatewayJob

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        global _handed_over
        if kwargs.get("job_class") in (None, Job):  # ``rq worker`` passes RQ's Job when not told
            kwargs["job_class"] = GatewayJob
        super().__init__(*args, **kwargs)
        _handed_over = True
        self._adopted: list[Run] = []
        self._adopted_lock = threading.Lock()

    def execute_job(self, job: Job, queue: Queue) -> None:
        try:
            super().execute_job(job, queue)
        finally:
            self._adopt(job)

    def _adopt(self, job: Job) -> None:
        """The horse of ``job`` has exited: send what it left."""
        left = _take_pending(self.connection, job.id)
        if not left:
            return
        if _reporter is None:
            try:
                job.func  # noqa: B018  (imports the job's module: its install() call)
            except Exception:
                logger.debug("gateway.integrations.rq: could not import %s", job.func_name)
        if _reporter is None:
            logger.warning(
                "task-gateway: job %s left unsent reports, but the gateway is not installed in the worker",
                job.id,
            )
            return
        with self._adopted_lock:
            self._adopted = [run for run in self._adopted if not run.settled.is_set()]
            self._adopted += [run for run in map(_reporter.adopt, left) if run is not None]

    def teardown(self) -> None:
        if not self.is_horse and _reporter is not None:
            deadline = time.monotonic() + _reporter.config.timeout_s
            for run in self._adopted:
                run.settled.wait(max(0.0, deadline - time.monotonic()))
            unsent = sorted({run.task_id for run in self._adopted if not run.settled.is_set()})
            if unsent:
                logger.warning(
                    "task-gateway: worker %s stops with the reports of %d tasks unsent: %s",
                    self.name,
                    len(unsent),
                    ", ".join(unsent[:10]),
                )
        super().teardown()  # type: ignore[no-untyped-call]
