"""The reporter's sender: one thread per process that sends every run's callbacks, in order (start, the
progress, the outcome), each with a stable id, retried with backoff until answered or the task's deadline;
the cancels a queue asks for and the final ``fail`` of runs the queue lost, the same way.

Why a thread of its own: the job must never wait for the gateway (a slow or stopped gateway slows nothing),
yet what it reported must reach the gateway in order, and exactly once in effect (the callback ids make a
retry harmless). The handlers that cancel (Celery's ``task_revoked`` runs in the worker's main process, the
one taking messages) return at once too.

This is the thin part that does I/O: the decisions are the outbox's (``outbox.py``, Sans-I/O, with
``run_protocol.py`` for a single run). The thread asks the outbox what to do with each item, sends the
request it says with httpx, hands the answer back (or says none came), writes the outbox's log lines, and
sleeps until the earliest time it was told, or until a job wakes it.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import httpx

from gateway.integrations.outbox import Item, Outbox
from gateway.integrations.run import Run
from gateway.integrations.run_protocol import Answer, Done, Request, Wait
from gateway.integrations.ticket import GatewayConfig

log = logging.getLogger("gateway.integrations")

# The longest the thread sleeps without looking at its items.
IDLE_S = 1.0
KEEPALIVE_S = 2.0  # below the gateway's idle timeout (5 s), as the Worker's


class Sender:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.client = httpx.Client(
            base_url=config.url.rstrip("/"),
            timeout=config.timeout_s,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S),
        )
        self.outbox = Outbox(config)
        self._cond = threading.Condition()  # held around every use of the outbox
        self._woken = False
        self._thread = threading.Thread(target=self._loop, name="task-gateway-reporter", daemon=True)
        self._thread.start()

    def add(self, item: Item) -> None:
        with self._decide(None):
            self.outbox.add(item)
            self._woken = True
            self._cond.notify()

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                items = list(self.outbox.items)
            due = math.inf
            for item in items:
                try:
                    due = min(due, self._step(item))
                except Exception:  # a bug must not stop every other run's reports
                    log.exception("task-gateway: reporting %s failed", item.task_id)
                    due = min(due, time.monotonic() + IDLE_S)
            with self._cond:
                if not self._woken:
                    self._cond.wait(min(IDLE_S, max(0.0, due - time.monotonic())))
                self._woken = False

    def _step(self, item: Item) -> float:
        """Do what the outbox says for ``item`` (at most one request); when to look at it again."""
        with self._decide(item):
            decision = self.outbox.next(item, time.monotonic(), time.time() * 1000)
        if isinstance(decision, Wait):
            return decision.until
        if isinstance(decision, Done):
            return math.inf
        answer = self._send(decision.request)
        with self._decide(item):
            if isinstance(answer, Answer):
                self.outbox.answered(item, decision.request, answer, time.monotonic())
            else:
                self.outbox.unanswered(item, decision.request, answer, time.monotonic())
        return time.monotonic()

    @contextmanager
    def _decide(self, item: Item | None) -> Iterator[None]:
        """Hold the outbox (and the run, whose job may be writing to it) for a decision; then write the
        lines it left, outside the locks."""
        with self._cond, item.lock if isinstance(item, Run) else nullcontext():
            yield
            logs = self.outbox.take_logs()
        for line in logs:
            log.log(line.level, line.message, *line.args)

    def _send(self, request: Request) -> Answer | str:
        """The gateway's answer to ``request``, or why there is none (a transport error)."""
        headers = {"Authorization": f"Bearer {request.token}"} if request.token else {}
        sent_at = time.monotonic()
        try:
            if request.body is None:
                response = self.client.get(request.path, headers=headers)
            else:
                response = self.client.post(request.path, json=request.body, headers=headers)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"
        try:
            body = response.json()
        except ValueError:
            body = {}
        return Answer(
            response.status_code,
            body if isinstance(body, dict) else {},
            sent_at,
            response.headers.get("retry-after"),
        )
