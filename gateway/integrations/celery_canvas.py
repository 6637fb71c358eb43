"""What the Celery integration reads of Celery's own idioms beyond its signals: a ``group`` or ``chord``
being published (a batch: ``batch.py``), and ``self.update_state(state="PROGRESS", meta={...})`` in a task.

Celery sends no signal when a group is published, only one per message (``before_task_publish``), whose
headers name the group (``group``) but neither its size nor its jobs. The group being published is the
``self`` of ``group._apply_tasks`` up the stack of that signal (Celery 5.3 to 5.6, the releases the tests
run): its jobs give the batch its size and title. A chord's header is such a group; its body travels in each
header job's message (``embed["chord"]``), and the batch is written into the body's options (its
``headers``), so that the worker that publishes the body when the header is done makes it the batch's
child, and its run ends the batch.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

from celery import states
from celery.canvas import group

from gateway.integrations.batch import Batch
from gateway.integrations.report import Run
from gateway.integrations.ticket import HEADER

log = logging.getLogger("gateway.integrations.celery")

# How far up the stack of a publish the group being published is looked for.
MAX_FRAMES = 40
# Marks a task instance whose update_state reports to its run.
_WRAPPED = "_gateway_update_state"


def message_body(body: Any) -> tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]]:
    """A message's arguments, keyword arguments and embedded options (protocol 2: ``(args, kwargs,
    embed)``); empty ones for what is not that."""
    if isinstance(body, (list, tuple)) and len(body) == 3:
        args, kwargs, embed = body
        return (
            tuple(args) if isinstance(args, (list, tuple)) else (),
            dict(kwargs) if isinstance(kwargs, Mapping) else {},
            dict(embed) if isinstance(embed, Mapping) else {},
        )
    return (), {}, {}


def publishing_group() -> Any:
    """The ``group`` whose job is being published now (this thread's stack), else ``None``."""
    frame = sys._getframe(1)
    for _ in range(MAX_FRAMES):
        if frame.f_back is None:
            break
        frame = frame.f_back
        if frame.f_code.co_name == "_apply_tasks" and isinstance(frame.f_locals.get("self"), group):
            return frame.f_locals["self"]
    return None


def group_jobs(found: Any) -> tuple[int | None, list[str]]:
    """A group's size and its jobs' task names (``None`` and none when it cannot say)."""
    tasks = getattr(found, "tasks", None)
    try:
        jobs = list(tasks) if isinstance(tasks, (list, tuple)) else None
    except TypeError:  # pragma: no cover  (a group's tasks are a list, or Celery's regen of one)
        jobs = None
    if jobs is None:
        return None, []
    names = [str(job.get("task")) for job in jobs if isinstance(job, Mapping) and job.get("task")]
    return len(jobs), names


def chord_body(embed: Mapping[str, Any]) -> tuple[Any, str | None, str | None]:
    """The chord body a header job's message carries (the signature, its task's name, its task id)."""
    body = embed.get("chord")
    if not isinstance(body, Mapping):
        return None, None, None
    options = body.get("options")
    task_id = options.get("task_id") if isinstance(options, Mapping) else None
    name = body.get("task")
    return body, str(name) if name else None, str(task_id) if task_id else None


def carry(body: Any, batch: Batch) -> None:
    """Write ``batch`` into a chord body's options (the ``gateway`` header its message will carry)."""
    options = body.get("options")
    if not isinstance(options, dict):
        return
    headers = dict(options.get("headers") or {})
    given = headers.get(HEADER)
    header = dict(given) if isinstance(given, Mapping) else {}
    header["batch"] = batch.to_header()
    headers[HEADER] = header
    options["headers"] = headers


def meta_progress(meta: Mapping[str, Any]) -> int | None:
    """``current * 100 / total`` of an ``update_state`` meta (0 to 100, whole), else ``None``."""
    current, total = _number(meta.get("current")), _number(meta.get("total"))
    if current is None or total is None or total <= 0:
        return None
    return max(0, min(100, int(current * 100 // total)))


def _number(value: Any) -> float | None:
    """``value`` when it is a finite number (not a boolean), else ``None``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value) if abs(value) != float("inf") else None


def report_update_state(task: Any, current: Any) -> None:
    """Make ``task``'s ``update_state`` report a custom state's meta to its run (``current()``: the run of
    the job executing here), once per task instance: Celery's own ``update_state`` runs first."""
    if getattr(task, _WRAPPED, False):
        return
    original = task.update_state

    def update_state(task_id: Any = None, state: Any = None, meta: Any = None, **kwargs: Any) -> Any:
        stored = original(task_id=task_id, state=state, meta=meta, **kwargs)
        run = current()
        if isinstance(run, Run) and (task_id is None or str(task_id) == run.task_id):
            reported(run, state, meta)
        return stored

    task.update_state = update_state
    setattr(task, _WRAPPED, True)


def reported(run: Run, state: Any, meta: Any) -> None:
    """A custom state (``PROGRESS``: not one of Celery's own) with a meta dict: ``current``/``total`` move the
    progress (only up), and the meta is merged into the task's metadata."""
    if state in states.ALL_STATES or not isinstance(meta, Mapping):
        return
    value = meta_progress(meta)
    with run.lock:
        held = [v[0] for v in (run.latest, run.last_sent) if v is not None]
    if value is not None and (not held or value > max(held)):
        run.progress(value, cursor=f"{meta.get('current')}/{meta.get('total')}")
    try:
        run.metadata(meta)
    except ValueError as exc:
        log.warning("task-gateway: task %s: update_state's meta is not shown: %s", run.task_id, exc)
