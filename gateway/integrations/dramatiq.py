"""Dramatiq messages reported to the gateway, by a broker middleware: each message is a gateway task of the
same id (the message id), its runs are the task's attempts.

Producer and worker install it on the broker they declare their actors with (it goes after Dramatiq's
``Retries``, whose decision it reports)::

    broker = RedisBroker(url=...)
    install(broker, url="http://127.0.0.1:8000", api_key=KEY, heartbeat=5)

    @dramatiq.actor(max_retries=2)
    def build_report(rows):
        ...; progress(40, cursor="row-400"); ...
        return "s3://reports/42.pdf"

    build_report.send_with_options(args=(rows,), gateway={"tags": ["owner:u42"]})

The mapping is Celery's (docs/integrations.md), moment by moment:

- a message's first enqueue creates the task (``maxAttempts``: ``max_retries`` + 1, the message's, else
  its actor's, else the ``Retries`` middleware's) and carries the ticket in the message's ``gateway``
  option (the user's ``tags`` and ``heartbeatMs`` go there too); a retry's enqueue creates nothing;
- a run starts an attempt (``worker``: ``dramatiq@<host>:<pid>``) before the actor is called;
- ``progress()`` reports (coalesced, never blocking);
- a return value succeeds (``resultRef``: a returned string, else ``dramatiq://<id>``);
- an exception fails: retryable when ``Retries`` will enqueue the message again, final when it gives up
  (``max_retries``, ``retry_when``, or an exception the actor ``throws``);
- a message failed before it runs (``AgeLimit``: too old) cancels the task;
- a gateway cancel makes the actor's next ``progress()`` raise ``TaskCancelled`` (add it to the actor's
  ``throws`` so that ``Retries`` does not run it again);
- a killed worker sends nothing: the Redis broker requeues its messages once its heartbeat is
  ``heartbeat_timeout`` old, RabbitMQ when its connection drops; the task's lease has requeued the
  attempt, and the next run starts a new attempt. Dramatiq has no revoke of its own: nothing maps to
  ``cancel`` but the gateway's.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from dramatiq import Broker, Middleware
from dramatiq.middleware import Retries

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
from gateway.integrations.ticket import HEADER, Titler, asked_metadata, gateway_config, requested, titled

__all__ = ["GatewayMiddleware", "current_run", "install", "message", "metadata", "progress", "write"]

logger = logging.getLogger(__name__)

SCHEME = "dramatiq"
# Dramatiq's own default (``Retries(max_retries=20)``), for a broker without the middleware.
DRAMATIQ_MAX_RETRIES = 20


class GatewayMiddleware(Middleware):
    """Creates a message's gateway task on its first enqueue and reports each run of it."""

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self._runs: dict[str, Run] = {}  # message id -> its run in this process
        self._lock = threading.Lock()

    # --- the producer ---------------------------------------------------------------------------------------

    def before_enqueue(self, broker: Broker, message: Any, delay: int | None) -> None:
        options = message.options
        ticket = Ticket.from_header(options.get(HEADER))
        if ticket is not None or "retries" in options:
            return  # a retry's (or a requeued message's) enqueue: the task exists
        config = self.reporter.config
        header = options.get(HEADER) if isinstance(options.get(HEADER), dict) else {}
        tags, heartbeat_ms = requested(header, config)
        ttl_ms = int(header.get("ttlMs") or config.ttl_ms)
        max_attempts = int(header.get("maxAttempts") or _max_retries(broker, message) + 1)
        title = titled(header, config, message.actor_name, message.args, message.kwargs)
        asked = Ticket(None, ttl_ms, max_attempts, heartbeat_ms, tags, title, asked_metadata(header))
        options[HEADER] = (self.reporter.create_ticket(message.message_id, asked) or asked).to_header()

    # --- the worker -----------------------------------------------------------------------------------------

    def before_process_message(self, broker: Broker, message: Any) -> None:
        worker = f"dramatiq@{socket.gethostname()}:{os.getpid()}"
        ticket = Ticket.from_header(message.options.get(HEADER))
        rerun = message.options.get("retries", 0) > 0  # a retry: the run before it may hold the task
        run = self.reporter.begin(
            message.message_id, worker=worker, ticket=ticket, scheme=SCHEME, rerun=rerun
        )
        with self._lock:
            self._runs[message.message_id] = run
        activate(run)  # the worker thread that calls the actor next

    def after_process_message(
        self, broker: Broker, message: Any, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        run = self._take(message)
        if run is None:
            return
        try:
            if exception is None:
                run.succeed(result)
            else:
                run.fail(exception, retryable=_will_retry(broker, message, exception))
        finally:
            run.finish()

    def after_skip_message(self, broker: Broker, message: Any) -> None:
        run = self._take(message)
        if run is not None:
            run.fail("skipped", retryable=False)
            run.finish()
        elif message.failed:
            # Failed before its run began (AgeLimit: too old to run): nothing will run it, so its task,
            # queued until now, is cancelled rather than left queued until its deadline.
            self.reporter.cancel(message.message_id, "skipped", wait=False)

    def _take(self, message: Any) -> Run | None:
        activate(None)
        with self._lock:
            return self._runs.pop(message.message_id, None)


def _will_retry(broker: Broker, message: Any, exception: BaseException) -> bool:
    """Whether ``Retries`` will enqueue the failed message again: its decision, made as it makes it
    (``throws``, ``retry_when``, ``max_retries``). Asked here, not read from ``message.failed``: Dramatiq
    calls the ``after_*`` hooks in reverse order, so this middleware (added after ``Retries``) reports
    before ``Retries`` has decided, and so before the retry it enqueues can start."""
    retries = next((m for m in broker.middleware if isinstance(m, Retries)), None)
    if retries is None:
        return False
    options = message.options
    actor = broker.actors.get(message.actor_name)
    actor_options = actor.options if actor is not None else {}
    throws = options.get("throws") or actor_options.get("throws")
    if throws and isinstance(exception, throws):
        return False
    tried = options.get("retries", 0)  # the retries before this run's
    retry_when = actor_options.get("retry_when", retries.retry_when)
    if retry_when is not None:
        return bool(retry_when(tried, exception))
    max_retries = options.get("max_retries", actor_options.get("max_retries", retries.max_retries))
    return max_retries is None or tried < max_retries


def _max_retries(broker: Broker, message: Any) -> int:
    """The retries Dramatiq allows the message: its own option, else its actor's, else ``Retries``'."""
    retries = next((m for m in broker.middleware if isinstance(m, Retries)), None)
    if retries is None:
        return 0
    value = message.options.get("max_retries")
    if value is None and message.actor_name in broker.actors:
        value = broker.get_actor(message.actor_name).options.get("max_retries")
    if value is None:
        value = retries.max_retries
    return int(value if value is not None else DRAMATIQ_MAX_RETRIES)


def install(
    broker: Broker,
    *,
    url: str,
    api_key: str | None = None,
    ttl: float | timedelta | None = None,
    timeout: float = 2.0,
    min_interval: float = 0.25,
    heartbeat: float | None = None,
    tags: Sequence[str] = (),
    title: Titler | None = None,
) -> GatewayMiddleware:
    """Report ``broker``'s messages to the gateway at ``url``: call it where the broker is made, so that it
    runs in the producer and in the worker. The options are Celery's ``install()``'s, in seconds. Returns
    the middleware (added last, after ``Retries``). An option the gateway would refuse (a heartbeat under a
    second, say) raises ``ValueError`` naming it, and adds nothing."""
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
    middleware = GatewayMiddleware(Reporter(config))
    broker.add_middleware(middleware)
    return middleware
