"""Stream appends in the write path (protocol.md, Streams): decided among the callbacks of one group commit,
in their arrival order, against each stream as that transaction has it so far, and written with them.

The decisions are ``gateway.streams``'; here is what one transaction holds between them: the heads of the
streams of its tasks (read once for the batch), the batches it has taken, and the earlier attempts'
batches a retry's first append drops. A batch taken and then dropped in the same transaction (an append,
a retryable fail, a start and the next attempt's append, all in one group commit) is never written.
"""

from __future__ import annotations

from gateway.book.outcomes import CallbackOutcome, CallbackRequest
from gateway.bus.base import News
from gateway.errors import UnknownTask
from gateway.lease import heartbeat
from gateway.machine import Task
from gateway.store.base import StreamWrites, WriteTx
from gateway.streams import Append, Appended, Batch, Head, Lookup, Take, decide_append, duplicate

Key = tuple[str, str]  # a task id and a stream's name


class Appends:
    """The stream appends of one write transaction."""

    __slots__ = ("_dropped", "_heads", "_max_bytes", "_stored", "_taken", "_tx")

    def __init__(self, tx: WriteTx, heads: dict[str, list[Head]], max_bytes: int) -> None:
        self._tx = tx
        self._max_bytes = max_bytes
        self._heads = {task_id: {head.name: head for head in found} for task_id, found in heads.items()}
        self._stored = {(task_id, name) for task_id, found in self._heads.items() for name in found}
        self._taken: dict[Key, list[Batch]] = {}
        self._dropped: dict[Key, int] = {}

    async def decide(self, task: Task | None, request: CallbackRequest) -> CallbackOutcome:
        """An append's outcome (``request.append``'s, to ``task`` as the transaction has it), its batch taken
        when it is new; else the error that refuses it. Its transition is a heartbeat's: it changes nothing
        of the task, and renews the attempt's lease as a heartbeat does."""
        task_id, append = request.task_id, request.append
        if task is None:
            raise UnknownTask(task_id)
        assert append is not None
        appended = await self._appended(task, task_id, append)
        return CallbackOutcome(heartbeat(task), False, appended=appended)

    async def _appended(self, task: Task, task_id: str, append: Append) -> Appended:
        heads = self._heads.setdefault(task_id, {})
        decided = decide_append(
            task, heads.get(append.stream), append, streams=len(heads), max_bytes=self._max_bytes
        )
        if isinstance(decided, Lookup):
            return duplicate(append, await self._batch(task_id, append, decided))
        self._take(task_id, decided)
        return decided.answer

    def _take(self, task_id: str, take: Take) -> None:
        key = (task_id, take.head.name)
        self._heads[task_id][take.head.name] = take.head
        if take.replaces:
            self._taken.pop(key, None)  # the earlier attempt's, taken in this transaction: never written
            if key in self._stored:
                self._dropped[key] = take.head.first_offset
        self._taken.setdefault(key, []).append(take.batch)

    async def _batch(self, task_id: str, append: Append, lookup: Lookup) -> Batch:
        """The batch ``lookup.seq`` of the append's attempt (the stream's, as its head has it): taken in this
        transaction, or stored (read on the retry path alone: the attempt's last batch at its offset, one
        probe of the stream's key; an earlier one by its place among the stream's batches). The batches
        taken of a stream in this transaction are its attempt's last ones, up to the head's (an attempt
        that starts in it drops those taken before)."""
        taken = self._taken.get((task_id, append.stream), [])
        head = self._heads[task_id][append.stream]
        after = head.next_seq - 1 - lookup.seq  # the attempt's batches after it
        if after < len(taken):
            return taken[-1 - after]
        stored: Batch | None
        if lookup.offset is not None:
            found = await self._tx.stream_batches(task_id, append.stream, lookup.offset, 1)
            stored = next(
                (b for b in found if (b.offset, b.attempt) == (lookup.offset, append.attempt)), None
            )
        else:
            stored = await self._tx.stream_batch(task_id, append.stream, append.attempt, lookup.seq)
        if stored is None:  # every batch of the stream's attempt is kept: the store lost one
            raise RuntimeError(f"task {task_id}: batch {lookup.seq} of stream {append.stream} is missing")
        return stored

    def news(self) -> list[News]:
        """News of the batches taken, for the subscribers of their streams on every process: announced in
        the transaction and published after its commit, as an entry's."""
        return [
            News.appended(task_id, name, b.attempt, b.offset, b.count, b.chunks)
            for (task_id, name), batches in self._taken.items()
            for b in batches
        ]

    def writes(self) -> StreamWrites:
        """What the transaction writes of its appends."""
        heads = [(key, self._heads[key[0]][key[1]]) for key in self._taken]
        return StreamWrites(
            made=[(key[0], head) for key, head in heads if key not in self._stored],
            moved=[(key[0], head) for key, head in heads if key in self._stored],
            batches=[(key[0], key[1], batch) for key, batches in self._taken.items() for batch in batches],
            dropped=[(*key, before) for key, before in self._dropped.items()],
        )
