"""A queue's group of jobs as a batch on the gateway (protocol.md, Batches): a parent task whose children
are the group's jobs, its counts kept by the gateway, its progress moved by them (``progressFromChildren``).

The parent is made by the producer as the group's first job is published (created with the API key, then
started: it runs while its children do), and ended by the workers: a group's parent by the worker whose job
ends the group (it reads the parent's counts after its own outcome was taken: all the group's jobs ended,
it ends the parent, ``succeed`` when every child succeeded, else ``fail`` saying how many did not); a
chord's by its body's run (the body's outcome, and a final ``fail`` of a header job, after which Celery runs
no body). Two workers may both find the group ended: the parent's end carries one callback id, so the second
is a harmless repeat. Of two workers whose last children end at once, the one whose outcome was taken last
reads counts that hold the other's (each reads after its own outcome was answered), so one of them ends it.

What travels with each child (its ticket's ``batch``): the parent's id and callback token, the group's size
(``None`` when not known: the parent is then ended only by a chord's body) and a chord's body's task id. The
decisions here are pure (:func:`parent_end`, :func:`group_title`); :func:`open_batch` and :func:`end_batch`
send, through the reporter, bounded by its timeout.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.client.errors import BackendError
from gateway.integrations.report import Reporter
from gateway.integrations.ticket import Ticket, clean_title, result_hash

log = logging.getLogger("gateway.integrations")

# The states of a child that has ended, as a parent's ``children`` counts them.
ENDED = ("succeeded", "failed", "expired")
# A title lists at most this many of a group's job names.
MAX_NAMES = 3


@dataclass(frozen=True)
class Batch:
    """The parent task of a group: its id, its callback token (``None``: not known here), how many jobs the
    group has (``None``: not known), a chord's body's task id (``None``: a group, ended by its children)."""

    id: str
    token: str | None
    size: int | None = None
    body: str | None = None

    def to_header(self) -> dict[str, Any]:
        header: dict[str, Any] = {"id": self.id}
        for key, value in (("token", self.token), ("size", self.size), ("body", self.body)):
            if value is not None:
                header[key] = value
        return header

    @classmethod
    def from_header(cls, header: Any) -> Batch | None:
        if not isinstance(header, Mapping) or not isinstance(header.get("id"), str):
            return None
        token, size, body = header.get("token"), header.get("size"), header.get("body")
        return cls(
            str(header["id"]),
            token if isinstance(token, str) else None,
            size if isinstance(size, int) and not isinstance(size, bool) else None,
            body if isinstance(body, str) else None,
        )


def group_title(names: Sequence[str], size: int | None, body: str | None = None) -> str:
    """A group's title, from its jobs' names (in order, each once, at most :data:`MAX_NAMES`) and its size:
    ``export_report: 20 jobs``; a chord's ends with its body's: ``export_report: 20 jobs, then merge``."""
    seen = list(dict.fromkeys(str(name).rpartition(".")[2] or str(name) for name in names))
    shown = ", ".join(seen[:MAX_NAMES]) + (", …" if len(seen) > MAX_NAMES else "")
    title = shown or "group"
    if size is not None:
        title += f": {size} job{'' if size == 1 else 's'}"
    if body is not None:
        title += f", then {body.rpartition('.')[2] or body}"
    return clean_title(title) or "group"


def parent_end(task: Mapping[str, Any], size: int | None) -> dict[str, Any] | None:
    """The event that ends a group's parent (``task``: as the gateway answers a read of it) once every job
    of the group has ended (``size`` of them, at least), else ``None``: ``succeed`` when all succeeded,
    else a final ``fail`` that says how many did not."""
    children = task.get("children")
    if size is None or task.get("state") != "running" or not isinstance(children, Mapping):
        return None
    total = int(children.get("total", 0))
    ended = sum(int(children.get(state, 0)) for state in ENDED)
    if total < size or ended < total:
        return None
    if int(children.get("succeeded", 0)) == total:
        ref = f"batch://{task.get('id', '')}"
        return {"type": "succeed", "resultRef": ref, "resultHash": result_hash(dict(children))}
    failed = total - int(children.get("succeeded", 0))
    return {"type": "fail", "error": f"{failed} of {total} jobs did not succeed", "retryable": False}


def chord_end(batch: Batch, task_id: str, outcome: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The event that ends a chord's parent after the run of ``task_id`` reported ``outcome``: the body's
    outcome (its failure, final), or a header job's final failure (Celery then runs no body); else
    ``None``."""
    if batch.body is None or outcome is None:
        return None
    if outcome.get("type") == "succeed":
        return dict(outcome) if task_id == batch.body else None
    if outcome.get("type") != "fail" or outcome.get("retryable"):
        return None
    what = "the chord's body" if task_id == batch.body else f"the chord's job {task_id}"
    return {"type": "fail", "error": f"{what} failed: {outcome.get('error', '')}", "retryable": False}


def open_batch(reporter: Reporter, parent_id: str, asked: Ticket) -> Ticket | None:
    """Create the parent ``parent_id`` as ``asked`` (its title, tags, deadline; its progress from its
    children) and start it; the ticket with its token, or ``None`` (logged) when it could not be made."""
    ticket = reporter.create_ticket(parent_id, asked)
    if ticket is None or ticket.token is None:
        return None
    event = {"type": "start", "worker": f"producer@{socket.gethostname()}"}
    body = {"callbackId": f"{parent_id}:batch-start", "event": event}
    if not _callback(reporter, parent_id, ticket.token, body, "start"):
        return None
    return ticket


def end_batch(reporter: Reporter, batch: Batch, event: Mapping[str, Any]) -> None:
    """End the parent with ``event`` (one callback id for every worker that may send it)."""
    if batch.token is None:
        return
    body = {"callbackId": f"{batch.id}:batch-end", "event": dict(event)}
    _callback(reporter, batch.id, batch.token, body, str(event.get("type")))


def close_group(reporter: Reporter, batch: Batch) -> None:
    """A job of the group ended (its outcome taken): read the parent's counts (the API key) and end it when
    the whole group has ended."""
    if batch.size is None or batch.token is None:
        return
    try:
        task = reporter.request(f"read batch {batch.id}", reporter.wire.get(batch.id))
    except BackendError as refused:
        log.warning("task-gateway: cannot read batch %s to end it: %s", batch.id, refused)
        return
    event = parent_end(task, batch.size) if task is not None else None
    if event is not None:
        end_batch(reporter, batch, event)


def _callback(reporter: Reporter, task_id: str, token: str, body: dict[str, Any], what: str) -> bool:
    """Send a callback of the parent with its token; whether the gateway took it (said when not)."""
    try:
        answer = reporter.request(f"{what} batch {task_id}", reporter.wire.callback(task_id, token, body))
    except BackendError as refused:
        log.warning("task-gateway: %s of batch %s refused: %s", what, task_id, refused)
        return False
    return answer is not None
