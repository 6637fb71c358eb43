"""arq jobs reported to the gateway: each job is a gateway task of the same id, its tries are the task's
attempts.

The producer enqueues with :func:`enqueue_job` (after :func:`configure`); the worker's settings are
installed once, where they are defined::

    class WorkerSettings:
        functions = [build_report]
        allow_abort_jobs = True          # so that Job.abort() cancels the gateway task
    install(WorkerSettings, url="http://127.0.0.1:8000", api_key=KEY, heartbeat=5)

    async def build_report(ctx, rows):
        ...; await progress(40, cursor="row-400"); ...
        return "s3://reports/42.pdf"

    configure(url="http://127.0.0.1:8000", api_key=KEY)             # the producer
    await enqueue_job(redis, "build_report", rows, _gateway={"tags": ["owner:u42"], "maxAttempts": 3})

The mapping is Celery's (docs/integrations.md), moment by moment:

- ``enqueue_job`` creates the task (id: the job's id; ``maxAttempts``: the ``_gateway`` option, else arq's
  default ``max_tries`` of 5: say it when the function has its own) and carries the ticket in the job's
  keyword arguments (``_gateway_ticket``, taken out before the function is called);
- a try starts an attempt (``worker``: ``arq@<host>:<pid>``) as the function begins;
- ``await progress()`` reports (coalesced, never blocking the loop);
- a return value succeeds (``resultRef``: a returned string, else ``arq://<id>``);
- ``raise Retry`` fails retryable (the next try starts the next attempt), as does a try cancelled by a
  worker's shutdown that arq runs again, except on the function's last try (``max_tries``: arq will not
  run it again); any other exception fails for good;
- ``Job.abort()`` cancels the task (a job aborted before its first try starts runs no hook, so its task
  stays queued until its deadline); arq's time limit (``timeout``) fails the task for good, with
  ``TimeoutError`` (both cancel the try: arq's stored result tells them apart, so a worker with
  ``keep_result = 0`` reports a timed-out try as an abort);
- a gateway cancel makes the job's next ``progress()`` raise ``TaskCancelled``;
- a killed worker sends nothing: arq runs the job again once its in-progress key expires; by then the
  task's heartbeat lease has requeued the attempt, and the new try starts a new attempt.

How: :func:`install` wraps each function, which begins the run as the try starts (rather than an
``on_job_start`` hook: arq's hooks see neither a job's arguments, where its ticket is, nor its outcome), and
chains an ``after_job_end`` hook: that runs after arq has recorded what it did with the job, so it reports
what the queue decided (the job kept to run again, or ended) rather than guessing it from the exception.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any
from uuid import uuid4

from arq.connections import ArqRedis
from arq.constants import job_key_prefix
from arq.jobs import Job
from arq.worker import Function, func

from gateway.integrations.report import (
    Reporter,
    Run,
    Ticket,
    activate,
    amessage,
    ametadata,
    aprogress,
    awrite,
    current_run,
)
from gateway.integrations.ticket import Titler, asked_metadata, gateway_config, requested, titled

__all__ = [
    "configure",
    "current_run",
    "enqueue_job",
    "install",
    "message",
    "metadata",
    "progress",
    "write",
]

logger = logging.getLogger(__name__)

progress = aprogress  # ``await progress(40, cursor=...)`` inside a job
write = awrite  # ``await write("output", text)`` inside a job
metadata = ametadata  # ``await metadata({"rows": 400})`` inside a job
message = amessage  # ``await message("Rendering page 3 of 12")`` inside a job
SCHEME = "arq"
# The job's keyword argument that carries the ticket (the ``gateway`` header of Celery's messages).
TICKET_KWARG = "_gateway_ticket"
# arq's own default (``Worker(max_tries=5)``): a task's maxAttempts when the producer says none.
ARQ_MAX_TRIES = 5
# What a job's ctx holds for the after_job_end hook: its run, how the function ended, and its max_tries.
_RUN = "gateway_run"
_OUTCOME = "gateway_outcome"
_MAX_TRIES = "gateway_max_tries"
# Marks settings install() has wrapped.
_INSTALLED = "gateway_installed"

_reporter: Reporter | None = None

Hook = Callable[[dict[str, Any]], Awaitable[Any]]


def configure(
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
    """Report this process's arq jobs to the gateway at ``url``; the producer calls it, :func:`install`
    calls it for a worker. The options are Celery's ``install()``'s, in seconds: ``ttl`` (a task's
    deadline, a day by default), ``timeout`` (the bound on the producer's create and on any wait of a job
    for the gateway, off the event loop), ``min_interval`` (between two progress callbacks), ``heartbeat``
    (every task's lease, unless its ``_gateway`` option says), ``tags``. Returns the reporter (one per
    process). An option the gateway would refuse (a heartbeat under a second, say) raises ``ValueError``
    naming it, and configures nothing (:func:`install` then wraps nothing)."""
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
        raise RuntimeError("gateway.integrations.arq: call configure(url=...) or install(...) first")
    return _reporter


def install(settings: Any, **options: Any) -> Reporter:
    """Make a worker's settings (the ``WorkerSettings`` class, or a dict of ``Worker`` keyword arguments)
    report its jobs: every function is wrapped and an ``after_job_end`` hook is chained after the user's
    own. ``options``: :func:`configure`'s. Call it where the settings are defined; jobs that
    :func:`enqueue_job` published carry a keyword argument that only an installed worker takes out."""
    reporter = configure(**options)

    def get(name: str) -> Any:
        return settings.get(name) if isinstance(settings, dict) else getattr(settings, name, None)

    def put(name: str, value: Any) -> None:
        if isinstance(settings, dict):
            settings[name] = value
        else:
            setattr(settings, name, value)

    if not get(_INSTALLED):  # installed once: a second install() only configures again
        max_tries = get("max_tries") or ARQ_MAX_TRIES  # the worker's, for functions without their own
        put("functions", [_wrapped(f, max_tries) for f in get("functions") or ()])
        put("after_job_end", _after_job_end(get("after_job_end")))
        put(_INSTALLED, True)
    return reporter


async def enqueue_job(
    redis: ArqRedis, function: str, *args: Any, _gateway: Mapping[str, Any] | None = None, **kwargs: Any
) -> Job | None:
    """``redis.enqueue_job(function, *args, **kwargs)`` as a gateway task, created first (within the
    configured timeout, off the event loop; when it cannot be, a WARNING says so and the job is enqueued
    anyway, and its first try creates the task) with the job's id (``_job_id``, else a fresh one).
    ``_gateway`` takes ``tags``, ``heartbeatMs``, ``ttlMs``, ``maxAttempts``, ``title`` and ``metadata``
    (the title is by default the function's name and arguments). Returns arq's answer
    (``None``: a job with this id exists already)."""
    reporter = _installed()
    config = reporter.config
    options = dict(_gateway or {})
    job_id = kwargs.pop("_job_id", None) or uuid4().hex
    tags, heartbeat_ms = requested(options, config)
    shown = {k: v for k, v in kwargs.items() if not k.startswith("_")}  # arq's own options start with _
    ticket = Ticket(
        token=None,
        ttl_ms=int(options.get("ttlMs") or config.ttl_ms),
        max_attempts=int(options.get("maxAttempts") or ARQ_MAX_TRIES),
        heartbeat_ms=heartbeat_ms,
        tags=tags,
        title=titled(options, config, function, args, shown),
        metadata=asked_metadata(options),
    )
    created = await asyncio.to_thread(reporter.create_ticket, job_id, ticket)
    kwargs[TICKET_KWARG] = (created or ticket).to_header()
    job: Job | None = await redis.enqueue_job(function, *args, _job_id=job_id, **kwargs)
    return job


def _wrapped(function: Any, worker_max_tries: int) -> Function:
    """An arq function (a coroutine function or ``arq.func(...)``) whose every try is a run
    (``worker_max_tries``: the worker's ``max_tries``, which a function without its own has)."""
    f: Function = function if isinstance(function, Function) else func(function)
    coroutine = f.coroutine
    max_tries = f.max_tries if f.max_tries is not None else worker_max_tries

    @functools.wraps(coroutine)
    async def reported(ctx: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        header = kwargs.pop(TICKET_KWARG, None)
        reporter = _installed()
        config = reporter.config
        # A job enqueued without enqueue_job() carries no ticket: its task is made with the function's
        # max_tries as its attempts (not 1, which would end it at arq's first Retry).
        ticket = Ticket.from_header(header) or Ticket(
            None,
            config.ttl_ms,
            max_tries,
            config.heartbeat_ms,
            config.tags,
            title=titled({}, config, f.name, args, kwargs),
        )
        worker = f"arq@{socket.gethostname()}:{os.getpid()}"
        ctx[_MAX_TRIES] = max_tries
        begun = asyncio.ensure_future(
            asyncio.to_thread(
                reporter.begin,
                ctx["job_id"],
                worker=worker,
                ticket=ticket,
                scheme=SCHEME,
                rerun=ctx.get("job_try", 1) > 1,  # a Retry, a shutdown's cut, a killed worker's job
            )
        )
        # The hook takes the run from here even when the try is cancelled (an abort, arq's time limit)
        # while its start is on its way: that run has begun, and must report how the try ended.
        ctx[_RUN] = begun
        try:
            run = await asyncio.shield(begun)
        except asyncio.CancelledError as exc:
            ctx[_OUTCOME] = exc
            raise
        activate(run)  # in this try's own asyncio task: its context is its own
        try:
            result = await coroutine(ctx, *args, **kwargs)
        except BaseException as exc:
            ctx[_OUTCOME] = exc
            raise
        else:
            ctx[_OUTCOME] = _Returned(result)
            return result
        finally:
            activate(None)

    return Function(f.name, reported, f.timeout_s, f.keep_result_s, f.keep_result_forever, f.max_tries)


class _Returned:
    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def _after_job_end(user: Hook | None) -> Hook:
    async def after_job_end(ctx: dict[str, Any]) -> None:
        run = await _begun(ctx.pop(_RUN, None))
        if run is not None:
            try:
                await _report(ctx, run, ctx.pop(_OUTCOME, None))
            finally:
                await asyncio.to_thread(run.finish)
        if user is not None:
            await user(ctx)

    return after_job_end


async def _begun(begun: Any) -> Run | None:
    """The run a try began (``None``: not one of ours), once its ``begin`` is over (it is bounded by
    ``timeout_s``)."""
    if not isinstance(begun, asyncio.Future):
        return None
    try:
        run = await begun
    except Exception:  # the reporter failed: there is nothing to report to
        logger.exception("gateway.integrations.arq: a run could not begin")
        return None
    return run if isinstance(run, Run) else None


async def _report(ctx: dict[str, Any], run: Run, outcome: Any) -> None:
    """Report how the try ended, as arq has just recorded it."""
    if isinstance(outcome, _Returned):
        run.succeed(outcome.value)
        return
    redis: ArqRedis = ctx["redis"]
    if await redis.exists(job_key_prefix + ctx["job_id"]):
        # arq kept the job to run again (Retry, or a try cancelled by the worker's shutdown); after its last
        # try, though, arq fails it for good when it next takes it, without a try or a hook: final now.
        again = ctx.get("job_try", 1) < ctx.get(_MAX_TRIES, ARQ_MAX_TRIES)
        run.fail(outcome if isinstance(outcome, BaseException) else "the try ended", retryable=again)
        return
    if isinstance(outcome, asyncio.CancelledError):
        # Cancelled and ended: Job.abort(), or the function's timeout (arq's wait_for cancels it too).
        info = await Job(ctx["job_id"], redis).result_info()
        if info is not None and isinstance(info.result, TimeoutError):
            run.fail(info.result, retryable=False)
        else:
            # Run.cancel hands the request to the reporter's thread; off the loop all the same, so that no
            # Run (a test's stand-in, a subclass) that does wait can hold it.
            await asyncio.to_thread(run.cancel, "aborted")
        return
    run.fail(outcome if isinstance(outcome, BaseException) else "the try ended", retryable=False)
