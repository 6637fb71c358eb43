"""One run's requests to the gateway and what their answers mean for it, pure: the half of the sender's
core (``outbox.py``) that is about a single run, and the words the core and its driver (``sender.py``) say
to each other (:class:`Request`, :class:`Answer`; the decisions :class:`Send`, :class:`Wait`,
:class:`Done`; :class:`Log` records).

A run (its record: ``runstate.py``) creates its task when no callback token came with its job, starts it,
or, not its job's first run, reads it first and waits out the lease of a run before it (a start answered
``already-running`` would renew that lease); then it sends its progress and outcome and heartbeats. Told
its attempt is over, it learns why: a cancel (the job's next ``progress()`` raises), its lease ran out while
it still ran (it takes the task back, :mod:`gateway.client.retake`), or the task went on without it (an
ERROR that says what is lost).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from gateway.client.errors import AttemptOver, TaskCancelled, cancelled
from gateway.client.retake import TakeBack, WentOn, outlived
from gateway.client.stream_out import Again, Batch, Over, Refused
from gateway.integrations.runstate import CREATE, RETAKE, START, WAIT, RunState, SenderConfig

# How often a run waiting for the lease of a run before it reads the task again.
WAIT_POLL_S = 0.2
# A job that repeats its last progress on a task without a lease asks (a heartbeat) at most this often
# whether its task is still wanted.
ASK_S = 1.0
# Answers of a fenced callback that mean the attempt can report nothing more.
ATTEMPT_ENDED = frozenset({"terminal-conflict", "not-running", "expired"})


@dataclass(frozen=True)
class Request:
    """``GET`` ``path`` (``body`` None) or ``POST`` the JSON ``body``, with ``token`` as its bearer (a
    callback token or the API key; None: none); ``kind`` says what it is, for its answer."""

    kind: str  # create, start, read, callback, metadata, append, heartbeat, cancel, lost
    path: str
    body: dict[str, Any] | None
    token: str | None


@dataclass(frozen=True)
class Answer:
    """The gateway's answer: its status, its JSON object (``{}`` when it is not one), its ``Retry-After``,
    and when (``now``'s clock) the request was sent."""

    status: int
    body: dict[str, Any]
    sent_at: float
    retry_after: str | None = None


@dataclass(frozen=True)
class Send:
    request: Request


@dataclass(frozen=True)
class Wait:
    """Nothing to send before ``until`` (``now``'s clock; ``math.inf``: until something happens)."""

    until: float


@dataclass(frozen=True)
class Done:
    """Nothing more to send: the item is forgotten."""


DONE = Done()


@dataclass(frozen=True)
class Log:
    level: int
    message: str
    args: tuple[Any, ...] = ()


class RunProtocol:
    """The decisions about single runs, for the gateway of ``config``; lines go to ``say(level, message,
    *args)``."""

    def __init__(self, config: SenderConfig, say: Callable[..., None]) -> None:
        self.config = config
        self._say = say

    def request(self, run: RunState, now: float) -> Send | Wait | Done:
        """What ``run``, due to send and first in its task's line, sends now (or when to look again)."""
        if run.phase == CREATE:
            return Send(Request("create", "/v1/tasks", self._create_body(run), self.config.api_key))
        if run.phase in (START, RETAKE):
            body = {"callbackId": run.start_id, "event": {"type": "start", "worker": run.worker}}
            return Send(Request("start", callbacks(run.task_id), body, run.token))
        if run.phase == WAIT:
            return Send(Request("read", task_path(run.task_id), None, self.config.api_key))
        return self._running(run, now)

    def _lease_ms(self, run: RunState) -> int | None:
        return run.ticket.heartbeat_ms if run.ticket else self.config.heartbeat_ms

    def _create_body(self, run: RunState) -> dict[str, Any]:
        """No callback token came with the job: create the task (the ticket's parameters, else the
        config's); an existing task made otherwise cannot be reported to (its token is with its creator)."""
        config, ticket = self.config, run.ticket
        body: dict[str, Any] = {
            "id": run.task_id,
            "ttlMs": ticket.ttl_ms if ticket else config.ttl_ms,
            "maxAttempts": ticket.max_attempts if ticket else 1,
            "tags": list(ticket.tags if ticket else config.tags),
        }
        heartbeat_ms = self._lease_ms(run)
        if heartbeat_ms is not None:
            body["heartbeatMs"] = heartbeat_ms
        if ticket is not None:  # as the producer asked (a retried create with others would be refused)
            if ticket.title is not None:
                body["title"] = ticket.title
            if ticket.metadata is not None:
                body["metadata"] = dict(ticket.metadata)
            if ticket.parent is not None:
                body["parent"] = ticket.parent
            if ticket.progress_from_children:
                body["progressFromChildren"] = True
        return body

    def _running(self, run: RunState, now: float) -> Send | Wait | Done:
        """The run's next callback or metadata patch, else its heartbeat when due, else when to look again."""
        patch = run.take_patch()
        if patch is not None:
            patched = {"attempt": run.attempt, "patch": patch}
            return Send(Request("metadata", f"{task_path(run.task_id)}/metadata", patched, run.token))
        taken = run.take(now)
        if isinstance(taken, tuple):
            callback_id, event = taken
            body = {"callbackId": callback_id, "attempt": run.attempt, "event": event}
            return Send(Request("callback", callbacks(run.task_id), body, run.token))
        batch = run.take_append(now)
        if isinstance(batch, Batch):
            path = f"{task_path(run.task_id)}/streams/{batch.name}"
            return Send(Request("append", path, batch.body(), run.token))
        if run.idle() or run.ended:
            return DONE  # everything said (the outcome answered), or the job has finished with nothing left
        due = min(math.inf if taken is None else taken, math.inf if batch is None else batch)
        if run.heartbeat_ms is not None:
            beat_at = run.renewed_at + run.heartbeat_ms / 3000
        elif run.asked:  # no lease, but a job that repeats its progress learns of a cancel this way
            beat_at = run.contact_at + max(ASK_S, self.config.min_interval_s)
        else:
            return Wait(due)
        if now < beat_at:
            return Wait(min(due, beat_at))
        run.asked = False
        return Send(
            Request("heartbeat", f"{task_path(run.task_id)}/heartbeat", {"attempt": run.attempt}, run.token)
        )

    def read(self, run: RunState, request: Request, answer: Answer, now: float) -> None:
        """What the answer to ``run``'s ``request`` (an answer not to be tried again) means for it."""
        if request.kind == "create":
            self._created(run, answer)
        elif request.kind == "start" and run.phase == RETAKE:
            self._retaken(run, answer)
        elif request.kind == "start":
            self._started(run, answer)
        elif request.kind == "read":
            self._read(run, answer, now)
        elif request.kind == "callback":
            assert request.body is not None
            self._called_back(run, str(request.body["event"]["type"]), answer)
        elif request.kind == "append":
            self._appended(run, request.path.rpartition("/")[2], answer)
        elif request.kind == "metadata":
            self._patched(run, answer)
        else:
            self._beaten(run, answer, now)

    def _answered(self, run: RunState, answer: Answer) -> None:
        """What any answer taken tells the run: the gateway is there, the task's deadline, its lease."""
        run.unreachable = False
        run.contact_at = answer.sent_at
        run.failures = 0
        task = answer.body.get("task")
        if isinstance(task, dict) and isinstance(task.get("expiresAtMs"), int):
            run.expires_at_ms = task["expiresAtMs"]
        if answer.body.get("heartbeatMs") is not None:
            run.heartbeat_ms = int(answer.body["heartbeatMs"])
            run.renewed_at = max(run.renewed_at, answer.sent_at)

    def _refused_outright(self, run: RunState, answer: Answer, what: str) -> bool:
        """The gateway refused the run's create or start (a 4xx): said; the run reports nothing more."""
        if answer.status < 300:
            return False
        self._say(logging.WARNING, "task-gateway: could not %s task %s: %s", what, run.task_id, why(answer))
        run.over()
        return True

    def _created(self, run: RunState, answer: Answer) -> None:
        if self._refused_outright(run, answer, "create"):
            return
        self._answered(run, answer)
        run.token = str(answer.body["callbackToken"])
        run.phase = run.first_phase(self._lease_ms(run))

    def _started(self, run: RunState, answer: Answer) -> None:
        if self._refused_outright(run, answer, "start"):
            return
        self._answered(run, answer)
        reason, task = answer.body.get("reason"), answer.body.get("task") or {}
        if task.get("state") == "running" and reason in ("started", "duplicate-callback"):
            run.begin(int(task["attempts"]))
        elif reason == "already-running" and answer.body.get("heartbeatMs") is not None:
            # A run before this one (killed, its message redelivered) holds the attempt: its lease will
            # requeue the task. No start meanwhile: each would renew that lease.
            run.phase, run.running_attempt = WAIT, int(task["attempts"])
            self._say(
                logging.INFO,
                "task-gateway: task %s is still running attempt %s; waiting for its lease",
                run.task_id,
                task["attempts"],
            )
        elif reason == "already-running":
            self._say(
                logging.WARNING,
                "task-gateway: task %s is running attempt %s and has no heartbeat lease to requeue it: "
                "taking that attempt over (give tasks a heartbeatMs to make each run an attempt of its own)",
                run.task_id,
                task["attempts"],
            )
            run.begin(int(task["attempts"]), took_over=True)
        else:
            self._refused(run, "start", str(reason), task)

    def _read(self, run: RunState, answer: Answer, now: float) -> None:
        """The task (the API key): queued, start it; running an attempt another run began, look again
        later (its lease will requeue it); ended, report nothing."""
        if answer.status >= 300:  # no API key here? A rerun's first look starts as a first run does (a start
            # renews an earlier run's lease once); a run answered already-running takes the attempt over.
            attempt = run.running_attempt
            self._say(
                logging.WARNING,
                "task-gateway: cannot read task %s to see whether an earlier run still holds it (%s); %s",
                run.task_id,
                why(answer),
                "starting it" if attempt is None else f"taking attempt {attempt} over",
            )
            if attempt is None:
                run.phase = START
            else:
                run.begin(attempt, took_over=True)
            return
        run.unreachable, run.failures = False, 0
        state = answer.body.get("state")
        if state == "queued":
            run.restart()
        elif state == "running":
            if run.running_attempt is None:
                self._say(
                    logging.INFO,
                    "task-gateway: task %s is still running attempt %s, begun by an earlier run of its job; "
                    "waiting for its lease",
                    run.task_id,
                    answer.body["attempts"],
                )
            run.running_attempt = int(answer.body["attempts"])
            run.retry_at = now + WAIT_POLL_S
        else:
            self._refused(run, "start", "terminal-conflict", answer.body)

    def _refused(self, run: RunState, what: str, reason: str, task: dict[str, Any]) -> None:
        """The run cannot begin an attempt: the task was cancelled (the job's next ``progress()`` raises),
        or has ended, or has no attempt left."""
        if cancelled(task):
            run.cancelled = TaskCancelled(what, reason, task)
        else:
            self._say(
                logging.WARNING,
                "task-gateway: task %s: %s answered %s (the task is %s); this run reports nothing more",
                run.task_id,
                what,
                reason,
                task.get("state", "?"),
            )
        run.over()

    def _called_back(self, run: RunState, kind: str, answer: Answer) -> None:
        run.inflight = None
        if answer.status >= 300:
            if answer.status == 409 and code(answer) == "stale-attempt":
                self._attempt_over(run, kind, "stale-attempt", None)
            else:
                self._say(
                    logging.WARNING,
                    "task-gateway: %s callback of task %s refused: %s",
                    kind,
                    run.task_id,
                    why(answer),
                )
            return
        self._answered(run, answer)
        reason = str(answer.body.get("reason"))
        if reason in ATTEMPT_ENDED:
            self._attempt_over(run, kind, reason, answer.body.get("task"))
        elif run.ended:
            run.over()

    def _appended(self, run: RunState, name: str, answer: Answer) -> None:
        """The answer to the batch on its way to the stream ``name`` (the same again until answered)."""
        out = run.streams[name]
        assert out.inflight is not None  # nothing renumbers it but an answer, read here
        verdict = out.answered(out.inflight, answer.status, answer.body)
        if isinstance(verdict, Over):
            self._attempt_over(run, "append", verdict.code, verdict.task)
        elif isinstance(verdict, Refused):
            self._say(
                logging.WARNING,
                "task-gateway: stream %s of task %s refused: %s; what the job writes to it is dropped",
                name,
                run.task_id,
                why(answer),
            )
            del run.streams[name]
            run.refused_streams.add(name)
        elif not isinstance(verdict, Again):  # taken: the batch's answer renews the lease as a callback's
            self._answered(run, answer)

    def _patched(self, run: RunState, answer: Answer) -> None:
        """The answer to the metadata patch on its way (the same again until answered)."""
        if answer.status < 300:
            run.patches.answered()
            self._answered(run, answer)  # a patch renews the lease as a callback does
        elif answer.status == 409 and code(answer) in ("stale-attempt", "not-running"):
            self._attempt_over(run, "metadata", code(answer), answer.body.get("task"))
        else:
            run.patches.answered()
            self._say(
                logging.WARNING,
                "task-gateway: metadata patch of task %s refused: %s; the patch is dropped",
                run.task_id,
                why(answer),
            )

    def _beaten(self, run: RunState, answer: Answer, now: float) -> None:
        if answer.status < 300:
            self._answered(run, answer)
        elif answer.status == 409:
            self._attempt_over(run, "heartbeat", code(answer), answer.body.get("task"))
        else:
            self._say(
                logging.WARNING, "task-gateway: heartbeat of task %s refused: %s", run.task_id, why(answer)
            )
            run.renewed_at = run.contact_at = now  # not renewed; try again a beat later

    def _attempt_over(self, run: RunState, what: str, reason: str, task: dict[str, Any] | None) -> None:
        """The gateway says the run's attempt is over: the task was cancelled (the job's next
        ``progress()`` raises); its lease ran out while the run still ran (take the task back); else the
        task went on without the run, which says so at ERROR with what is lost."""
        if task is not None and cancelled(task):
            run.cancelled = TaskCancelled(what, reason, task)
            run.over()
            return
        assert run.attempt is not None  # a fenced callback or a heartbeat is an attempt's
        verdict = outlived(task, run.attempt)
        if isinstance(verdict, TakeBack):
            run.retake()
        else:
            self._went_on(run, verdict)

    def _retaken(self, run: RunState, answer: Answer) -> None:
        """The answer to the start that takes the task back."""
        task = answer.body.get("task") if answer.status < 300 else None
        if not isinstance(task, dict):
            self._went_on(run, WentOn(f"it could not be started again: {why(answer)}"))
            return
        self._answered(run, answer)
        reason, attempt = answer.body.get("reason"), run.attempt
        if task.get("state") == "running" and reason in ("started", "duplicate-callback"):
            run.begin(int(task["attempts"]))
            self._say(
                logging.WARNING,
                "task-gateway: task %s: the lease of attempt %s ran out while this run still ran (the "
                "gateway requeued the task); took the task back as attempt %s",
                run.task_id,
                attempt,
                run.attempt,
            )
        elif cancelled(task):
            run.cancelled = TaskCancelled("start", str(reason), task)
            run.over()
        else:
            assert attempt is not None
            verdict = outlived(task, attempt)
            said = verdict.why if isinstance(verdict, WentOn) else f"its start was answered {reason}"
            self._went_on(run, WentOn(said))

    def _went_on(self, run: RunState, verdict: WentOn) -> None:
        said = f"the task went on without this run: {verdict.why}"
        run.gone = AttemptOver(409, "not-running", said, task_id=run.task_id)
        self._say(
            logging.ERROR,
            "task-gateway: task %s went on without this run (%s); lost: %s",
            run.task_id,
            verdict.why,
            run.unreported(),
        )
        run.over()


def task_path(task_id: str) -> str:
    """The task's path (ids may hold any character but ``/`` and controls: quoted as one segment)."""
    return f"/v1/tasks/{quote(task_id, safe='')}"


def callbacks(task_id: str) -> str:
    return f"{task_path(task_id)}/callbacks"


def code(answer: Answer) -> str:
    error = answer.body.get("error")
    return str(error.get("code")) if isinstance(error, dict) else ""


def why(answer: Answer) -> str:
    error = answer.body.get("error")
    if isinstance(error, dict):
        return f"{answer.status} {error.get('code')}: {error.get('message')}"
    return f"HTTP {answer.status}"
