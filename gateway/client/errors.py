"""The clients' exceptions, one tree (apart from the server's ``gateway.errors``, which the clients do not
import)::

    ClientError
    ├── BackendError          Backend/AsyncBackend: the gateway refused a management request with a 4xx
    │   │                     (status, code, message, task_id)
    │   ├── TaskExists        409 task-exists: a create with the id of a task made with other parameters
    │   └── UnknownTask       404 unknown-task: no task has this id
    ├── WatchError            watch(), watch_tag(): what retrying will not cure (bad token, unknown task,
    │                         not a gateway)
    └── WorkerError           a Worker's callback did not do what it asked (reason, task_id, task)
        ├── CallbackError     the gateway refused it with a 4xx (stale-attempt, unauthorized, ...)
        │   └── AttemptOver   the gateway says the worker's attempt is over (stale-attempt, not-running)
        └── CallbackIgnored   answered 200 but had no effect (terminal-conflict, not-running, ...)
            ├── TaskAlreadyRunning   start() on a task another worker is running
            └── TaskCancelled        the task was cancelled (POST /v1/tasks/{id}/cancel): stop working;
                                     what a callback or a heartbeat that learns of the cancel raises
"""

from __future__ import annotations

import functools
from typing import Any


class ClientError(Exception):
    """Root of every error the Python clients raise on purpose."""


class WatchError(ClientError):
    """What retrying will not cure: ``code`` is the gateway's error code (``unauthorized``, ``forbidden``,
    ``unknown-task``, ``invalid-request``) or the client's (``not-a-gateway``, ``disconnected``, ...);
    ``task_id`` or ``tag`` names the subscription it concerns, when it concerns one."""

    def __init__(
        self, code: str, message: str, task_id: str | None = None, *, tag: str | None = None
    ) -> None:
        about = f" (task {task_id})" if task_id else f" (tag {tag})" if tag else ""
        super().__init__(f"{code}: {message}{about}")
        self.code = code
        self.task_id = task_id
        self.tag = tag


class BackendError(ClientError):
    """The gateway refused a request of :class:`~gateway.client.Backend` (or ``AsyncBackend``) with a 4xx:
    retrying the same request would not help. ``code`` is the gateway's error code (``invalid-request``,
    ``unauthorized``, ``not-succeeded``, ...), ``task_id`` the task the request was about, if any."""

    def __init__(self, status: int, code: str, message: str, *, task_id: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}" + (f" (task {task_id})" if task_id else ""))
        self.status = status
        self.code = code
        self.message = message
        self.task_id = task_id


class TaskExists(BackendError):
    """``409 task-exists``: a task with this id exists, made with other parameters or tags (a create with
    the same ones is answered with the task, not this)."""


class UnknownTask(BackendError):
    """``404 unknown-task``: no task has this id (never made, or deleted by retention)."""


class WorkerError(ClientError):
    """A callback of a :class:`~gateway.client.Worker` had no effect. ``reason`` is the gateway's reason or
    error code; ``task`` the task as the gateway answered it (``None`` when the answer carries none)."""

    def __init__(self, message: str, *, task_id: str, reason: str, task: dict[str, Any] | None) -> None:
        super().__init__(message)
        self.task_id = task_id
        self.reason = reason
        self.task = task


class CallbackError(WorkerError):
    """The gateway refused the callback (a 4xx): retrying the same callback would not help."""

    def __init__(
        self, status: int, code: str, message: str, *, task_id: str = "", task: dict[str, Any] | None = None
    ) -> None:
        super().__init__(
            f"{status} {code}: {message}" + (f" (task {task_id})" if task_id else ""),
            task_id=task_id,
            reason=code,
            task=task,
        )
        self.status = status
        self.code = code
        self._message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable (a queue stores a job's exception: arq, Celery's result backends), as made.
        made = functools.partial(type(self), task_id=self.task_id, task=self.task)
        return (made, (self.status, self.code, self._message))


class AttemptOver(CallbackError):
    """The gateway says this worker's attempt is over: ``409 stale-attempt`` (another attempt has started
    since) or ``409 not-running`` to a heartbeat (the task was requeued, its lease having run out or the
    attempt having failed, or it has ended; ``task`` is then the task as the gateway answered it, and a
    cancelled task raises :class:`TaskCancelled` instead). Whatever the job does from here on no longer
    counts. Raised by the callback that was told so or, when the background heartbeat learns it, from the
    ``async with Worker(...)`` block, whose job is cancelled."""


class CallbackIgnored(WorkerError):
    """The gateway answered, but the callback changed nothing the worker asked for: the task had ended
    (``terminal-conflict``, or ``expired`` when the callback came after the deadline), was not running
    (``not-running``: requeued, say), could not start (``not-startable``), or the progress went back
    (``stale-progress``)."""

    def __init__(self, event_type: str, reason: str, task: dict[str, Any]) -> None:
        super().__init__(
            self._describe(event_type, reason, task),
            task_id=str(task.get("id", "")),
            reason=reason,
            task=task,
        )
        self.event_type = event_type

    @staticmethod
    def _describe(event_type: str, reason: str, task: dict[str, Any]) -> str:
        """The message: what had no effect, and why."""
        return (
            f"{event_type} callback had no effect on task {task.get('id')}: {reason} "
            f"(the task is {task.get('state', '?')}, attempt {task.get('attempts')})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable (a queue stores a job's exception: arq, Celery's result backends), as made.
        return (type(self), (self.event_type, self.reason, self.task or {}))


class TaskAlreadyRunning(CallbackIgnored):
    """``start`` found the task running an attempt this worker did not begin (another worker holding the
    same token). ``start(..., take_over=True)`` adopts that attempt instead of raising."""


# The ``error`` of a cancelled task (``failed``): gateway.machine.CANCELLED, which the clients do not import.
CANCELLED = "cancelled"


class TaskCancelled(CallbackIgnored):
    """The callback was ignored because the task was cancelled (``POST /v1/tasks/{id}/cancel``: the task is
    ``failed`` with ``error: "cancelled"``): the work is no longer wanted, so stop it. ``reason`` is the
    gateway's: ``terminal-conflict`` to a callback, ``not-running`` to a heartbeat (``event_type``
    ``"heartbeat"``: the background heartbeat of ``async with Worker(...)`` learned of the cancel, and the
    block raises it). Its message says so: ``task report-42 was cancelled (progress callback answered
    terminal-conflict; attempt 1)``."""

    @staticmethod
    def _describe(event_type: str, reason: str, task: dict[str, Any]) -> str:
        what = "heartbeat" if event_type == "heartbeat" else f"{event_type} callback"
        return (
            f"task {task.get('id')} was cancelled ({what} answered {reason}; attempt {task.get('attempts')})"
        )


def cancelled(task: dict[str, Any]) -> bool:
    """Whether ``task`` (its JSON) ended by a cancel."""
    return task.get("state") == "failed" and task.get("error") == CANCELLED


def ignored(event_type: str, reason: str, task: dict[str, Any]) -> CallbackIgnored:
    """The error for a callback that had no effect: :class:`TaskCancelled` when the task was cancelled."""
    if reason == "terminal-conflict" and cancelled(task):
        return TaskCancelled(event_type, reason, task)
    return CallbackIgnored(event_type, reason, task)
