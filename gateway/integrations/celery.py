"""Celery tasks on the gateway, from Celery's own signals::

    from gateway.integrations.celery import install, progress
    install(app, url="http://127.0.0.1:8000", api_key=KEY)   # in the producer and in the worker

    @app.task(bind=True, max_retries=2)
    def report(self, rows):
        ...; progress(40, cursor="row-400"); ...
        return "s3://reports/42.pdf"

What each Celery moment does to the gateway task (its id is the Celery task id):

- ``before_task_publish`` (``delay``, ``apply_async``): creates it, its TTL from ``expires`` (else
  ``ttl``), ``maxAttempts`` = ``max_retries`` + 1, tags and ``heartbeatMs`` from
  ``headers={"gateway": {...}}``; the callback token rides in that header to the worker;
- ``task_prerun``: ``start`` (worker: the node's name);
- ``progress()`` in the task: ``progress``, coalesced; raises ``TaskCancelled`` once the task was cancelled;
- ``task_success``: ``succeed``, ``resultRef`` the returned string, else ``celery://<id>``, ``resultHash``
  the SHA-256 of its JSON;
- ``task_retry`` (``self.retry()``, autoretry): ``fail``, retryable: the next run starts the next attempt;
- ``task_failure``: ``fail``, final: the exception's type and message;
- ``task_revoked``: the task is cancelled (``POST .../cancel``, sent by the reporter's thread: the worker's
  main process, which takes the messages, never waits for the gateway);
- ``task_failure`` in the worker's main process (a pool process lost, its message not requeued; a hard time
  limit, whose pool process Celery terminates): ``fail``, final, unfenced (the ticket kept from
  ``task_received``), ``TimeLimitExceeded: hard time limit (<n> s) exceeded`` for the time limit; sent by
  the reporter's thread as a revoke's cancel is (never waited for);
- ``task_postrun`` of a task that raised ``Reject`` (no other signal says so): ``fail`` ``Reject: <reason>``,
  retryable when the message goes back to the queue (``requeue=True`` on an ``acks_late`` task, whose
  message is not acknowledged yet), else final; ``Ignore`` (Celery records nothing and runs it no more):
  what the task stored itself (``update_state``) in a key-value result backend (``SUCCESS``: ``succeed``,
  ``FAILURE``: a final ``fail``, ``REVOKED``: cancelled), else the task is cancelled, reason ``ignored``.
  A task that reported its outcome through its run (``current_run().succeed(...)``) keeps it.

A republished message (a retry) carries its ticket and is not created again; a redelivered one (``acks_late``
after a killed worker) starts a new attempt once the task's lease has requeued it.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from celery import Celery, Task, signals, states
from celery.backends.base import BaseKeyValueStoreBackend
from celery.exceptions import Reject, SoftTimeLimitExceeded, TimeLimitExceeded

from gateway.integrations import celery_canvas as canvas
from gateway.integrations.batch import Batch, chord_end, close_group, end_batch, group_title, open_batch
from gateway.integrations.report import (
    Reporter,
    Run,
    Ticket,
    activate,
    aprogress,
    current_run,
    message,
    metadata,
    progress,
    write,
)
from gateway.integrations.ticket import (
    HEADER,
    Titler,
    asked_metadata,
    clean_title,
    gateway_config,
    requested,
    titled,
)

__all__ = [
    "aprogress",
    "current_run",
    "install",
    "message",
    "metadata",
    "progress",
    "uninstall",
    "write",
]

log = logging.getLogger("gateway.integrations.celery")

SCHEME = "celery"
# ``maxAttempts`` of a task with ``max_retries=None`` (retried for ever): as good as unbounded.
UNBOUNDED_ATTEMPTS = 2**53
# How far up the stack the retry's error is looked for (signal dispatch, publish, apply_async, retry).
MAX_FRAMES = 30
# How many received messages' tickets a worker's main process keeps, to report a run it lost.
MAX_RECEIVED = 10_000
# How many groups' batches a producer keeps (their jobs are published one after another).
MAX_BATCHES = 1_000


def install(
    app: Celery,
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
    """Report ``app``'s tasks to the gateway at ``url``: call it where the app is made, so that it runs in
    the producer and in the worker. ``ttl`` (seconds) is a task's deadline unless its ``expires`` says (a
    day by default); ``timeout`` bounds the producer's create and any wait of a task for the gateway;
    ``min_interval`` is the least time between two progress callbacks; ``heartbeat`` (seconds) gives every
    task a lease (a killed worker's task is then requeued) and ``tags`` every task's tags, unless its
    ``headers={"gateway": {"tags": [...], "heartbeatMs": ...}}`` say otherwise; ``title(name, args,
    kwargs)`` makes a task's title (``None``: none) unless its ``gateway`` header gives one (by default its
    name and arguments, ``export_report(42)``). Returns the reporter.
    Raises ``ValueError``, connecting nothing, for an option the gateway would refuse (a heartbeat under a
    second, say)."""
    config = gateway_config(
        url=url,
        api_key=api_key,
        ttl=ttl,
        timeout=timeout,
        min_interval=min_interval,
        heartbeat=heartbeat,
        tags=tags,
        title=title,
    )
    hooks = _Hooks(app, Reporter(config))
    uid = _uid(app)
    signals.before_task_publish.connect(hooks.published, weak=False, dispatch_uid=uid)
    signals.task_received.connect(hooks.received, weak=False, dispatch_uid=uid)
    signals.task_prerun.connect(hooks.prerun, weak=False, dispatch_uid=uid)
    signals.task_success.connect(hooks.success, weak=False, dispatch_uid=uid)
    signals.task_retry.connect(hooks.retry, weak=False, dispatch_uid=uid)
    signals.task_failure.connect(hooks.failure, weak=False, dispatch_uid=uid)
    signals.task_postrun.connect(hooks.postrun, weak=False, dispatch_uid=uid)
    signals.task_revoked.connect(hooks.revoked, weak=False, dispatch_uid=uid)
    return hooks.reporter


def uninstall(app: Celery) -> None:
    """Stop reporting ``app``'s tasks (the signal handlers of its ``install()`` are disconnected)."""
    uid = _uid(app)
    for signal in SIGNALS:
        signal.disconnect(dispatch_uid=uid)


SIGNALS = (
    signals.before_task_publish,
    signals.task_received,
    signals.task_prerun,
    signals.task_success,
    signals.task_retry,
    signals.task_failure,
    signals.task_postrun,
    signals.task_revoked,
)


def _uid(app: Celery) -> str:
    return f"task-gateway-{id(app)}"


class _Hooks:
    """The signal handlers of one ``install()``; the runs of the tasks executing in this process."""

    def __init__(self, app: Celery, reporter: Reporter) -> None:
        self.app = app
        self.reporter = reporter
        self.runs: dict[str, Run] = {}
        # The tickets of the messages the worker's main process received last, by task id.
        self.received_tickets: OrderedDict[str, Ticket] = OrderedDict()
        # The batches of the groups this process published last, by group id (None: not made).
        self.batches: OrderedDict[str, Batch | None] = OrderedDict()

    def _ours(self, task: Any) -> bool:
        return isinstance(task, Task) and task.app is self.app

    # --- the producer -----------------------------------------------------------------------------------

    def published(
        self, sender: Any = None, headers: dict[str, Any] | None = None, body: Any = None, **_: Any
    ) -> None:
        if headers is None or "id" not in headers:
            return  # not a task message (protocol 1 is not supported)
        task_id = str(headers["id"])
        header = headers.get(HEADER)
        run = self.runs.get(task_id)
        if run is not None:
            # The running task retries (``self.retry()``, autoretry), republishing its message: its run
            # reports the retryable fail now, before the new message can start a run elsewhere.
            run.fail(_error(_retry_error()), retryable=True)
            run.finish()
        if Ticket.from_header(header) is not None:
            return  # a republished message: its task was created (or its run will create it)
        config = self.reporter.config
        tags, heartbeat_ms = requested(header, config)
        ttl_ms = _ttl_ms(headers.get("expires"), config.ttl_ms)
        args, kwargs, embed = canvas.message_body(body)
        name = str(headers.get("task") or sender or "task")
        batch = self._batch(headers, header, embed, tags, ttl_ms)
        asked = Ticket(
            None,
            ttl_ms,
            _max_attempts(self.app, sender),
            heartbeat_ms,
            tags,
            title=titled(header, config, name, args, kwargs),
            metadata=asked_metadata(header),
            parent=None if batch is None else batch.id,
            batch=None if batch is None else batch.to_header(),
        )
        # None (logged): the worker creates it when the task runs.
        ticket = self.reporter.create_ticket(task_id, asked) or asked
        headers[HEADER] = ticket.to_header()

    def _batch(
        self,
        headers: dict[str, Any],
        header: Any,
        embed: dict[str, Any],
        tags: tuple[str, ...],
        ttl_ms: int,
    ) -> Batch | None:
        """The batch of the group whose job is being published (``batch.py``), made with its first job; a
        chord's body brings its own (its header's producer made it); ``None`` outside a group."""
        group_id = headers.get("group")
        if not isinstance(group_id, str) or not group_id:
            return None
        header = header if isinstance(header, dict) else {}
        given = Batch.from_header(header.get("batch"))
        if given is not None:
            return given
        if group_id in self.batches:
            return self.batches[group_id]
        size, names = canvas.group_jobs(canvas.publishing_group())
        body, body_name, body_id = canvas.chord_body(embed)
        if "batchTitle" in header:
            title = clean_title(header["batchTitle"])
        else:
            title = group_title(names or [str(headers.get("task"))], size, body_name)
        asked = Ticket(None, ttl_ms, 1, None, tags, title=title, progress_from_children=True)
        made = open_batch(self.reporter, group_id, asked)
        batch = None if made is None else Batch(group_id, made.token, size, body_id)
        if batch is not None and body is not None:
            canvas.carry(body, batch)  # the body, published by a worker once the header is done, joins it
        self.batches[group_id] = batch
        while len(self.batches) > MAX_BATCHES:
            self.batches.popitem(last=False)
        return batch

    # --- the worker ---------------------------------------------------------------------------------------

    def received(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        """The worker's main process took a message: keep its ticket (a few), in case its run is lost."""
        task = getattr(request, "task", None)
        if request is None or not self._ours(task):
            return
        header = (getattr(request, "request_dict", None) or {}).get(HEADER)
        ticket = Ticket.from_header(header)
        if ticket is not None and ticket.token is not None:
            self.received_tickets[str(request.id)] = ticket
            while len(self.received_tickets) > MAX_RECEIVED:
                self.received_tickets.popitem(last=False)

    def prerun(self, sender: Any = None, task_id: str | None = None, task: Any = None, **_: Any) -> None:
        if not self._ours(task) or task_id is None:
            return
        request = task.request
        header = (request.headers or {}).get(HEADER) or getattr(request, HEADER, None)
        ticket = Ticket.from_header(header)
        worker = str(request.hostname or "celery")
        # The task goes on while its start is sent: it sees no attempt number (it has its retries), and
        # its reports go after the start anyway.
        # A redelivered message (its worker killed, say) or a retry: an earlier run may hold the task.
        rerun = bool((request.delivery_info or {}).get("redelivered")) or (request.retries or 0) > 0
        run = self.reporter.begin(
            task_id, worker=worker, ticket=ticket, scheme=SCHEME, wait=False, rerun=rerun
        )
        self.runs[task_id] = run
        activate(run)
        canvas.report_update_state(task, current_run)

    def success(self, sender: Any = None, result: Any = None, **_: Any) -> None:
        run = self._run_of(sender)
        if run is not None:
            run.succeed(result)

    def retry(self, sender: Any = None, request: Any = None, reason: Any = None, **_: Any) -> None:
        run = self.runs.get(str(getattr(request, "id", "")))
        if run is not None:
            run.fail(_error(getattr(reason, "exc", None) or reason or "Retry"), retryable=True)

    def failure(
        self, sender: Any = None, task_id: str | None = None, exception: Any = None, **_: Any
    ) -> None:
        error = _error(exception) if exception is not None else "failed"
        run = self.runs.get(str(task_id))
        if run is not None:
            run.fail(error, retryable=False)
        elif self._ours(sender) and task_id is not None:
            # No run here: the worker's main process calls a task failed whose pool process it lost (killed,
            # or past its hard time limit: billiard fails the job, Celery's Request.on_failure sends this,
            # then terminates the process) without requeueing it. Its run could not say so.
            ticket = self.received_tickets.pop(str(task_id), None)
            if ticket is not None:
                self.reporter.lost(str(task_id), ticket, error)

    def postrun(
        self,
        sender: Any = None,
        task_id: str | None = None,
        state: str | None = None,
        retval: Any = None,
        **_: Any,
    ) -> None:
        run = self.runs.pop(str(task_id), None)
        if run is None:
            return
        activate(None)
        if state is not None and state in (states.REJECTED, states.IGNORED):
            with run.lock:
                reported = run.outcome is not None
            if not reported:
                _predicate(run, sender, state, retval)
        run.finish()
        batch = Batch.from_header(run.ticket.batch if run.ticket is not None else None)
        if batch is not None:
            self._batch_job_ended(run, batch)

    def _batch_job_ended(self, run: Run, batch: Batch) -> None:
        """A job of a batch ended, its outcome taken by the gateway (else the parent is left to its
        deadline): a chord's body (or a header job's final failure) ends the parent; a group's parent ends
        once the gateway counts the whole group ended."""
        with run.lock:
            outcome, taken = run.outcome, run.ended and run.inflight is None
        if not taken:
            return
        if batch.body is not None:
            event = chord_end(batch, run.task_id, outcome)
            if event is not None:
                end_batch(self.reporter, batch, event)
        else:
            close_group(self.reporter, batch)

    def revoked(
        self,
        sender: Any = None,
        request: Any = None,
        terminated: bool = False,
        expired: bool = False,
        **_: Any,
    ) -> None:
        """Revoked: the gateway task is cancelled. An expired message is left to the gateway, whose task
        has the same deadline. This runs in the worker's main process, the one taking messages: the cancel
        is handed to the reporter's sender thread (retried until the task's deadline), never waited for."""
        if expired or request is None or (sender is not None and not self._ours(sender)):
            return
        task_id = str(request.id)
        ticket = self.received_tickets.get(task_id)
        deadline_ms = time.time() * 1000 + ticket.ttl_ms if ticket is not None else None
        reason = "revoked (terminated)" if terminated else "revoked"
        self.reporter.cancel(task_id, reason, wait=False, deadline_ms=deadline_ms)

    def _run_of(self, task: Any) -> Run | None:
        if not self._ours(task):
            return None
        return self.runs.get(str(task.request.id))


def _predicate(run: Run, task: Any, state: str, exc: Any) -> None:
    """The task raised ``Reject`` or ``Ignore``, after which Celery sends no signal of an outcome, and its run
    reported none itself.

    ``Reject``: Celery rejects the message, which goes back to the queue (``requeue=True``, on an
    ``acks_late`` task: another's message was acknowledged when its run began, and is gone) to run again:
    a retryable ``fail``, the next run the next attempt; else it is dead-lettered (or dropped): a final
    ``fail``. ``Ignore``: Celery acknowledges the message and records nothing: the task says it took its
    state in hand. What it stored itself (``self.update_state(state=SUCCESS, meta=...)``, Celery's own
    example) ends the gateway task the same way; nothing stored (or no result backend to read it from
    cheaply): nothing will run it again, and it is cancelled, reason ``ignored``."""
    if state == states.REJECTED:
        reason = getattr(exc, "reason", None)
        requeued = isinstance(exc, Reject) and bool(exc.requeue) and bool(getattr(task, "acks_late", False))
        run.fail("Reject" if reason is None else f"Reject: {reason}", retryable=requeued)
        return
    meta = _stored(task, run.task_id)
    status = meta.get("status") if meta is not None else None
    if meta is not None and status == states.SUCCESS:
        run.succeed(meta.get("result"))
    elif meta is not None and status == states.FAILURE:
        result = meta.get("result")
        run.fail(
            _error(result) if isinstance(result, BaseException) else f"FAILURE: {result}", retryable=False
        )
    elif status == states.REVOKED:
        run.cancel("revoked")
    else:
        run.cancel("ignored")


def _stored(task: Any, task_id: str) -> dict[str, Any] | None:
    """What the task stored as its state in its result backend, when that is a key-value store (Redis,
    Memcached, a filesystem, ...): one read. ``None`` for others (an RPC backend's states are messages to
    the caller, not for the worker to read) and when it cannot be read."""
    backend = getattr(task, "backend", None)
    if not isinstance(backend, BaseKeyValueStoreBackend):
        return None
    try:
        meta = backend.get_task_meta(task_id, cache=False)
    except Exception as exc:  # the backend's trouble: the task is then taken as having stored nothing
        log.warning("task-gateway: could not read the stored state of task %s: %s", task_id, exc)
        return None
    return meta if isinstance(meta, dict) else None


def _error(exc: Any) -> Any:
    """``exc`` as the gateway's ``error`` is to say it: Celery's time limits in words (their text is their
    repr, ``TimeLimitExceeded(5,)``), any other error as it is."""
    if isinstance(exc, TimeLimitExceeded):
        limit = exc.args[0] if exc.args else None
        within = "" if limit is None else f" ({limit} s)"
        return f"TimeLimitExceeded: hard time limit{within} exceeded"
    if isinstance(exc, SoftTimeLimitExceeded):
        return "SoftTimeLimitExceeded: soft time limit exceeded"
    return exc


def _retry_error() -> BaseException | str:
    """The error a task retries for, while ``Task.retry`` publishes its next message: the ``exc`` given to
    ``retry()`` (Celery passes it to no signal before the publish), else the exception being handled."""
    frame = sys._getframe(1)
    for _ in range(MAX_FRAMES):
        if frame.f_back is None:
            break
        frame = frame.f_back
        if frame.f_code.co_name == "retry" and isinstance(frame.f_locals.get("self"), Task):
            exc = frame.f_locals.get("exc")
            if isinstance(exc, BaseException):
                return exc
            break
    error = sys.exc_info()[1]
    return error if error is not None else "Retry"


def _ttl_ms(expires: Any, default_ms: int) -> int:
    """A message's ``expires`` (an ISO 8601 time, as Celery's protocol 2 carries it) as the task's TTL."""
    if isinstance(expires, str):
        try:
            when = datetime.fromisoformat(expires)
        except ValueError:
            return default_ms
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return max(1, round((when - datetime.now(UTC)).total_seconds() * 1000))
    return default_ms


def _max_attempts(app: Celery, name: Any) -> int:
    """``max_retries`` + 1 of the task named ``name`` (Celery's default where the producer does not know
    it)."""
    task = app.tasks.get(str(name)) if isinstance(name, str) else None
    retries = task.max_retries if task is not None else app.Task.max_retries
    return UNBOUNDED_ATTEMPTS if retries is None else int(retries) + 1
