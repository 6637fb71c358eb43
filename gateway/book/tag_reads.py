"""The reads of tags (issue 18), over the store: a tag's tasks newest first, the tasks of some tags created
since a time, and the resumes of many tasks at once, each as :meth:`gateway.book.Book.resume` answers it.

Beside the book, not in it: each is one read transaction whose statements (``gateway.store.queries``) do
the work set-based, so that resuming the 200 tasks of a tag costs one query, not 200. Every method runs
within the database deadline, whatever cancels its caller (``gateway.store.db_deadline``).
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping, Sequence

from gateway.machine import Resume, Task, resume_from
from gateway.store.base import Store
from gateway.store.db_deadline import DB_DEADLINE_S, shielded
from gateway.tag_names import parent_key, parent_of


class TagReads:
    def __init__(self, store: Store, retention_versions: int, *, deadline_s: float = DB_DEADLINE_S) -> None:
        self.store = store
        # The entries a delta may carry (GATEWAY_RETENTION_VERSIONS), as the book's resume.
        self.retention_versions = retention_versions
        self.deadline_s = deadline_s

    @shielded
    async def list(self, tag: str, limit: int) -> tuple[builtins.list[str], bool]:
        """The ids of the tasks carrying ``tag``, newest first (``createdAtMs`` descending, then id
        descending), at most ``limit``; and whether more carry it. For a parent's key
        (``gateway.tag_names.parent_key``): the parent first, then its children newest first."""
        parent = parent_of(tag)
        async with self.store.read() as tx:
            if parent is None:
                ids = await tx.tagged(tag, limit + 1)
            else:
                children = await tx.newest_tasks(state=None, before=None, limit=limit, parent=parent)
                ids = [parent, *(child.id for child in children)]
        return ids[:limit], len(ids) > limit

    @shielded
    async def list_tasks(
        self,
        tags: Sequence[str],
        *,
        state: str | None,
        before: tuple[int, str] | None,
        limit: int,
        parent: str | None = None,
        title: str | None = None,
    ) -> builtins.list[Task]:
        """Up to ``limit`` tasks carrying every one of ``tags`` (every task, when there is none), newest
        first, after ``before`` (a ``(createdAtMs, id)``) if given, only those in ``state``, the children
        of ``parent`` and those whose title contains ``title`` if given: a page of ``GET /v1/tasks?tag=``
        (or ``?order=newest``, ``?parent=``, ``?title=``)."""
        async with self.store.read() as tx:
            if not tags:
                return await tx.newest_tasks(
                    state=state, before=before, limit=limit, parent=parent, title=title
                )
            return await tx.tagged_tasks(
                tags, state=state, before=before, limit=limit, parent=parent, title=title
            )

    @shielded
    async def tagged_since(self, tags: Sequence[str], since_ms: int) -> builtins.list[tuple[str, str, str]]:
        """``(tag, task id, epoch)`` of the tasks carrying any of ``tags`` created at or after ``since_ms``,
        by tag, then oldest first; for a parent's key, its children."""
        keys = [(tag, parent_of(tag)) for tag in tags]
        async with self.store.read() as tx:
            found = await tx.tagged_since([tag for tag, parent in keys if parent is None], since_ms)
            parents = [parent for _, parent in keys if parent is not None]
            if parents:
                found += [(parent_key(p), i, e) for p, i, e in await tx.children_since(parents, since_ms)]
            return found

    @shielded
    async def resume_many(
        self, cursors: Mapping[str, int], epochs: Mapping[str, str] | None = None
    ) -> dict[str, Resume]:
        """What a subscriber at each cursor (task id -> cursor, each an integer >= 0, of the history in
        ``epochs`` where it names one) missed, as :meth:`Book.resume <gateway.book.Book.resume>` would
        answer for each task: ``caught-up``, ``delta`` (the entries after the cursor) or ``snapshot``
        (``retention``, ``cursor-ahead``, ``recreated``). Tasks that do not exist are left out. One read
        transaction, one statement for the whole map."""
        if not cursors:
            return {}
        async with self.store.read() as tx:
            rows = await tx.resume_rows(cursors, self.retention_versions)
        found: dict[str, Resume] = {}
        for task_id, (task, entries) in rows.items():
            epoch = None if epochs is None else epochs.get(task_id)
            mode, reason = resume_from(task, cursors[task_id], self.retention_versions, epoch)
            found[task_id] = Resume(mode, reason, task, entries if mode == "delta" else ())
        return found
