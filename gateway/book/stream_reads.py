"""The reads of a task's streams (protocol.md, Streams, Read), over the store: its streams' totals, a page
of a stream from an offset, a stream's text.

Beside the book, as the tag reads are: each is one read transaction whose decisions are
``gateway.streams``' (where a read starts, how a page is cut), and each reads the task too, so that the
caller checks the credential against it (a tag token's tag) and answers ``closed`` and ``epoch`` with the
chunks. A page reads its batches a few at a time, as many as the stream's average batch says its page
needs, never the whole stream; every method runs within the database deadline, whatever cancels its caller
(``gateway.store.db_deadline``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.errors import UnknownTask
from gateway.machine import Task, same_history
from gateway.store.base import ReadTx, Store
from gateway.store.db_deadline import DB_DEADLINE_S, shielded
from gateway.streams import PAGE_BYTES, Batch, Head, Page, page_of, read_start, rows_to_read, text_of

# A stream's batches, all of them, in one statement: what a text read asks for.
_ALL = 2**31


@dataclass(frozen=True, slots=True)
class Text:
    """A stream's text, with the attempt it is of and the offset after its last chunk."""

    attempt: int
    next_offset: int
    text: str


class StreamReads:
    def __init__(self, store: Store, *, deadline_s: float = DB_DEADLINE_S) -> None:
        self.store = store
        self.deadline_s = deadline_s

    @shielded
    async def heads(self, task_id: str) -> tuple[Task, list[Head]]:
        """The task and its streams' totals, by name."""
        async with self.store.read() as tx:
            task = await _task(tx, task_id)
            return task, (await tx.stream_heads([task_id])).get(task_id, [])

    @shielded
    async def next_offsets(self, task_ids: Sequence[str]) -> dict[str, dict[str, int]]:
        """The next offset of each stream of these tasks, by task and name (a task with none is left out)."""
        async with self.store.read() as tx:
            heads = await tx.stream_heads(task_ids)
        return {task_id: {h.name: h.next_offset for h in found} for task_id, found in heads.items()}

    @shielded
    async def page(
        self,
        task_id: str,
        name: str,
        offset: int,
        epoch: str | None,
        limit: int,
        page_bytes: int = PAGE_BYTES,
    ) -> tuple[Task, Page]:
        """The task and a page of its stream ``name`` read from ``offset`` (of the history ``epoch``, or a
        bare offset): at most ``limit`` chunks and ``page_bytes``, from where :func:`read_start` says."""
        async with self.store.read() as tx:
            task = await _task(tx, task_id)
            head = await _head(tx, task_id, name)
            start = read_start(head, offset, same_history=same_history(task, epoch))
            attempt, rows = head.attempt if head is not None else 0, rows_to_read(head, limit, page_bytes)
            batches: list[Batch] = []
            at = start
            while True:
                found = await tx.stream_batches(task_id, name, at, rows)
                # Going on from a batch's end finds that batch again when it is the stream's last.
                batches += found if not batches else [b for b in found if b.offset >= at]
                complete = len(found) < rows
                page = page_of(
                    start, batches, attempt=attempt, limit=limit, complete=complete, page_bytes=page_bytes
                )
                if page is not None:
                    return task, page
                at = batches[-1].offset + batches[-1].count

    @shielded
    async def text(self, task_id: str, name: str) -> tuple[Task, Text]:
        """The task and its stream ``name``'s text (empty for a stream not made yet): its batches read in
        one statement, so that the text is of one attempt and ends where its ``next_offset`` says."""
        async with self.store.read() as tx:
            task = await _task(tx, task_id)
            head = await _head(tx, task_id, name)
            batches = await tx.stream_batches(task_id, name, head.first_offset if head else 0, _ALL)
        if batches:
            last = batches[-1]
            return task, Text(batches[0].attempt, last.offset + last.count, text_of(batches))
        return task, Text(head.attempt if head else 0, head.next_offset if head else 0, "")


async def _task(tx: ReadTx, task_id: str) -> Task:
    stored = await tx.task(task_id)
    if stored is None:
        raise UnknownTask(task_id)
    return stored.task


async def _head(tx: ReadTx, task_id: str, name: str) -> Head | None:
    heads = (await tx.stream_heads([task_id])).get(task_id, [])
    return next((head for head in heads if head.name == name), None)
