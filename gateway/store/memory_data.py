"""What the store's in-memory twin (``gateway.store.memory``) holds: every table as a plain structure, the
deletion of tasks with what they own (and its undo), and the rules its reads and updates share with SQL."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from gateway.machine import Task
from gateway.store.base import DrainBatch, Notification, Receipt, StoredTask
from gateway.streams import Batch, Head


@dataclass
class Data:
    tasks: dict[str, StoredTask] = field(default_factory=dict)
    entries: dict[str, list[tuple[int, bytes]]] = field(default_factory=dict)
    # Each callback id's digest, and its task.
    callbacks: dict[str, tuple[str, str]] = field(default_factory=dict)
    receipts: dict[str, Receipt] = field(default_factory=dict)
    # (id, notification, drained) in insertion order; (task, state, version) is unique, as in SQL.
    outbox: list[tuple[int, Notification, bool]] = field(default_factory=list)
    outbox_keys: set[tuple[str, str, int]] = field(default_factory=set)
    # The last outbox id given (ids are never reused, as a SQL sequence's).
    outbox_ids: int = 0
    # The relay's mark of each outbox row, by id: (relayed at or None, attempts, next at).
    relay: dict[int, tuple[int | None, int, int]] = field(default_factory=dict)
    # The answers of keyed drains, by key.
    drain_batches: dict[str, DrainBatch] = field(default_factory=dict)
    # When each terminal task finished (``tasks.finished_at_ms``).
    finished: dict[str, int] = field(default_factory=dict)
    # Each task's streams by name: its head, and its batches in offset order.
    streams: dict[str, dict[str, tuple[Head, list[Batch]]]] = field(default_factory=dict)

    def untaken(self, *, relay: bool) -> set[str]:
        """The tasks with a notification nobody took: not drained, nor relayed when ``relay``."""
        return {
            n.task_id
            for i, n, drained in self.outbox
            if not drained and not (relay and self.relay[i][0] is not None)
        }

    def forget(self, task_ids: set[str]) -> Callable[[], None]:
        """Delete these tasks and everything they own (``queries.TASK_OWNED``); returns the undo."""
        # Every field as it was (each a copy): the undo puts them back; not the last id given (never again).
        saved = {f.name: copy.copy(getattr(self, f.name)) for f in fields(self) if f.name != "outbox_ids"}
        gone = {i for i, n, _ in self.outbox if n.task_id in task_ids}
        for task_id in task_ids:
            self.tasks.pop(task_id, None)
            self.entries.pop(task_id, None)
            self.finished.pop(task_id, None)
            self.streams.pop(task_id, None)
        self.callbacks = {k: v for k, v in self.callbacks.items() if v[1] not in task_ids}
        self.receipts = {k: r for k, r in self.receipts.items() if r.task_id not in task_ids}
        self.outbox = [row for row in self.outbox if row[0] not in gone]
        self.outbox_keys = {key for key in self.outbox_keys if key[0] not in task_ids}
        self.relay = {i: mark for i, mark in self.relay.items() if i not in gone}

        def undo() -> None:
            for name, value in saved.items():
                setattr(self, name, value)

        return undo


def narrowed(found: list[Task], parent: str | None, title: str | None) -> list[Task]:
    """Those of ``found`` of ``parent`` and whose title contains ``title``, where given (case aside)."""
    if parent is not None:
        found = [t for t in found if t.parent == parent]
    if title:
        found = [t for t in found if t.title is not None and title.lower() in t.title.lower()]
    return found


def insert_only_kept(before: Task, task: Task) -> Task:
    """``task`` with the fields written once, at insert, as ``before`` has them: no update changes them (as
    in SQL, where no update sets their columns)."""
    fixed = ("tags", "created_at_ms", "epoch", "title", "parent", "progress_from_children")
    return replace(task, **{name: getattr(before, name) for name in fixed})
