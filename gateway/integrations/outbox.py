"""The reporter's sender, Sans-I/O: what every run, cancel and lost run of a process has to send, in order,
and every decision about it: what to send next, what an answer means, when to look again, what to log.

It imports no HTTP client, thread or clock. Its driver (``sender.py``: a thread of the process with an
httpx client) asks :meth:`Outbox.next` what to do with an item (:class:`Send` a :class:`Request`,
:class:`Wait` until a time, or :class:`Done`: forget it), sends, and feeds back what happened:
:meth:`Outbox.answered` with the :class:`Answer`, or :meth:`Outbox.unanswered` when none came; then it
writes the :class:`Log` records the core left (:meth:`Outbox.take_logs`). Times are the caller's: ``now``
on a monotonic clock, ``wall_ms`` the epoch in milliseconds (the tasks' deadlines are the gateway's).

Here, what concerns the items together: their order (two runs of one task keep it: a start waits for
the runs of its task before it; a cancel goes after the run it cancels has said what it reported before
it), their deadlines, a request unanswered (a transport failure, a 5xx, a 429) tried again with backoff and
at least the answer's ``Retry-After`` (:mod:`gateway.client.retry`, the ``Worker``'s rule too), the
cancels and lost runs, at most :data:`MAX_RUNS` items. What concerns one run (its requests, what their
answers mean for it: started, waiting, its attempt over, its task taken back) is ``run_protocol.py``'s;
its record, ``runstate.py``.

Whether the gateway can be reached is said once when it cannot (a WARNING: which, why, how many reports
wait) and once when it can again (INFO), never once per retry.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any

from gateway.client.backoff import Backoff
from gateway.client.retry import pause_s, retried
from gateway.integrations.run_protocol import (
    DONE,
    WAIT_POLL_S,
    Answer,
    Done,
    Log,
    Request,
    RunProtocol,
    Send,
    Wait,
    callbacks,
    task_path,
    why,
)
from gateway.integrations.runstate import CREATE, OVER, START, STARTING, WAIT, RunState, SenderConfig

# Runs with something left to send, kept per process; beyond, the oldest is dropped (with a warning).
MAX_RUNS = 1000
# The longest cancel reason the gateway takes.
MAX_CANCEL_REASON = 1024
# The backoff between two tries of one request.
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.05, 2.0


@dataclass(eq=False)
class Cancel:
    """A cancel the queue asked for (``POST /v1/tasks/{id}/cancel``, the API key): sent after ``after`` (the
    run it cancels, in this process) has had its start answered and its progress sent, retried until
    ``expires_at_ms`` (the task's deadline, epoch ms)."""

    task_id: str
    reason: str | None
    expires_at_ms: float
    after: RunState | None = None
    retry_at: float = 0.0  # no request before
    failures: int = 0
    done: bool = False

    def over(self) -> None:
        """Nothing to undo."""


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
    done: bool = False

    def over(self) -> None:
        """Nothing to undo."""


Item = RunState | Cancel | Lost


class Outbox:
    """Every item of one process waiting to be sent, in the order it came, for the gateway of ``config``."""

    def __init__(self, config: SenderConfig) -> None:
        self.config = config
        self.items: list[Item] = []
        self.down_since: float | None = None  # when a request first failed to reach the gateway
        self._logs: list[Log] = []
        self.runs = RunProtocol(config, self._log)

    def add(self, item: Item) -> None:
        self.items.append(item)
        while len(self.items) > MAX_RUNS:
            dropped = self.items.pop(0)
            self._log(
                logging.WARNING,
                "task-gateway: more than %d runs and cancels wait; dropping what %s has not sent",
                MAX_RUNS,
                dropped.task_id,
            )
            dropped.over()

    def unsent(self) -> int:
        """How many reports wait (a run's start, progress, outcome; a cancel; a lost run's fail)."""
        return sum(item.unsent() if isinstance(item, RunState) else 1 for item in self.items)

    def take_logs(self) -> list[Log]:
        logs, self._logs = self._logs, []
        return logs

    def _log(self, level: int, message: str, *args: Any) -> None:
        self._logs.append(Log(level, message, args))

    # --- what to do next ------------------------------------------------------------------------------------

    def next(self, item: Item, now: float, wall_ms: float) -> Send | Wait | Done:
        """What to do now for ``item``: send a request (at most one), wait, or forget it (:class:`Done`:
        it is no longer among the items)."""
        if isinstance(item, Cancel):
            decision = self._next_cancel(item, now, wall_ms)
        elif isinstance(item, Lost):
            decision = self._next_lost(item, now, wall_ms)
        else:
            decision = self._next_run(item, now, wall_ms)
        if isinstance(decision, Done):
            item.over()
            if item in self.items:
                self.items.remove(item)
        return decision

    def _next_run(self, run: RunState, now: float, wall_ms: float) -> Send | Wait | Done:
        if run.phase == OVER or run.handed:
            return DONE
        if wall_ms >= run.expires_at_ms:
            if not run.idle():
                self._log(
                    logging.WARNING,
                    "task-gateway: task %s passed its deadline; dropping its unsent reports",
                    run.task_id,
                )
            return DONE
        if now < run.retry_at:
            return Wait(run.retry_at)
        if run.phase in (CREATE, START, WAIT) and self._behind(run):
            return Wait(now + WAIT_POLL_S)
        return self.runs.request(run, now)

    def _behind(self, run: RunState) -> bool:
        """An earlier run of ``run``'s task, in this process, has not sent everything yet."""
        before = itertools.takewhile(lambda other: other is not run, self.items)
        return any(
            isinstance(other, RunState)
            and other.task_id == run.task_id
            and other.phase != OVER
            and not other.handed
            for other in before
        )

    def _finished(self, item: Cancel | Lost, wall_ms: float, what: str) -> bool:
        """Answered already, or past its task's deadline (said: ``what`` could not be done)."""
        if not item.done and wall_ms >= item.expires_at_ms:
            self._log(logging.WARNING, "task-gateway: could not %s before its deadline", what)
        return item.done or wall_ms >= item.expires_at_ms

    def _next_cancel(self, cancel: Cancel, now: float, wall_ms: float) -> Send | Wait | Done:
        if self._finished(cancel, wall_ms, f"cancel task {cancel.task_id}"):
            return DONE
        after = cancel.after
        if after is not None and (after.phase in STARTING or after.reporting()):
            # Its run has not started (the task may not even be made yet), or has progress still to send,
            # which the cancel would refuse: the cancel goes after what the job reported before it.
            return Wait(now + WAIT_POLL_S)
        if now < cancel.retry_at:
            return Wait(cancel.retry_at)
        body = {} if cancel.reason is None else {"reason": cancel.reason}
        return Send(Request("cancel", f"{task_path(cancel.task_id)}/cancel", body, self.config.api_key))

    def _next_lost(self, lost: Lost, now: float, wall_ms: float) -> Send | Wait | Done:
        if self._finished(lost, wall_ms, f"fail task {lost.task_id}, whose run was lost,"):
            return DONE
        if now < lost.retry_at:
            return Wait(lost.retry_at)
        event = {"type": "fail", "error": lost.error, "retryable": False}
        body = {"callbackId": f"{lost.task_id}:lost", "event": event}
        return Send(Request("lost", callbacks(lost.task_id), body, lost.token))

    # --- what happened --------------------------------------------------------------------------------------

    def unanswered(self, item: Item, request: Request, why: str, now: float) -> None:
        """``request`` got no answer (refused, reset, timed out): try it again later."""
        self._unreachable(why, now)
        self._later(item, why, now, None)

    def answered(self, item: Item, request: Request, answer: Answer, now: float) -> None:
        """``request`` (what :meth:`next` said to send for ``item``) was answered."""
        if answer.status >= 500:
            self._unreachable(f"HTTP {answer.status}", now)
        else:
            self._reached(now)
        if retried(answer.status):
            self._later(item, f"HTTP {answer.status}", now, answer.retry_after)
        elif isinstance(item, Cancel):
            if answer.status >= 300:
                said = why(answer)
                self._log(logging.WARNING, "task-gateway: could not cancel task %s: %s", item.task_id, said)
            item.done = True
        elif isinstance(item, Lost):
            self._lost(item, answer)
        else:
            self.runs.read(item, request, answer, now)

    def _later(self, item: Item, why: str, now: float, retry_after: str | None) -> None:
        """No answer to ``item``'s request (or one to try again): when to try again."""
        if isinstance(item, RunState):
            item.unreachable = True
            item.unblock()  # the job does not wait for a gateway it cannot reach
        backoff = Backoff(base_s=BACKOFF_BASE_S, cap_s=BACKOFF_CAP_S, failures=item.failures)
        item.retry_at = now + pause_s(backoff, retry_after)
        item.failures += 1
        self._log(logging.DEBUG, "task-gateway: %s: %s; trying again", item.task_id, why)

    def _unreachable(self, why: str, now: float) -> None:
        """A request did not reach the gateway (or it answered 5xx): a WARNING, unless one was said since
        the gateway last answered."""
        if self.down_since is None:
            self.down_since = now
            self._log(
                logging.WARNING,
                "task-gateway: cannot reach %s (%s); %d reports wait and are retried until their task's "
                "deadline",
                self.config.url,
                why,
                self.unsent(),
            )

    def _reached(self, now: float) -> None:
        """The gateway answered: an INFO if it could not be reached before."""
        if self.down_since is not None:
            self._log(
                logging.INFO,
                "task-gateway: reached %s again after %.1f s; sending the reports that waited",
                self.config.url,
                now - self.down_since,
            )
            self.down_since = None

    def _lost(self, lost: Lost, answer: Answer) -> None:
        lost.done = True
        if answer.status >= 300:
            self._log(
                logging.WARNING,
                "task-gateway: could not fail task %s, whose run was lost: %s",
                lost.task_id,
                why(answer),
            )
        elif answer.body.get("reason") == "not-running":
            reason = f"its run was lost: {lost.error}"[:MAX_CANCEL_REASON]
            self.add(Cancel(lost.task_id, reason, lost.expires_at_ms))
