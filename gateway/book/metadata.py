"""Metadata patches (protocol.md, Metadata), and the reads that make good a change beside the history whose
bus message was lost or too large for one.

A patch is an RFC 7396 merge patch on the task's metadata, in one transaction under the task's row lock: no
history entry, ``version`` as it was, ``revision`` + 1 when it changed something, and the new state beside
the history announced in the same transaction (``gateway.bus.base.News.besides``). A worker's patch (with the
callback token) is fenced by ``attempt`` as its callbacks are, is taken only while its attempt runs, and
renews the heartbeat lease; a backend's (the API key) may patch any task, ended ones too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.book.book import Book, _Commit
from gateway.bus.base import News
from gateway.errors import UnknownTask
from gateway.lease import Lease, fence, heartbeat, lease_of, renewal
from gateway.machine import Task
from gateway.metadata import patched
from gateway.store.base import WriteTx
from gateway.store.db_deadline import shielded


@dataclass(frozen=True, slots=True)
class Patched:
    """A patch's outcome: the task after it, whether it changed the metadata, and a worker's lease."""

    task: Task
    changed: bool
    lease: Lease | None = None


class MetadataBook:
    """Metadata patches over a book, and the reads of the state beside the history the hub makes."""

    def __init__(self, book: Book) -> None:
        self.book = book
        self.deadline_s = book.deadline_s

    @shielded
    async def patch(
        self, task_id: str, patch: dict[str, Any], *, attempt: int | None, worker: bool
    ) -> Patched:
        """Merge ``patch`` into the task's metadata. ``worker``: the running attempt's own patch (fenced,
        ``409 not-running`` once its attempt is over, its lease renewed); else a backend's, fenced only when
        it gives ``attempt``."""
        book = self.book

        async def work(tx: WriteTx, commit: _Commit) -> tuple[Patched, int | None]:
            stored = (await tx.lock_tasks([task_id])).get(task_id)
            if stored is None:
                raise UnknownTask(task_id)
            task = stored.task
            fence(task, attempt)
            until = None
            if worker:
                heartbeat(task)  # 409 not-running once its attempt is over
                until = renewal(task, stored.heartbeat_ms, book.clock())
            after = patched(task, patch)
            if after is not None:
                await tx.write_tasks([after])
                await book._announce(tx, commit, [News.besides(after)])
            if until is not None:
                await tx.renew_leases([(task_id, until)])
            now = after or task
            lease = lease_of(now, stored.heartbeat_ms, until) if worker else None
            return Patched(now, after is not None, lease), until

        done, until = await book._write(work)
        if until is not None:
            book.listeners.deadline_set(until)
        return done

    @shielded
    async def get(self, task_id: str) -> Task:
        return await self.book.get(task_id)

    @shielded
    async def revisions_ahead(self, known: Mapping[str, int]) -> dict[str, int]:
        """Of the tasks in ``known`` (id -> a revision), those stored at a higher revision, with it."""
        async with self.book.store.read() as tx:
            return await tx.revisions_ahead(known)
