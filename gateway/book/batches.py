"""A batch's writes inside the book's transactions (protocol.md, Batches): a child's creation under its
parent, and its parent's counts as children change state, in the transaction of the child's own write.

The parent's row is locked after the children's (a lock of a task then of its parent, always that way
round); on PostgreSQL two transactions that lock a parent and a child of it the other way round can still
meet (a batch that holds the parent's own callback and a child's), which PostgreSQL ends by rolling one
back: the writer raises it as ``StoreRace``, and the book runs it again (``gateway.store.pg_writer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gateway.bus.base import News
from gateway.children import children_progress, moved
from gateway.errors import Conflict, UnknownTask
from gateway.machine import Task, Transition, apply_event, task_to_json
from gateway.store.base import WriteTx


async def adopt(tx: WriteTx, child: Task) -> list[News]:
    """Count ``child``, being created, under its parent (locked), if it has one: ``404 unknown-task`` when
    there is no such task, ``409 parent-ended`` when it has ended. Returns the news of the creation for
    the subscribers of its tags and of its parent's batch (none for a task with neither), and of the
    parent's new counts."""
    if child.parent is None:
        return [News.creation(child)] if child.tags else []
    stored = (await tx.lock_tasks([child.parent])).get(child.parent)
    if stored is None:
        raise UnknownTask(child.parent)
    parent = stored.task
    if parent.terminal:
        raise Conflict(
            "parent-ended",
            f"task {parent.id} has ended ({parent.state}): a child is added only to a task that lives",
            task=task_to_json(parent),
        )
    counted = replace(
        parent, children=moved(parent.children, None, child.state), revision=parent.revision + 1
    )
    await tx.write_tasks([counted])
    return [News.creation(child), News.besides(counted)]


Move = tuple[Transition, str]  # a child's transition that changed its state, and its state before


async def recount(tx: WriteTx, moves: Sequence[Move], now_ms: int) -> tuple[list[Task], list[Transition]]:
    """The parents of the children these transitions moved, with their counts moved and their revision
    counted once per child move, locked and written in this transaction. Returns the parents whose counts
    changed with no entry (written here) and, for those created with ``progressFromChildren`` that now move
    their progress, the ``progress`` transitions (for the caller to record as any entry, counts included)."""
    if not moves:
        return [], []
    parents = {i: s.task for i, s in (await tx.lock_tasks([t.task.parent or "" for t, _ in moves])).items()}
    changed: set[str] = set()
    for transition, before in moves:
        parent = parents.get(transition.task.parent or "")
        if parent is None:  # deleted by retention before its child (only a child that outlived its keeping)
            continue
        counts = moved(parent.children, before, transition.task.state)
        parents[parent.id] = replace(parent, children=counts, revision=parent.revision + 1)
        changed.add(parent.id)
    counted: list[Task] = []
    progressed: list[Transition] = []
    for parent_id in sorted(changed):
        parent = parents[parent_id]
        event = children_progress(parent, now_ms)
        moving = apply_event(parent, event) if event is not None else None
        if moving is not None and moving.changed:
            progressed.append(moving)
        else:
            counted.append(parent)
    await tx.write_tasks(counted)
    return counted, progressed
