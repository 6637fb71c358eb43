"""The reporter's sender: one thread per process that sends every run's callbacks, in order (start, the
progress, the outcome), each with a stable id, retried with backoff until answered or the task's deadline.

Why a thread of its own: the job must never wait for the gateway (a slow or stopped gateway slows nothing),
yet what it reported must reach the gateway in order, and exactly once in effect (the callback ids make a
retry harmless). The thread also heartbeats the runs whose task has a lease, and waits out a killed run's
lease before a redelivered run starts the next attempt.

The cancels a queue asks for (a revoke, a stop) go the same way, as :class:`Cancel`: the handler that asks
(Celery's ``task_revoked`` runs in the worker's main process, the one taking messages) returns at once,
and the cancel is retried with backoff until answered or the task's deadline; so does the final ``fail``
of a run the queue lost (:class:`Lost`, Celery's main process again).

Two runs of one task in one process (a retry run here while the run before it still has reports to send,
or runs another process handed over) keep their order: a run's ``start`` waits until the runs of its task
that came before it have sent everything, so that the attempt a start begins is never the one an earlier
run has still to end.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from gateway.client.backoff import Backoff
from gateway.client.errors import TaskCancelled, cancelled
from gateway.integrations.reach import Reach
from gateway.integrations.run import CREATE, OVER, RUNNING, START, WAIT, Run
from gateway.integrations.ticket import GatewayConfig

log = logging.getLogger("gateway.integrations")

# Runs with something left to send, kept per process; beyond, the oldest is dropped (with a warning).
MAX_RUNS = 1000
# How often a redelivered run looks whether the lease of the run before it has run out.
WAIT_POLL_S = 0.2
# The longest the thread sleeps without looking at its runs.
IDLE_S = 1.0
# A job that repeats its last progress on a task without a lease asks (a heartbeat) at most this often
# whether its task is still wanted.
ASK_S = 1.0
KEEPALIVE_S = 2.0  # below the gateway's idle timeout (5 s), as the Worker's
# Answers of a fenced callback that mean the attempt can report nothing more.
ATTEMPT_ENDED = frozenset({"terminal-conflict", "not-running", "expired"})


class Unanswered(Exception):
    """The gateway did not answer (a transport error, a 5xx or a 429): try again later."""


@dataclass(eq=False)
class Cancel:
    """A cancel the queue asked for (``POST /v1/tasks/{id}/cancel``, the API key), waiting for the sender:
    sent after ``after`` (the run it cancels, in this process) has had its start answered, retried until
    ``expires_at_ms`` (the task's deadline, epoch ms)."""

    task_id: str
    reason: str | None
    expires_at_ms: float
    after: Run | None = None
    retry_at: float = 0.0  # monotonic: no request before
    failures: int = 0

    def over(self) -> None:
        """Nothing to undo: the sender forgets it."""


@dataclass(eq=False)
class Lost:
    """The final ``fail`` of a run the queue lost (its process killed, its message not requeued), which the
    queue calls failed: unfenced (no attempt: the run that knew it is gone), with the ticket's ``token``,
    retried until ``expires_at_ms``. A task its lease requeued meanwhile (``not-running``) is cancelled
    instead, saying why."""

    task_id: str
    token: str
    error: str
    expires_at_ms: float
    retry_at: float = 0.0
    failures: int = 0

    def over(self) -> None:
        """Nothing to undo: the sender forgets it."""


# The longest cancel reason the gateway takes.
MAX_CANCEL_REASON = 1024


class Sender:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.client = httpx.Client(
            base_url=config.url.rstrip("/"),
            timeout=config.timeout_s,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S),
        )
        self.api_headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.runs: list[Run | Cancel | Lost] = []  # in the order they came
        self._cond = threading.Condition()
        self._woken = False
        self.reach = Reach(config.url, self._unsent)
        self._thread = threading.Thread(target=self._loop, name="task-gateway-reporter", daemon=True)
        self._thread.start()

    def add(self, run: Run | Cancel | Lost) -> None:
        with self._cond:
            self.runs.append(run)
            while len(self.runs) > MAX_RUNS:
                dropped = self.runs.pop(0)
                log.warning(
                    "task-gateway: more than %d runs and cancels wait; dropping what %s has not sent",
                    MAX_RUNS,
                    dropped.task_id,
                )
                dropped.over()
            self._woken = True
            self._cond.notify()

    def _unsent(self) -> int:
        with self._cond:
            return sum(item.unsent() if isinstance(item, Run) else 1 for item in self.runs)

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify()

    # --- the loop -----------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                runs = list(self.runs)
            due = math.inf
            for run in runs:
                try:
                    next_at = self._step(run, time.monotonic())
                except Exception:  # a bug must not stop every other run's reports
                    log.exception("task-gateway: reporting %s failed", run.task_id)
                    next_at = time.monotonic() + IDLE_S
                if next_at is None:
                    run.over()
                    with self._cond:
                        if run in self.runs:
                            self.runs.remove(run)
                else:
                    due = min(due, next_at)
            with self._cond:
                if not self._woken:
                    self._cond.wait(min(IDLE_S, max(0.0, due - time.monotonic())))
                self._woken = False

    def _step(self, run: Run | Cancel | Lost, now: float) -> float | None:
        """Do what is due for ``run`` (at most one request); return when to look at it again (``now``: at
        once), or ``None`` when it has nothing more to send."""
        if isinstance(run, Cancel):
            return self._cancel(run, now)
        if isinstance(run, Lost):
            return self._lost(run, now)
        if run.phase == OVER or run.handed:
            return None
        if time.time() * 1000 >= run.expires_at_ms:
            if not run.idle():
                log.warning(
                    "task-gateway: task %s passed its deadline; dropping its unsent reports", run.task_id
                )
            return None
        if now < run.retry_at:
            return run.retry_at
        if run.phase in (CREATE, START, WAIT) and self._behind(run):
            return now + WAIT_POLL_S
        try:
            if run.phase == CREATE:
                self._create(run)
            elif run.phase == START:
                self._start(run)
            elif run.phase == WAIT:
                self._wait(run)
                return time.monotonic() + WAIT_POLL_S if run.phase == WAIT else now
            else:
                return self._running(run, now)
        except Unanswered as exc:
            run.unreachable = True
            run.started.set()  # the job does not wait for a gateway it cannot reach
            return _later(run, exc)
        return None if run.phase == OVER else now

    def _behind(self, run: Run) -> bool:
        """An earlier run of ``run``'s task, in this process, has not sent everything yet."""
        with self._cond:
            for other in self.runs:
                if other is run:
                    return False
                if (
                    isinstance(other, Run)
                    and other.task_id == run.task_id
                    and other.phase != OVER
                    and not other.handed
                ):
                    return True
        return False

    def _lost(self, lost: Lost, now: float) -> float | None:
        if time.time() * 1000 >= lost.expires_at_ms:
            log.warning(
                "task-gateway: could not fail task %s, whose run was lost, before its deadline", lost.task_id
            )
            return None
        if now < lost.retry_at:
            return lost.retry_at
        event = {"type": "fail", "error": lost.error, "retryable": False}
        body = {"callbackId": f"{lost.task_id}:lost", "event": event}
        try:
            status, answer, _ = self._post(
                f"/v1/tasks/{_path(lost.task_id)}/callbacks", body, {"Authorization": f"Bearer {lost.token}"}
            )
        except Unanswered as exc:
            return _later(lost, exc)
        if status >= 300:
            log.warning(
                "task-gateway: could not fail task %s, whose run was lost: %s",
                lost.task_id,
                _why(status, answer),
            )
        elif answer.get("reason") == "not-running":
            reason = f"its run was lost: {lost.error}"[:MAX_CANCEL_REASON]
            self.add(Cancel(lost.task_id, reason, lost.expires_at_ms))
        return None

    def _cancel(self, cancel: Cancel, now: float) -> float | None:
        if time.time() * 1000 >= cancel.expires_at_ms:
            log.warning("task-gateway: could not cancel task %s before its deadline", cancel.task_id)
            return None
        if cancel.after is not None and (
            cancel.after.phase in (CREATE, START, WAIT) or cancel.after.reporting()
        ):
            # Its run has not started (the task may not even be made yet), or has progress still to send,
            # which the cancel would refuse: the cancel goes after what the job reported before it.
            return now + WAIT_POLL_S
        if now < cancel.retry_at:
            return cancel.retry_at
        body = {} if cancel.reason is None else {"reason": cancel.reason}
        path = f"/v1/tasks/{_path(cancel.task_id)}/cancel"
        try:
            status, answer, _ = self._post(path, body, self.api_headers)
        except Unanswered as exc:
            return _later(cancel, exc)
        if status >= 300:
            log.warning("task-gateway: could not cancel task %s: %s", cancel.task_id, _why(status, answer))
        return None

    def _running(self, run: Run, now: float) -> float | None:
        item = run.take(now)
        if isinstance(item, tuple):
            self._callback(run, *item)
            return None if run.phase == OVER else now
        if run.idle() or (run.ended and run.inflight is None):
            return None
        due = item if item is not None else math.inf
        if run.ended:
            return due
        if run.heartbeat_ms is not None:
            beat_at = run.renewed_at + run.heartbeat_ms / 3000
        elif run.asked:  # no lease, but a job that repeats its progress learns of a cancel this way
            beat_at = run.contact_at + max(ASK_S, self.config.min_interval_s)
        else:
            return due
        if now >= beat_at:
            run.asked = False
            self._heartbeat(run)
            return now
        return min(due, beat_at)

    # --- requests -----------------------------------------------------------------------------------------

    def _post(
        self, path: str, body: dict[str, Any] | None, headers: dict[str, str]
    ) -> tuple[int, dict[str, Any], float]:
        """POST (GET when ``body`` is None): the status, the JSON and when it was sent (monotonic); raises
        :class:`Unanswered` where trying again may help."""
        sent = time.monotonic()
        try:
            if body is None:
                response = self.client.get(path, headers=headers)
            else:
                response = self.client.post(path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            self.reach.lost(f"{type(exc).__name__}: {exc}")
            raise Unanswered(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500:
            self.reach.lost(f"HTTP {response.status_code}")
        else:
            self.reach.found()
        if response.status_code >= 500 or response.status_code == 429:
            raise Unanswered(f"HTTP {response.status_code}")
        try:
            answer = response.json()
        except ValueError:
            answer = {}
        return response.status_code, answer if isinstance(answer, dict) else {}, sent

    def _answered(self, run: Run, answer: dict[str, Any], sent: float) -> None:
        run.unreachable = False
        run.contact_at = sent
        run.failures = 0
        task = answer.get("task")
        if isinstance(task, dict) and isinstance(task.get("expiresAtMs"), int):
            run.expires_at_ms = task["expiresAtMs"]
        if answer.get("heartbeatMs") is not None:
            run.heartbeat_ms = int(answer["heartbeatMs"])
            run.renewed_at = max(run.renewed_at, sent)

    def _create(self, run: Run) -> None:
        """No callback token came with the job: create the task (the ticket's parameters, else the
        config's); an existing task made otherwise cannot be reported to (its token is with its creator)."""
        config, ticket = self.config, run.ticket
        body: dict[str, Any] = {
            "id": run.task_id,
            "ttlMs": ticket.ttl_ms if ticket else config.ttl_ms,
            "maxAttempts": ticket.max_attempts if ticket else 1,
            "tags": list(ticket.tags if ticket else config.tags),
        }
        heartbeat_ms = ticket.heartbeat_ms if ticket else config.heartbeat_ms
        if heartbeat_ms is not None:
            body["heartbeatMs"] = heartbeat_ms
        status, answer, sent = self._post("/v1/tasks", body, self.api_headers)
        if status >= 300:
            log.warning("task-gateway: could not create task %s: %s", run.task_id, _why(status, answer))
            run.over()
            return
        self._answered(run, answer, sent)
        run.token = str(answer["callbackToken"])
        run.phase = run.first_phase(heartbeat_ms)

    def _start(self, run: Run) -> None:
        event = {"type": "start", "worker": run.worker}
        status, answer, sent = self._post(
            f"/v1/tasks/{_path(run.task_id)}/callbacks",
            {"callbackId": run.start_id, "event": event},
            self._auth(run),
        )
        if status >= 300:
            log.warning("task-gateway: could not start task %s: %s", run.task_id, _why(status, answer))
            run.over()
            return
        self._answered(run, answer, sent)
        reason, task = answer.get("reason"), answer.get("task") or {}
        if task.get("state") == "running" and reason in ("started", "duplicate-callback"):
            self._begun(run, int(task["attempts"]))
        elif reason == "already-running" and answer.get("heartbeatMs") is not None:
            # A run before this one (killed, its message redelivered) holds the attempt: its lease will
            # requeue the task. No start meanwhile: each would renew that lease.
            run.phase, run.running_attempt = WAIT, int(task["attempts"])
            log.info(
                "task-gateway: task %s is still running attempt %s; waiting for its lease",
                run.task_id,
                task["attempts"],
            )
        elif reason == "already-running":
            log.warning(
                "task-gateway: task %s is running attempt %s and has no heartbeat lease to requeue it: "
                "taking that attempt over (give tasks a heartbeatMs to make each run an attempt of its own)",
                run.task_id,
                task["attempts"],
            )
            self._begun(run, int(task["attempts"]), took_over=True)
        else:
            self._ended(run, "start", str(reason), task)

    def _wait(self, run: Run) -> None:
        """Read the task (the API key): queued, start it; running an attempt another run began, look again
        later (its lease will requeue it); ended, report nothing."""
        status, answer, _ = self._post(f"/v1/tasks/{_path(run.task_id)}", None, self.api_headers)
        if status >= 300:  # no API key here? A rerun's first look starts as a first run does (a start
            # renews an earlier run's lease once); a run answered already-running takes the attempt over.
            attempt = run.running_attempt
            log.warning(
                "task-gateway: cannot read task %s to see whether an earlier run still holds it (%s); %s",
                run.task_id,
                _why(status, answer),
                "starting it" if attempt is None else f"taking attempt {attempt} over",
            )
            if attempt is None:
                run.phase = START
            else:
                self._begun(run, attempt, took_over=True)
            return
        state = answer.get("state")
        if state == "queued":
            run.phase, run.start_id = START, str(uuid.uuid4())
        elif state == "running":
            if run.running_attempt is None:
                log.info(
                    "task-gateway: task %s is still running attempt %s, begun by an earlier run of its job; "
                    "waiting for its lease",
                    run.task_id,
                    answer["attempts"],
                )
            run.running_attempt = int(answer["attempts"])
        else:
            self._ended(run, "start", "terminal-conflict", answer)

    def _begun(self, run: Run, attempt: int, *, took_over: bool = False) -> None:
        """The run reports as ``attempt`` from now on; one that ``took_over`` an attempt another run began
        numbers its callbacks apart from that run's (:meth:`Run.callback_ids`)."""
        if took_over:
            run.nonce = uuid.uuid4().hex[:16]
        run.attempt = attempt
        run.phase = RUNNING
        run.started.set()

    def _callback(self, run: Run, callback_id: str, event: dict[str, Any]) -> None:
        body = {"callbackId": callback_id, "attempt": run.attempt, "event": event}
        status, answer, sent = self._post(f"/v1/tasks/{_path(run.task_id)}/callbacks", body, self._auth(run))
        run.inflight = None
        if status >= 300:
            code = (answer.get("error") or {}).get("code")
            if status == 409 and code == "stale-attempt":
                self._ended(run, str(event["type"]), code, None)
            else:
                log.warning(
                    "task-gateway: %s callback of task %s refused: %s",
                    event["type"],
                    run.task_id,
                    _why(status, answer),
                )
            return
        self._answered(run, answer, sent)
        reason = str(answer.get("reason"))
        if reason in ATTEMPT_ENDED:
            self._ended(run, str(event["type"]), reason, answer.get("task"))
        elif run.ended:
            run.over()

    def _heartbeat(self, run: Run) -> None:
        path = f"/v1/tasks/{_path(run.task_id)}/heartbeat"
        status, answer, sent = self._post(path, {"attempt": run.attempt}, self._auth(run))
        if status < 300:
            self._answered(run, answer, sent)
            return
        code = str((answer.get("error") or {}).get("code"))
        if status == 409:
            self._ended(run, "heartbeat", code, answer.get("task"))
        else:
            log.warning("task-gateway: heartbeat of task %s refused: %s", run.task_id, _why(status, answer))
            run.renewed_at = run.contact_at = time.monotonic()  # not renewed; try again a beat later

    def _ended(self, run: Run, what: str, reason: str, task: dict[str, Any] | None) -> None:
        """The gateway says this run can report nothing more: the task was cancelled (the job's next
        ``progress()`` raises), ended, or its attempt is over."""
        if task is not None and cancelled(task):
            run.cancelled = TaskCancelled(what, reason, task)
        elif not run.ended or reason != "terminal-conflict":
            state = (task or {}).get("state", "?")
            log.warning(
                "task-gateway: task %s: %s answered %s (the task is %s); this run reports nothing more",
                run.task_id,
                what,
                reason,
                state,
            )
        run.over()

    def _auth(self, run: Run) -> dict[str, str]:
        return {"Authorization": f"Bearer {run.token}"}


def _later(item: Run | Cancel | Lost, exc: Unanswered) -> float:
    """The gateway did not answer ``item``'s request: when to try again (backoff)."""
    item.failures += 1
    item.retry_at = time.monotonic() + Backoff(base_s=0.05, cap_s=2.0, failures=item.failures).next_delay()
    log.debug("task-gateway: %s: %s; trying again", item.task_id, exc)
    return item.retry_at


def _path(task_id: str) -> str:
    """A task id as a URL path segment (ids may hold any character but ``/`` and controls)."""
    return quote(task_id, safe="")


def _why(status: int, answer: dict[str, Any]) -> str:
    error = answer.get("error")
    if isinstance(error, dict):
        return f"{status} {error.get('code')}: {error.get('message')}"
    return f"HTTP {status}"
