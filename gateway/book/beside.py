"""What a create gives a task beside its history (protocol.md, Shapes): its title, metadata, parent and
whether its children move its progress; and when a create of an id that exists is the same create again."""

from __future__ import annotations

from dataclasses import dataclass, replace

import orjson

from gateway.errors import Conflict
from gateway.machine import Task
from gateway.store.base import StoredTask


@dataclass(frozen=True, slots=True)
class Beside:
    """A create's fields beside the history (``metadata``: compact JSON text, judged already)."""

    title: str | None = None
    metadata: str = "{}"
    parent: str | None = None
    progress_from_children: bool = False

    def on(self, task: Task) -> Task:
        return replace(
            task,
            title=self.title,
            metadata=self.metadata,
            parent=self.parent,
            progress_from_children=self.progress_from_children,
        )


PLAIN = Beside()


def same_create(existing: StoredTask, task: Task, ttl_ms: int, heartbeat_ms: int | None) -> None:
    """``409 task-exists`` unless ``task`` (a create of an id that exists) asks for what ``existing`` was made
    with: its parameters, tags, title, parent and ``progressFromChildren``. Its metadata is not compared: the
    task's is live state, which a retried create leaves as it is now."""
    was = existing.task
    made = (existing.ttl_ms, was.max_attempts, existing.heartbeat_ms, was.tags)
    beside = (was.title, was.parent, was.progress_from_children)
    if made == (ttl_ms, task.max_attempts, heartbeat_ms, task.tags) and beside == (
        task.title,
        task.parent,
        task.progress_from_children,
    ):
        return
    text = (
        f"task {task.id} exists with other parameters (ttlMs {made[0]}, maxAttempts {made[1]}, heartbeatMs "
        f"{'none' if made[2] is None else made[2]}, tags {orjson.dumps(made[3]).decode()}, title "
        f"{orjson.dumps(was.title).decode()}, parent {orjson.dumps(was.parent).decode()}, "
        f"progressFromChildren {orjson.dumps(was.progress_from_children).decode()})"
    )
    raise Conflict("task-exists", text)
