"""``Run``: one run of one job, as the job's own code sees it; what it has asked to report waits here for the
reporter's sender thread (``sender.py``).

The job's side never does I/O: ``progress()`` is a lock and an assignment (the latest value replaces one the
sender has not taken yet: coalescing), ``succeed``/``fail`` leave the outcome, and only ``finish()`` waits,
for a bounded time, for the sender to have said everything. The sender's side (the fields below the line)
is touched by the sender thread alone.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from gateway.client.errors import TaskCancelled
from gateway.integrations.ticket import GatewayConfig, Ticket, error_text, result_hash, result_ref

# A run's phases on the sender's side.
CREATE = "create"  # no callback token: the worker creates the task first
START = "start"  # send ``start``
# A run that is not its job's first (redelivered, retried: ``rerun``), or whose start was answered
# ``already-running``: read the task and, while an earlier run holds it, wait (without a start, which would
# renew that run's lease) for the lease to requeue it.
WAIT = "wait"
RUNNING = "running"  # progress, the outcome, heartbeats
OVER = "over"  # nothing more will be sent


class Run:
    """One run of a job: reports its progress and outcome to the gateway task ``task_id``.

    ``attempt`` is the attempt its ``start`` began (``None`` until the gateway has answered it)."""

    def __init__(
        self,
        task_id: str,
        *,
        worker: str,
        ticket: Ticket | None,
        scheme: str,
        config: GatewayConfig,
        wake: Callable[[], None],
        cancel: Callable[[Run, str | None], Any],
        rerun: bool = False,
    ) -> None:
        self.task_id = task_id
        self.attempt: int | None = None
        self.worker = worker
        self.ticket = ticket
        self.scheme = scheme
        self.config = config
        self._wake = wake
        self._cancel = cancel
        self.lock = threading.Lock()
        # Left by the job, taken by the sender (under ``lock``).
        self.latest: tuple[int, str] | None = None
        self.outcome: dict[str, Any] | None = None
        self.finished = False
        # Set by the sender.
        self.cancelled: TaskCancelled | None = None
        self.started = threading.Event()  # start answered (or given up)
        self.settled = threading.Event()  # nothing left to send
        self.unreachable = False  # the last request did not reach the gateway (or it answered 5xx)
        # --- the sender's side ------------------------------------------------------------------------------
        # Not the job's first run: an earlier one (killed?) may still hold the task, its lease running.
        self.rerun = rerun
        self.token = ticket.token if ticket is not None else None
        self.phase = CREATE if self.token is None else self.first_phase()
        self.start_id = str(uuid.uuid4())  # fresh per start: a redelivered run is a new attempt
        self.running_attempt: int | None = None  # the attempt another run holds (WAIT; None: not read yet)
        # Set when this run took over an attempt another run began (a task without a lease): its callback
        # ids then carry it, so that they are not that run's (whose own progress counted from p1 too).
        self.nonce: str | None = None
        ttl_ms = ticket.ttl_ms if ticket is not None else config.ttl_ms
        self.expires_at_ms = time.time() * 1000 + ttl_ms  # the task's deadline, bounded above until known
        self.heartbeat_ms: int | None = None
        self.renewed_at = 0.0  # monotonic: when a request that renewed the lease was sent
        self.progress_at = -1e9  # monotonic: when the last progress callback was taken
        self.sent = 0  # progress callbacks taken in this attempt
        self.last_sent: tuple[int, str] | None = None  # the value and cursor of the last
        self.asked = False  # a repeated progress came since the last request
        self.contact_at = 0.0  # monotonic: when the last request answered was sent
        self.inflight: tuple[str, dict[str, Any]] | None = None  # (callback id, event) being sent
        self.ended = False  # the outcome was taken
        self.retry_at = 0.0  # monotonic: no request before
        self.failures = 0
        self.handed = False  # given to another process (pending()): this one sends nothing more of it

    def first_phase(self, heartbeat_ms: int | None = None) -> str:
        """The phase after the task is known to exist: ``START``, or ``WAIT`` for a rerun of a task with a
        lease (``heartbeat_ms``, else the ticket's), which reads the task before it starts: a start answered
        ``already-running`` would renew the lease of the run before it (killed, say), which would then hold
        the task one lease longer. A task without a lease has nothing to wait for (its start takes the
        attempt over), and a first run starts at once (no extra request)."""
        if heartbeat_ms is None and self.ticket is not None:
            heartbeat_ms = self.ticket.heartbeat_ms
        return WAIT if self.rerun and heartbeat_ms is not None else START

    def __repr__(self) -> str:
        return f"<Run {self.task_id} attempt {self.attempt} {self.phase}>"

    # --- the job's side -------------------------------------------------------------------------------------

    def progress(self, value: int, cursor: str = "") -> None:
        """Report ``value`` (0 to 100; ``cursor``: the job's bookmark). Never blocks: at most one callback
        goes per ``min_interval_s`` and the latest value is the one sent. Raises
        :class:`~gateway.client.TaskCancelled` once the gateway has said the task was cancelled."""
        if self.cancelled is not None:
            raise self.cancelled
        if not 0 <= value <= 100:
            raise ValueError(f"progress must be from 0 to 100, not {value!r}")
        with self.lock:
            taken = self.latest is None
            self.latest = (value, cursor)
        if taken:  # the sender may be asleep with nothing to do: tell it
            self._wake()

    def succeed(self, value: Any) -> None:
        """The job returned ``value``: ``resultRef`` is a returned string, else ``<scheme>://<task id>``;
        ``resultHash`` the SHA-256 of its JSON. Sent after the latest progress."""
        event = {
            "type": "succeed",
            "resultRef": result_ref(value, self.scheme, self.task_id),
            "resultHash": result_hash(value),
        }
        self._end(event)

    def fail(self, error: BaseException | str, *, retryable: bool) -> None:
        """The job failed: ``retryable`` when the queue will run it again (the gateway requeues the task
        while it has attempts left)."""
        self._end({"type": "fail", "error": error_text(error), "retryable": retryable})

    def _end(self, event: dict[str, Any]) -> None:
        with self.lock:
            if self.outcome is None:
                self.outcome = event
        self._wake()

    def cancel(self, reason: str | None = None) -> None:
        """The queue revoked the job: cancel its gateway task (the API key's ``POST .../cancel``). Never
        blocks: the sender sends it once this run's start is answered (the task made first, if the run makes
        it), retried like the run's callbacks until the task's deadline."""
        self._cancel(self, reason)

    def finish(self) -> None:
        """The run is over. Waits, at most ``timeout_s`` and not at all while the gateway cannot be reached,
        for what it reported to be answered; the rest is sent in the background until the task's deadline."""
        with self.lock:
            self.finished = True
        self._wake()
        if not self.unreachable:
            self.settled.wait(self.config.timeout_s)

    # --- another process takes over ------------------------------------------------------------------------

    def pending(self) -> dict[str, Any] | None:
        """What this finished run has not had answered yet, for another process to send (an RQ work horse
        exits after its job: its worker's main process sends the rest, :meth:`Reporter.adopt`); ``None``
        when nothing is left. From now on this process's sender sends nothing more of the run (a request
        on its way may still arrive: every callback id but the start's is stable, and the start's is handed
        over with it, so a repeat changes nothing). JSON-able: the callback token, the attempt, the ids and
        the deadline go with it."""
        with self.lock:
            self.handed = True
            if self.phase == OVER or (self.ended and self.inflight is None):
                return None
            if (
                self.phase == RUNNING
                and self.inflight is None
                and self.latest is None
                and self.outcome is None
            ):
                return None
            return {
                "taskId": self.task_id,
                "worker": self.worker,
                "scheme": self.scheme,
                "ticket": self.ticket.to_header() if self.ticket is not None else None,
                "token": self.token,
                "phase": self.phase,
                "startId": self.start_id,
                "attempt": self.attempt,
                "nonce": self.nonce,
                "runningAttempt": self.running_attempt,
                "expiresAtMs": self.expires_at_ms,
                "heartbeatMs": self.heartbeat_ms,
                "sent": self.sent,
                "lastSent": self.last_sent,
                "latest": self.latest,
                "inflight": self.inflight,
                "outcome": self.outcome,
                "ended": self.ended,
                "rerun": self.rerun,
            }

    def resume(self, pending: Mapping[str, Any]) -> None:
        """Take up where the run ``pending`` (:meth:`pending`, in another process) stopped: a finished run
        whose remaining callbacks go with their ids, in their order."""

        def pair(value: Any) -> tuple[Any, Any] | None:
            return None if value is None else (value[0], value[1])

        with self.lock:
            self.finished = True
            self.latest = pair(pending.get("latest"))
            self.outcome = pending.get("outcome")
            self.token = pending.get("token")
            self.phase = str(pending["phase"])
            self.start_id = str(pending["startId"])
            self.attempt = pending.get("attempt")
            self.nonce = pending.get("nonce")
            self.running_attempt = pending.get("runningAttempt")
            self.expires_at_ms = float(pending["expiresAtMs"])
            self.heartbeat_ms = pending.get("heartbeatMs")
            self.sent = int(pending.get("sent") or 0)
            self.last_sent = pair(pending.get("lastSent"))
            self.inflight = pair(pending.get("inflight"))
            self.ended = bool(pending.get("ended"))
            self.rerun = bool(pending.get("rerun"))
        if self.phase == RUNNING:
            self.started.set()

    # --- the sender's side ----------------------------------------------------------------------------------

    def take(self, now: float) -> tuple[str, dict[str, Any]] | float | None:
        """The next callback to send now (``(callback id, event)``), else when one may be due (the next
        progress after ``min_interval_s``), else ``None``. Progress goes before the outcome, at once when
        the outcome waits."""
        if self.inflight is not None:
            return self.inflight
        with self.lock:
            latest, outcome = self.latest, self.outcome
            if self.ended or self.handed:  # handed: another process sends the rest (pending())
                return None
            if latest is not None and latest == self.last_sent:
                self.latest = latest = None  # the value and cursor sent last: nothing new to say,
                self.asked = True  # but the job wants to know whether it is still wanted (a heartbeat)
            if latest is not None:
                due = self.progress_at + self.config.min_interval_s
                if outcome is None and now < due:
                    return due
                self.latest = None
                self.last_sent = latest
                self.sent += 1
                self.progress_at = now
                value, cursor = latest
                event = {"type": "progress", "progress": value, "cursor": cursor}
                self.inflight = (f"{self.callback_ids()}:p{self.sent}", event)
            elif outcome is not None:
                self.ended = True
                self.inflight = (f"{self.callback_ids()}:end", outcome)
            else:
                return None
        return self.inflight

    def callback_ids(self) -> str:
        """What this run's callback ids begin with: ``<task>:<attempt>``, or ``<task>:<attempt>:<nonce>``
        in a run that took its attempt over from another (``p<n>`` and ``end`` follow). The same for every
        retry of a callback, so a retry is applied once; never another run's, so no run's report is taken
        for a repeat of another's (``duplicate-callback``) or refused (``callback-id-reused``)."""
        ids = f"{self.task_id}:{self.attempt}"
        return ids if self.nonce is None else f"{ids}:{self.nonce}"

    def idle(self) -> bool:
        """Nothing left to send, and the job has finished."""
        with self.lock:
            pending = not self.ended and (self.latest is not None or self.outcome is not None)
            return self.finished and self.inflight is None and not pending

    def reporting(self) -> bool:
        """Progress of the running job is still to be sent or answered (a cancel waits for it)."""
        with self.lock:
            return (
                self.phase == RUNNING
                and not self.ended
                and (self.inflight is not None or self.latest is not None)
            )

    def unsent(self) -> int:
        """How many of its reports wait: its start (or create), the callback on its way, its latest progress
        and its outcome (none once handed to another process)."""
        with self.lock:
            if self.phase == OVER or self.handed:
                return 0
            waiting = (
                self.phase in (CREATE, START, WAIT),
                self.inflight,
                self.latest,
                not self.ended and self.outcome,
            )
            return sum(1 for report in waiting if report)

    def over(self) -> None:
        """Nothing more will be sent for this run."""
        self.phase = OVER
        self.inflight = None
        self.started.set()
        self.settled.set()
