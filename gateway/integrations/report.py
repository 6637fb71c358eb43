"""The run reporter every queue integration uses (Celery, RQ, arq): the producer creates the gateway task
when a job is published, and each run of the job, in whatever worker process, reports to it.

- :meth:`Reporter.create` (producer side): ``POST /v1/tasks`` with the job's id, bounded by
  ``timeout_s``; a gateway that cannot be reached costs the producer that long at most, and a WARNING says
  which task could not be created and why (the job is published anyway: its run creates the task). A
  create the gateway refuses (a 4xx: its run's would be refused too) is an ERROR: which job is not shown,
  why, and what to do.
- :meth:`Reporter.begin` (worker side): a :class:`Run` of the job, whose ``start`` goes at once (waited for
  at most ``timeout_s``); its ``progress()``, ``succeed()``, ``fail()`` never block, and ``finish()`` waits
  a bounded time. A background thread of the process (made lazily, after a fork too: a Celery prefork
  child or an RQ work horse has its own) sends everything in order with stable callback ids
  (``<task>:<attempt>:p<n>``, ``<task>:<attempt>:end``), heartbeats tasks with a lease and retries while
  the gateway is away, until the task's deadline. A run that took over an attempt another run began (a
  task without a lease, its message redelivered) puts a nonce of its own after the attempt
  (``<task>:<attempt>:<nonce>:p<n>``): the other run counted its progress from ``p1`` too, and the same id
  with another body would be taken for a repeat (``duplicate-callback``) or refused
  (``callback-id-reused``). A run's ids stay the same across its own retries.
- :meth:`Reporter.cancel` (the queue revoked or stopped a job): ``wait=False``, what the queues' handlers
  use, hands the cancel to that thread and returns at once (Celery's ``task_revoked`` runs in the worker's
  main process, which must not wait for the gateway); :meth:`Run.cancel` and :meth:`Reporter.lost` likewise.
- :meth:`Run.pending` / :meth:`Reporter.adopt`: a process about to exit with a run's reports unsent (an RQ
  work horse) hands them, as JSON, to a process that lives on (its worker), whose thread sends them.
- :func:`progress` / :func:`aprogress`: the job's one call, for the run of the job executing here;
  :func:`write` / :func:`awrite` append text to one of its task's streams (``Run.write``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import replace
from typing import Any, TypeVar

import httpx

from gateway.client.backend_wire import Call, Wire
from gateway.client.backoff import Backoff
from gateway.client.errors import BackendError
from gateway.client.retry import pause_s, retried
from gateway.integrations.outbox import Cancel, Lost
from gateway.integrations.run import Run
from gateway.integrations.sender import Sender
from gateway.integrations.ticket import DEFAULT_TTL_MS, GatewayConfig, Ticket, error_text

__all__ = [
    "DEFAULT_TTL_MS",
    "GatewayConfig",
    "Reporter",
    "Run",
    "Ticket",
    "activate",
    "amessage",
    "ametadata",
    "aprogress",
    "awrite",
    "current_run",
    "message",
    "metadata",
    "progress",
    "write",
]

log = logging.getLogger("gateway.integrations")

T = TypeVar("T")

_current: ContextVar[Run | None] = ContextVar("gateway_run", default=None)


class Reporter:
    """One per process and ``install()``: creates tasks and begins runs against ``config.url``."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        quiet_httpx()  # every install() and configure() makes one
        self._lock = threading.Lock()
        self._pid = 0
        self._sender: Sender | None = None
        self._client: httpx.Client | None = None
        self._wire = Wire(config.url, config.api_key)
        # A lock held by another thread at a fork stays held in the child: the child starts with a new one.
        os.register_at_fork(after_in_child=self._forked)

    @property
    def wire(self) -> Wire:
        """The calls of the gateway's API (management, a task's callbacks), to send with :meth:`request`."""
        return self._wire

    def _forked(self) -> None:
        self._lock = threading.Lock()

    def _here(self) -> None:
        """Forget what a parent process made (a forked child makes its own: the parent's thread did not
        survive the fork, and its connections are not the child's to use). Under ``_lock``."""
        if self._pid != os.getpid():
            self._pid = os.getpid()
            self._sender = None
            self._client = None

    def _sender_here(self) -> Sender:
        """This process's sender thread, made on its first run (a producer never makes one)."""
        with self._lock:
            self._here()
            if self._sender is None:
                self._sender = Sender(self.config)
            return self._sender

    def _client_here(self) -> httpx.Client:
        """This process's client for the producer's creates and the cancels, made on first use."""
        with self._lock:
            self._here()
            if self._client is None:
                self._client = httpx.Client(timeout=self.config.timeout_s)
            return self._client

    def create(
        self,
        task_id: str,
        *,
        ttl_ms: int,
        max_attempts: int,
        heartbeat_ms: int | None,
        tags: Sequence[str],
        title: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        parent: str | None = None,
        progress_from_children: bool = False,
    ) -> Ticket | None:
        """Create the gateway task of a job being published, within ``timeout_s`` (a repeated create with
        the same parameters is the gateway's ``200``, so a try whose answer was lost is tried again). The
        ticket the job's message carries, or ``None`` (logged) when the task could not be created."""
        asked = Ticket(None, ttl_ms, max_attempts, heartbeat_ms, tuple(tags), title, metadata, parent)
        asked = replace(asked, progress_from_children=progress_from_children)
        return self.create_ticket(task_id, asked)

    def create_ticket(self, task_id: str, asked: Ticket) -> Ticket | None:
        """:meth:`create` with the parameters ``asked`` holds: ``asked`` with the callback token, or
        ``None`` (logged) when the task could not be created."""
        call = self._wire.create(task_id, **asked.create_options())
        try:
            created = self._within(f"create task {task_id}", call)
        except BackendError as refused:
            log.error(
                "task-gateway: job %s is not shown on the gateway: the gateway refused to create its task "
                "(%s %s: %s); the job runs all the same, unreported. %s",
                task_id,
                refused.status,
                refused.code,
                refused.message,
                _remedy(refused.code),
            )
            return None
        if created is None:
            return None
        return replace(asked, token=created.callback_token)

    def request(self, what: str, call: Call[T]) -> T | None:
        """``call`` sent as :meth:`create` sends (within ``timeout_s``, retried); its answer, or ``None``
        with a WARNING that says what could not be done; a refusal raises its :class:`BackendError`."""
        return self._within(what, call)

    def cancel(
        self,
        task_id: str,
        reason: str | None = None,
        *,
        wait: bool = True,
        deadline_ms: float | None = None,
    ) -> dict[str, Any] | None:
        """Cancel the gateway task of a job the queue revoked, within ``timeout_s``; the answer, or ``None``
        (logged) when the gateway could not be told. ``wait`` false: returns ``None`` at once, the cancel
        handed to this process's sender thread, which tries it (with backoff) until it is answered or
        ``deadline_ms`` (epoch ms; by default ``ttl_ms`` from now, a bound on the task's deadline) passes."""
        if not wait:
            if deadline_ms is None:
                deadline_ms = time.time() * 1000 + self.config.ttl_ms
            self._sender_here().add(Cancel(task_id, reason, deadline_ms))
            return None
        try:
            return self._within(f"cancel task {task_id}", self._wire.cancel(task_id, reason))
        except BackendError as refused:
            log.warning("task-gateway: could not cancel task %s: %s", task_id, refused)
            return None

    def _cancel_run(self, run: Run, reason: str | None) -> None:
        """:meth:`Run.cancel`: after the run's start, until the task's deadline, without waiting."""
        self._sender_here().add(Cancel(run.task_id, reason, run.expires_at_ms, after=run))

    def lost(self, task_id: str, ticket: Ticket, error: BaseException | str) -> None:
        """The queue gave up a job whose run could not report its end (its process was killed, or a hard
        time limit ended it) and calls it failed: fail the task for good (no run, so no attempt to fence
        with); a task its lease has requeued meanwhile is cancelled, saying why. Never blocks (Celery calls
        it in the worker's main process): handed to this process's sender thread, tried until the task's
        deadline (``ttl_ms`` from now, a bound on it)."""
        if ticket.token is None:
            return
        deadline_ms = time.time() * 1000 + ticket.ttl_ms
        self._sender_here().add(Lost(task_id, ticket.token, error_text(error), deadline_ms))

    def adopt(self, pending: Mapping[str, Any]) -> Run | None:
        """Send, from this process, what a run in another process left unsent (its :meth:`Run.pending`):
        in its order, with its ids, until the task's deadline. ``None`` (and nothing sent) when that has
        passed."""
        if time.time() * 1000 >= float(pending["expiresAtMs"]):
            log.warning(
                "task-gateway: task %s passed its deadline; dropping the reports handed over",
                pending.get("taskId"),
            )
            return None
        sender = self._sender_here()
        run = Run(
            str(pending["taskId"]),
            worker=str(pending["worker"]),
            ticket=Ticket.from_header(pending.get("ticket")),
            scheme=str(pending["scheme"]),
            config=self.config,
            wake=sender.wake,
            cancel=self._cancel_run,
        )
        run.resume(pending)
        sender.add(run)
        return run

    def _within(self, what: str, call: Call[T]) -> T | None:
        """``call``'s answer, tried again as :mod:`gateway.client.retry` says (transport errors, 5xx, 429,
        after the backoff and at least a Retry-After) until ``timeout_s`` has passed, each try bounded by
        what is left; ``None``, with a WARNING saying what could not be done and why, when there is no answer
        by then. A refusal (a 4xx) raises its :class:`BackendError`."""
        client = self._client_here()
        deadline = time.monotonic() + self.config.timeout_s
        why, backoff = "no answer", Backoff(base_s=0.05, cap_s=0.5)
        while (left := deadline - time.monotonic()) > 0:
            request = call.request(client)
            request.extensions["timeout"] = httpx.Timeout(left).as_dict()
            retry_after = None
            try:
                response = client.send(request)
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                if not retried(response.status_code):
                    return call.answer(response)
                why, retry_after = f"HTTP {response.status_code}", response.headers.get("retry-after")
            pause = pause_s(backoff, retry_after)
            time.sleep(min(pause, max(0.0, deadline - time.monotonic())))  # the backoff itself
        log.warning("task-gateway: could not %s: %s (timeout %ss)", what, why, self.config.timeout_s)
        return None

    def begin(
        self,
        task_id: str,
        *,
        worker: str,
        ticket: Ticket | None,
        scheme: str,
        wait: bool = True,
        rerun: bool = False,
    ) -> Run:
        """A run of the job ``task_id`` (``worker``: the node's name; ``scheme``: the queue's, for results
        referred to by id). Its ``start`` is sent now and waited for at most ``timeout_s`` (``wait``
        false: not at all, the job going on while it is sent; ``attempt`` is then known later); without a
        ticket (or a token in it) the task is created first. Either way, what the run reports goes after
        its start.

        ``rerun``: the queue runs the job again (a redelivered message, a retry, a job abandoned by a killed
        worker). On a task with a lease such a run reads the task first and, while a run before it still
        holds it (killed: nobody will end it but its lease), waits for the lease to requeue it before it
        starts, rather than start at once: a start answered ``already-running`` renews the lease, and the
        dead run's attempt would live one lease longer. A first run starts at once."""
        sender = self._sender_here()
        run = Run(
            task_id,
            worker=worker,
            ticket=ticket,
            scheme=scheme,
            config=self.config,
            wake=sender.wake,
            cancel=self._cancel_run,
            rerun=rerun,
        )
        sender.add(run)
        if wait:
            run.started.wait(self.config.timeout_s)
        return run


# What to do about a refused create, by the gateway's error code (protocol.md, Errors).
_REMEDIES = {
    "invalid-request": "Correct the value it names, in the job's gateway options or in install()'s.",
    "unauthorized": "Give install() the gateway's API key (api_key=, the gateway's GATEWAY_API_KEY).",
    "forbidden": "Give install() the gateway's API key (api_key=, the gateway's GATEWAY_API_KEY).",
    "task-exists": "A task of this id exists, made with other parameters: give each job an id of its own.",
}


def _remedy(code: str) -> str:
    return _REMEDIES.get(code, "See the gateway's error codes (docs/protocol.md, Errors).")


def quiet_httpx() -> None:
    """httpx logs each request at INFO (the ``httpx`` logger): a worker run at ``--loglevel INFO`` would log a
    line per progress callback and heartbeat. Set that logger to WARNING, unless its level was chosen
    (anything but ``NOTSET``): the user's choice stands, whenever it was made."""
    logger = logging.getLogger("httpx")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


def current_run() -> Run | None:
    """The run of the job executing in this thread (or asyncio task), if any."""
    return _current.get()


def activate(run: Run | None) -> None:
    """Make ``run`` the current run here (``None``: none); the integrations call it around a job."""
    _current.set(run)


def progress(value: int, cursor: str = "") -> None:
    """Report the current job's progress (0 to 100, ``cursor``: its bookmark). Never blocks; outside a run
    it does nothing (logged at DEBUG). Raises :class:`~gateway.client.TaskCancelled` once the task was
    cancelled on the gateway."""
    run = _current.get()
    if run is None:
        log.debug("task-gateway: progress(%s) outside a reported job: ignored", value)
        return
    run.progress(value, cursor)


async def aprogress(value: int, cursor: str = "") -> None:
    """:func:`progress` for async jobs (arq): as non-blocking."""
    progress(value, cursor)


def write(name: str, text: str) -> None:
    """Append ``text`` to the current job's stream ``name`` (:meth:`Run.write`: buffered, never blocks).
    Outside a run it does nothing (logged at DEBUG). Raises :class:`~gateway.client.TaskCancelled` once the
    task was cancelled, :class:`~gateway.client.AttemptOver` once it went on without this run."""
    run = _current.get()
    if run is None:
        log.debug("task-gateway: write(%r) outside a reported job: ignored", name)
        return
    run.write(name, text)


async def awrite(name: str, text: str) -> None:
    """:func:`write` for async jobs (arq): as non-blocking."""
    write(name, text)


def metadata(patch: Mapping[str, Any]) -> None:
    """Merge ``patch`` into the current job's task metadata (:meth:`Run.metadata`: never blocks, sent in
    order after its progress, before its outcome). Outside a run it does nothing (logged at DEBUG). Raises
    :class:`~gateway.client.TaskCancelled` once the task was cancelled, ``ValueError`` for a patch that is
    not a JSON object of at most 8 KiB."""
    run = _current.get()
    if run is None:
        log.debug("task-gateway: metadata() outside a reported job: ignored")
        return
    run.metadata(patch)


def message(text: str) -> None:
    """The current job's status line, ``metadata.message`` (shown under its progress bar):
    ``metadata({"message": text})``."""
    run = _current.get()
    if run is None:
        log.debug("task-gateway: message(%r) outside a reported job: ignored", text)
        return
    run.message(text)


async def ametadata(patch: Mapping[str, Any]) -> None:
    """:func:`metadata` for async jobs (arq): as non-blocking."""
    metadata(patch)


async def amessage(text: str) -> None:
    """:func:`message` for async jobs (arq): as non-blocking."""
    message(text)
