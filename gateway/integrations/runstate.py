"""``RunState``: what one run of one job has to report, as the sender's core (``outbox.py``) keeps it; pure.

The job leaves its latest progress (coalesced: a value replaces one not taken yet) and its outcome here;
the core takes them in order as callbacks with stable ids, and keeps the run's place in its life: its phase,
its callback token, the attempt its start began, its lease, what is on its way. ``Run`` (``run.py``) is this
record with the job's side around it (a lock, the events the job waits on); whoever touches a record holds
that lock. ``pending()`` and ``resume()`` carry a record, as JSON, to another process (an RQ work horse's
reports to its worker).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from gateway.client.errors import AttemptOver, TaskCancelled
from gateway.client.merge_patch import PatchQueue
from gateway.client.retake import lost
from gateway.client.stream_out import Batch, StreamOut

# A run's phases.
CREATE = "create"  # no callback token: the worker creates the task first
START = "start"  # send ``start``
# A run that is not its job's first (redelivered, retried: ``rerun``), or whose start was answered
# ``already-running``: read the task and, while an earlier run holds it, wait (without a start, which would
# renew that run's lease) for the lease to requeue it.
WAIT = "wait"
RUNNING = "running"  # progress, the outcome, heartbeats
# The run's lease ran out while it still ran, and its task waits, queued, for a start nobody else will send:
# start it again (the next attempt), then send what the run had to say as that attempt.
RETAKE = "retake"
OVER = "over"  # nothing more will be sent
# The phases before the run reports as an attempt of its own.
STARTING = (CREATE, START, WAIT, RETAKE)
# What a run keeps of one stream's text unsent, at most (the gateway's GATEWAY_STREAM_MAX_BYTES by default:
# a stream's text can hold no more); a write past it is dropped (said once), the job never waiting.
STREAM_LIMIT_BYTES = 16 * 1024 * 1024


class SenderConfig(Protocol):
    """What the core reads of ``install()``'s settings (``ticket.GatewayConfig``, which checks them and
    so imports more than a core may)."""

    @property
    def url(self) -> str: ...
    @property
    def api_key(self) -> str | None: ...
    @property
    def ttl_ms(self) -> int: ...
    @property
    def heartbeat_ms(self) -> int | None: ...
    @property
    def min_interval_s(self) -> float: ...
    @property
    def tags(self) -> Sequence[str]: ...


class TaskTicket(Protocol):
    """What the core reads of the ticket a job's message carries (``ticket.Ticket``)."""

    @property
    def token(self) -> str | None: ...
    @property
    def ttl_ms(self) -> int: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def heartbeat_ms(self) -> int | None: ...
    @property
    def tags(self) -> Sequence[str]: ...
    @property
    def title(self) -> str | None: ...
    @property
    def metadata(self) -> Mapping[str, Any] | None: ...
    @property
    def parent(self) -> str | None: ...
    @property
    def progress_from_children(self) -> bool: ...
    def to_header(self) -> dict[str, Any]: ...


class RunState:
    """One run's reports to the gateway task ``task_id``. ``attempt`` is the attempt its ``start`` began
    (``None`` until the gateway has answered it); ``expires_at_ms`` the task's deadline (epoch ms),
    bounded above by the caller until the gateway says."""

    def __init__(
        self,
        task_id: str,
        *,
        worker: str,
        ticket: TaskTicket | None,
        scheme: str,
        config: SenderConfig,
        expires_at_ms: float,
        rerun: bool = False,
    ) -> None:
        self.task_id = task_id
        self.attempt: int | None = None
        self.worker = worker
        self.ticket = ticket
        self.scheme = scheme
        self.config = config
        self.expires_at_ms = expires_at_ms
        # What the job left.
        self.latest: tuple[int, str] | None = None
        self.outcome: dict[str, Any] | None = None
        self.finished = False
        self.cancelled: TaskCancelled | None = None  # the gateway said the task was cancelled
        self.unreachable = False  # the last request did not reach the gateway (or it answered 5xx)
        # Not the job's first run: an earlier one (killed?) may still hold the task, its lease running.
        self.rerun = rerun
        self.token = ticket.token if ticket is not None else None
        self.phase = CREATE if self.token is None else self.first_phase()
        self.start_id = str(uuid.uuid4())  # fresh per start: a redelivered run is a new attempt
        self.running_attempt: int | None = None  # the attempt another run holds (WAIT; None: not read yet)
        # Set when this run took over an attempt another run began (a task without a lease): its callback
        # ids then carry it, so that they are not that run's (whose own progress counted from p1 too).
        self.nonce: str | None = None
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
        self.failures = 0  # tries unanswered in a row
        self.handed = False  # given to another process (pending()): this one sends nothing more of it
        # What the job wrote to its streams and the gateway has not taken yet, by name; the streams whose
        # text the gateway refused for good (what is written to them is dropped).
        self.streams: dict[str, StreamOut] = {}
        self.refused_streams: set[str] = set()
        # The job's metadata patches not taken yet, in its order (the first may be on its way).
        self.patches = PatchQueue()
        self.gone: AttemptOver | None = None  # the task went on without this run: a write raises it

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

    # --- the job's side's hooks ----------------------------------------------------------------------------

    def unblock(self) -> None:
        """The job need not wait for the start any longer: answered, given up, or the gateway out of reach
        (``Run`` wakes the job)."""

    def over(self) -> None:
        """Nothing more will be sent for this run (``Run`` wakes whoever waits for it)."""
        self.phase = OVER
        self.inflight = None

    # --- what to send ---------------------------------------------------------------------------------------

    def take(self, now: float) -> tuple[str, dict[str, Any]] | float | None:
        """The next callback to send now (``(callback id, event)``), else when one may be due (the next
        progress after ``min_interval_s``), else ``None``. Progress goes before the outcome, at once when
        the outcome waits."""
        if self.inflight is not None:
            return self.inflight
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
            self.patches.progress_sent()
            self.sent += 1
            self.progress_at = now
            value, cursor = latest
            event = {"type": "progress", "progress": value, "cursor": cursor}
            self.inflight = (f"{self.callback_ids()}:p{self.sent}", event)
        elif outcome is not None and self.written():
            self.ended = True
            self.inflight = (f"{self.callback_ids()}:end", outcome)
        else:
            return None
        return self.inflight

    def written(self) -> bool:
        """Everything the job wrote (its streams' text, its metadata patches) has been taken by the gateway
        (the outcome goes after it)."""
        return not self.patches and all(out.empty() for out in self.streams.values())

    def metadata_kept(self, patch: dict[str, Any]) -> bool:
        """Keep the merge patch ``patch`` (checked: a JSON object) to send after what the job reported
        before it; false when the run reports nothing more."""
        if self.phase == OVER or self.ended or self.handed:
            return False
        waits = self.latest is not None and self.latest != self.last_sent
        self.patches.add(patch, after_progress=waits)
        return True

    def take_patch(self) -> dict[str, Any] | None:
        """The metadata patch to send now (the one on its way, again), else ``None``: none waits, a callback
        made before it is on its way, or it waits for the progress the job reported before it."""
        if self.inflight is not None or self.ended or self.handed:
            return None
        return self.patches.due(progress_waits=self.latest is not None and self.latest != self.last_sent)

    def write_kept(self, name: str, text: str, now: float) -> bool:
        """Keep ``text`` for the stream ``name`` (``ValueError`` for a name the gateway would refuse); false
        when it is dropped: the stream is full of unsent text, its text was refused, or the run reports
        nothing more."""
        out = self.streams.get(name) or StreamOut(name, limit_bytes=STREAM_LIMIT_BYTES)
        if name in self.refused_streams or self.phase == OVER or self.ended:
            return False
        self.streams[name] = out
        return out.write(text, now)

    def take_append(self, now: float) -> Batch | float | None:
        """The next append to send now (one on its way again, first), else when one will be due, else
        ``None``. Every buffer goes at once when the job has finished or its outcome waits."""
        assert self.attempt is not None  # a running run's (its outcome waits for the streams: never ended)
        flush = self.finished or self.outcome is not None
        due: float | None = None
        for out in self.streams.values():
            taken = out.take(self.attempt, now, flush=flush)
            if isinstance(taken, Batch):
                return taken
            if taken is not None:
                due = taken if due is None else min(due, taken)
        return due

    def callback_ids(self) -> str:
        """What this run's callback ids begin with: ``<task>:<attempt>``, or ``<task>:<attempt>:<nonce>``
        in a run that took its attempt over from another (``p<n>`` and ``end`` follow). The same for every
        retry of a callback, so a retry is applied once; never another run's, so no run's report is taken
        for a repeat of another's (``duplicate-callback``) or refused (``callback-id-reused``)."""
        ids = f"{self.task_id}:{self.attempt}"
        return ids if self.nonce is None else f"{ids}:{self.nonce}"

    def restart(self) -> None:
        """Send a start of its own (a fresh id: a start begins a new attempt)."""
        self.phase, self.start_id = START, str(uuid.uuid4())

    def begin(self, attempt: int, *, took_over: bool = False) -> None:
        """The run reports as ``attempt`` from now on; one that ``took_over`` an attempt another run began
        numbers its callbacks apart from that run's (:meth:`callback_ids`)."""
        if took_over:
            self.nonce = uuid.uuid4().hex[:16]
        self.attempt = attempt
        self.phase = RUNNING
        self.unblock()

    def retake(self) -> None:
        """The lease ran out while the run still ran: start the task again (a fresh start id), then say as
        the new attempt what the old one could not: the progress reached (or a later one), the outcome."""
        self.phase = RETAKE
        self.start_id = str(uuid.uuid4())
        self.inflight = None
        self.patches.again()
        if self.latest is None:
            self.latest = self.last_sent
        self.last_sent = None
        self.sent = 0
        self.progress_at = -1e9
        self.ended = False

    def idle(self) -> bool:
        """Nothing left to send, and the job has finished."""
        pending = not self.ended and (
            self.latest is not None or self.outcome is not None or not self.written()
        )
        return self.finished and self.inflight is None and not pending

    def reporting(self) -> bool:
        """Progress of the running job is still to be sent or answered (a cancel waits for it)."""
        return (
            self.phase == RUNNING
            and not self.ended
            and (self.inflight is not None or self.latest is not None or bool(self.patches))
        )

    def unsent(self) -> int:
        """How many of its reports wait: its start (or create), the callback on its way, its latest progress
        and its outcome (none once handed to another process)."""
        if self.phase == OVER or self.handed:
            return 0
        waiting = (self.phase in STARTING, self.inflight, self.latest, not self.ended and self.outcome)
        streams = sum(not out.empty() for out in self.streams.values())
        return sum(1 for report in waiting if report) + streams + len(self.patches)

    def unreported(self) -> str:
        """What the run had still to say, for a line that says it is lost."""
        text = sum(out.unsent_chunks() for out in self.streams.values())
        also = f"; {text} chunks of its streams' text" if text else ""
        also += f"; {len(self.patches)} metadata patches" if self.patches else ""
        if self.outcome is not None:
            return lost(self.outcome) + also
        reached = self.latest or self.last_sent
        return (
            f"its progress{f' ({reached[0]}%)' if reached else ''} and its outcome, once the job ends{also}"
        )

    # --- another process takes over ------------------------------------------------------------------------

    def pending(self) -> dict[str, Any] | None:
        """What this run has not had answered yet, for another process to send (:meth:`resume`); ``None``
        when nothing is left. From now on this record sends nothing more. JSON-able: the callback token,
        the attempt, the ids and the deadline go with it."""
        self.handed = True
        if self.phase == OVER or (self.ended and self.inflight is None):
            return None
        if (
            self.phase == RUNNING
            and self.inflight is None
            and self.latest is None
            and self.outcome is None
            and self.written()
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
            "streams": [out.pending() for out in self.streams.values() if not out.empty()],
            "patches": self.patches.pending(),
        }

    def resume(self, pending: Mapping[str, Any]) -> None:
        """Take up where the run ``pending`` (:meth:`pending`, in another process) stopped: a finished run
        whose remaining callbacks go with their ids, in their order."""

        def pair(value: Any) -> tuple[Any, Any] | None:
            return None if value is None else (value[0], value[1])

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
        self.streams = {
            str(out["name"]): StreamOut.resume(out, limit_bytes=STREAM_LIMIT_BYTES)
            for out in pending.get("streams") or ()
        }
        self.patches = PatchQueue.resume(pending.get("patches"))
        if self.phase in (RUNNING, RETAKE):
            self.unblock()
