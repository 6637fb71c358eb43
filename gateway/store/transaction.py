"""The store's transaction: the interface's reads and writes as the statements of ``gateway.store.queries``,
run on a driver's own connection.

One class for every transaction of both databases, a read as well as a write, so that what a method
means is written once; a subclass says how a statement runs on its connection, and the little its
database does otherwise (``queries`` says what differs):

- ``gateway.store.sqlite_writer.SqliteTx``: SQLite's writes, on the writer's connection and thread;
- ``gateway.store.sql.SqliteReadTx``: SQLite's reads, on the engine's aiosqlite connections (WAL readers,
  which never wait for the writer);
- ``gateway.store.pg_writer.PgTx``: PostgreSQL's reads and writes on asyncpg, rows locked, lists of keys as
  one array, the batch writes held and sent together.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import orjson

from gateway.machine import Task, Transition
from gateway.store import queries as q
from gateway.store.base import DrainBatch, Notification, Outgoing, Receipt, StoredTask, StreamWrites
from gateway.store.tables import TASK_COLUMNS, changed_values, insert_only_values, task_from_row, task_values
from gateway.streams import Batch, Head


def spans(items: Sequence[tuple[Transition, bytes, float]]) -> dict[str, tuple[int, Task]]:
    """The row write of each task the transitions change: from the version before its first transition
    to its last state (several transitions of one task follow each other's versions)."""
    found: dict[str, tuple[int, Task]] = {}
    for transition, _, _ in items:
        task = transition.task
        before = found[task.id][0] if task.id in found else task.version - 1
        found[task.id] = (before, task)
    return found


def finished(items: Sequence[tuple[Transition, bytes, float]]) -> dict[str, int]:
    """When each task these transitions end finished: its notification's time (``tasks.finished_at_ms``)."""
    return {t.task.id: int(at) for t, _, at in items if t.notify}


def task_row(task: Task, ttl_ms: int, created_at_ms: int, heartbeat_ms: int | None) -> tuple[Any, ...]:
    """The parameters of ``queries.INSERT_TASK``."""
    return (*task_values(task).values(), *insert_only_values(task), ttl_ms, created_at_ms, heartbeat_ms)


def stored_from_row(row: Sequence[Any]) -> StoredTask:
    """A row of ``queries.SELECT_TASK``: the task's columns, then ``ttl_ms``, ``heartbeat_ms``,
    ``lease_until_ms``."""
    ttl_ms, heartbeat_ms, lease_until_ms = row[len(TASK_COLUMNS) : len(TASK_COLUMNS) + 3]
    return StoredTask(task_from_row(row), ttl_ms, heartbeat_ms, lease_until_ms)


def resumes_from_rows(rows: Sequence[Sequence[Any]]) -> dict[str, tuple[Task, list[tuple[int, bytes]]]]:
    """The rows of ``queries.RESUME_ROWS`` (by task, then version) as each task with its entries."""
    found: dict[str, tuple[Task, list[tuple[int, bytes]]]] = {}
    width = len(TASK_COLUMNS)
    for row in rows:
        task_id = row[0]
        held = found.get(task_id)
        if held is None:
            held = found[task_id] = (task_from_row(row), [])
        version, event = row[width], row[width + 1]
        if version is not None:
            held[1].append((version, event))
    return found


def stream_rows(writes: StreamWrites) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """A transaction's stream appends as rows of the statements that write them, in the order they run:
    ``DROP_BATCHES``, ``INSERT_BATCH``, ``INSERT_STREAM``, ``UPDATE_STREAM`` (its key last)."""
    return [
        (q.DROP_BATCHES, list(writes.dropped)),
        (q.INSERT_BATCH, [(t, name, *_batch_row(b)) for t, name, b in writes.batches]),
        (q.INSERT_STREAM, [(t, *_head_row(h)) for t, h in writes.made]),
        (q.UPDATE_STREAM, [(*_head_row(h)[1:], t, h.name) for t, h in writes.moved]),
    ]


def _batch(row: Sequence[Any]) -> Batch:
    """A row of ``queries.BATCH_COLUMNS`` (a driver's blobs as bytes)."""
    return Batch(row[0], row[1], row[2], row[3], bytes(row[4]))


def _batch_row(batch: Batch) -> tuple[Any, ...]:
    return (batch.offset, batch.count, batch.attempt, batch.size, batch.chunks)


def _head_row(head: Head) -> tuple[Any, ...]:
    """A head as the values of ``queries.HEAD_COLUMNS``."""
    return (
        head.name,
        head.attempt,
        head.first_offset,
        head.next_offset,
        head.size,
        head.next_seq,
        head.last_offset,
    )


class SqlTx:
    """A transaction of the SQL store; a subclass runs the statements.

    It keeps each task row as it read it (or last wrote it), so that an update writes only the columns
    that differ (a progress callback writes two: progress and version)."""

    __slots__ = ("_read",)

    # Appended to a query whose rows the transaction locks / claims (rows another transaction holds are
    # skipped): nothing where the transaction holds the database's one write lock (SQLite).
    LOCK = ""
    CLAIM = ""

    def __init__(self) -> None:
        self._read: dict[str, Task] = {}

    # --- how a subclass runs a statement -----------------------------------------------------------------

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> Sequence[Sequence[Any]]:
        """The rows of a query."""
        raise NotImplementedError

    async def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        """A statement's count of rows changed."""
        raise NotImplementedError

    async def run_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        """A statement once for each row of parameters; the rows changed, all told."""
        raise NotImplementedError

    def in_list(self, column: str, values: Sequence[Any]) -> Iterator[tuple[str, list[Any]]]:
        """Conditions "``column`` is one of ``values``" that cover ``values`` between them, each with its
        parameters; none when ``values`` is empty."""
        for start in range(0, len(values), q.IN_CHUNK):
            chunk = values[start : start + q.IN_CHUNK]
            yield f"{column} IN ({', '.join('?' * len(chunk))})", list(chunk)

    # --- reads ----------------------------------------------------------------------------------------

    async def task(self, task_id: str) -> StoredTask | None:
        return await self._select_task(task_id, "")

    async def entries(self, task_id: str, after: int, upto: int) -> list[tuple[int, bytes]]:
        return [(r[0], r[1]) for r in await self.fetch(q.ENTRIES, (task_id, after, upto))]

    async def ahead(self, known: Mapping[str, int]) -> dict[str, int]:
        if not known:
            return {}
        source, params = self.cursor_rows(known)
        return {r[0]: r[1] for r in await self.fetch(q.AHEAD.format(cursors=source), params)}

    async def revisions_ahead(self, known: Mapping[str, int]) -> dict[str, int]:
        if not known:
            return {}
        source, params = self.cursor_rows(known)
        return {r[0]: r[1] for r in await self.fetch(q.REVISIONS_AHEAD.format(cursors=source), params)}

    async def relay_pending(self) -> int:
        (row,) = await self.fetch(q.RELAY_PENDING)
        return int(row[0])

    async def next_deadline(self) -> int | None:
        (row,) = await self.fetch(q.NEXT_DEADLINE)
        deadline: int | None = row[0]
        return deadline

    async def next_lease_end(self) -> int | None:
        (row,) = await self.fetch(q.NEXT_LEASE_END)
        end: int | None = row[0]
        return end

    async def list_tasks(self, *, state: str | None, after: str | None, limit: int) -> list[Task]:
        query = q.list_tasks(by_state=state is not None, after=after is not None)
        params = [value for value in (state, after) if value is not None]
        return [task_from_row(r) for r in await self.fetch(query, (*params, limit))]

    async def newest_tasks(
        self,
        *,
        state: str | None,
        before: tuple[int, str] | None,
        limit: int,
        parent: str | None = None,
        title: str | None = None,
    ) -> list[Task]:
        if "\x00" in (parent or "") + (title or ""):  # no task has one, and PostgreSQL text cannot hold it
            return []
        query = q.newest_tasks(
            by_state=state is not None,
            before=before is not None,
            parent=parent is not None,
            title=bool(title),
        )
        params = [
            *((parent,) if parent is not None else ()),
            *(before or ()),
            *((state,) if state is not None else ()),
            *((q.contains_pattern(title),) if title else ()),
        ]
        return [task_from_row(r) for r in await self.fetch(query, (*params, limit))]

    # --- tags ---------------------------------------------------------------------------------------------

    async def tagged(self, tag: str, limit: int) -> list[str]:
        if "\x00" in tag:  # no tag has one (create refuses it), and PostgreSQL text cannot hold it
            return []
        return [r[0] for r in await self.fetch(q.TAGGED, (tag, limit))]

    async def tagged_tasks(
        self,
        tags: Sequence[str],
        *,
        state: str | None,
        before: tuple[int, str] | None,
        limit: int,
        parent: str | None = None,
        title: str | None = None,
    ) -> list[Task]:
        first, *others = tags
        if any("\x00" in text for text in (*tags, parent or "", title or "")):  # PostgreSQL text has none
            return []
        query = q.tagged_tasks(
            others=len(others),
            by_state=state is not None,
            before=before is not None,
            parent=parent is not None,
            title=bool(title),
        )
        params = [
            first,
            *(before or ()),
            *others,
            *((state,) if state is not None else ()),
            *((parent,) if parent is not None else ()),
            *((q.contains_pattern(title),) if title else ()),
            limit,
        ]
        return [task_from_row(r) for r in await self.fetch(query, params)]

    async def tagged_since(self, tags: Sequence[str], since_ms: int) -> list[tuple[str, str, str]]:
        found: list[tuple[str, str, str]] = []
        for condition, params in self.in_list("g.tag", sorted({t for t in tags if "\x00" not in t})):
            rows = await self.fetch(q.TAGGED_SINCE.format(tags=condition), (*params, since_ms))
            found += [(r[0], r[1], r[2]) for r in rows]
        return found  # the chunks follow each other in tag order

    async def children_since(self, parents: Sequence[str], since_ms: int) -> list[tuple[str, str, str]]:
        found: list[tuple[str, str, str]] = []
        for condition, params in self.in_list("parent", sorted({p for p in parents if "\x00" not in p})):
            rows = await self.fetch(q.CHILDREN_SINCE.format(parents=condition), (*params, since_ms))
            found += [(r[0], r[1], r[2]) for r in rows]
        return found

    async def resume_rows(
        self, cursors: Mapping[str, int], retention_versions: int
    ) -> dict[str, tuple[Task, list[tuple[int, bytes]]]]:
        if not cursors:
            return {}
        source, params = self.cursor_rows(cursors)
        rows = await self.fetch(q.RESUME_ROWS.format(cursors=source), (*params, retention_versions))
        return resumes_from_rows(rows)

    # --- streams ------------------------------------------------------------------------------------------

    async def stream_heads(self, task_ids: Sequence[str]) -> dict[str, list[Head]]:
        found: dict[str, list[Head]] = {}
        for condition, params in self.in_list("task_id", sorted({i for i in task_ids if "\x00" not in i})):
            for row in await self.fetch(q.STREAM_HEADS.format(ids=condition), params):
                found.setdefault(row[0], []).append(Head(*tuple(row)[1:]))
        return found

    async def stream_batches(self, task_id: str, name: str, start: int, limit: int) -> list[Batch]:
        rows = await self.fetch(q.STREAM_BATCHES, (task_id, name, task_id, name, start, limit))
        return [_batch(row) for row in rows]

    async def stream_batch(self, task_id: str, name: str, attempt: int, seq: int) -> Batch | None:
        rows = await self.fetch(q.STREAM_BATCH, (task_id, name, seq))
        found = _batch(rows[0]) if rows else None
        return found if found is not None and found.attempt == attempt else None

    async def write_streams(self, writes: StreamWrites) -> None:
        for sql, rows in stream_rows(writes):
            if rows:
                await self.run_many(sql, rows)

    def cursor_rows(self, cursors: Mapping[str, int]) -> tuple[str, list[Any]]:
        """A map of task id -> cursor as the rows ``c(id, after)`` of ``queries.RESUME_ROWS`` and ``AHEAD``,
        with its parameters: here one JSON object."""
        return q.SQLITE_CURSORS, [orjson.dumps(dict(cursors)).decode()]

    # --- writes ---------------------------------------------------------------------------------------

    async def lock_task(self, task_id: str) -> StoredTask | None:
        stored = await self._select_task(task_id, self.LOCK)
        if stored is not None:
            self._seen(stored.task)
        return stored

    async def lock_tasks(self, task_ids: Sequence[str]) -> dict[str, StoredTask]:
        found: dict[str, StoredTask] = {}
        for condition, params in self.in_list("id", sorted({i for i in task_ids if "\x00" not in i})):
            found.update(self._locked(await self.fetch(q.TASKS.format(ids=condition) + self.LOCK, params)))
        return found

    async def lock_tasks_and_heads(
        self, task_ids: Sequence[str], streamed: Sequence[str]
    ) -> tuple[dict[str, StoredTask], dict[str, list[Head]]]:
        locked = await self.lock_tasks(task_ids)
        return locked, await self.stream_heads(streamed) if streamed else {}

    def _locked(self, rows: Sequence[Sequence[Any]]) -> dict[str, StoredTask]:
        """Rows of ``queries.SELECT_TASK`` that this transaction locked, by task id."""
        found = {}
        for row in rows:
            stored = stored_from_row(row)
            found[stored.task.id] = stored
            self._seen(stored.task)
        return found

    async def insert_task(
        self, task: Task, ttl_ms: int, created_at_ms: int, heartbeat_ms: int | None = None
    ) -> None:
        await self.run(q.INSERT_TASK, task_row(task, ttl_ms, created_at_ms, heartbeat_ms))
        if task.tags:
            await self.run_many(q.INSERT_TASK_TAG, [(tag, task.id, created_at_ms) for tag in task.tags])

    async def record(self, transition: Transition, encoded_event: bytes, notify_at_ms: float) -> None:
        await self.record_many([(transition, encoded_event, notify_at_ms)])

    async def record_many(self, items: Sequence[tuple[Transition, bytes, float]]) -> None:
        # One executemany per set of changed columns (a batch of progress callbacks: one).
        updates: dict[str, list[tuple[Any, ...]]] = {}
        ended = finished(items)
        for task_id, (before, task) in spans(items).items():
            changes = self._changes(task)
            if task_id in ended:
                changes["finished_at_ms"] = ended[task_id]
            updates.setdefault(q.update_task(tuple(changes)), []).append((*changes.values(), task_id, before))
        for query, rows in updates.items():
            if await self.run_many(query, rows) != len(rows):
                # The row locks make this impossible; never write over a concurrent change.
                raise RuntimeError("a task changed under its lock")
        await self.run_many(
            q.INSERT_ENTRY,
            [
                (t.task.id, t.entry.version, t.entry.event.type, t.entry.event.at_ms, encoded)
                for t, encoded, _ in items
                if t.entry is not None
            ],
        )
        notified = [(t.task.id, t.task.state, at, t.task.version) for t, _, at in items if t.notify]
        if notified:
            await self.run_many(q.INSERT_NOTIFICATION, notified)

    async def write_tasks(self, tasks: Sequence[Task]) -> None:
        updates: dict[str, list[tuple[Any, ...]]] = {}
        for task in tasks:
            changes = self._changes(task)
            if changes:
                updates.setdefault(q.update_task(tuple(changes)), []).append(
                    (*changes.values(), task.id, task.version)
                )
        for query, rows in updates.items():
            if await self.run_many(query, rows) != len(rows):
                raise RuntimeError("a task changed under its lock")

    async def claim_due(self, now_ms: int, limit: int) -> list[Task]:
        rows = await self.fetch(q.DUE + self.CLAIM, (now_ms, limit))
        return [self._seen(task_from_row(r)) for r in rows]

    async def renew_leases(self, leases: Sequence[tuple[str, int]]) -> None:
        if leases:
            await self.run_many(q.RENEW_LEASE, [(until, task_id) for task_id, until in leases])

    async def claim_leases(self, now_ms: int, limit: int) -> list[StoredTask]:
        rows = await self.fetch(q.LEASES_ENDED + self.CLAIM, (now_ms, limit))
        found = [stored_from_row(r) for r in rows]
        for stored in found:
            self._seen(stored.task)
        return found

    async def callback_digest(self, callback_id: str) -> str | None:
        return (await self.callback_digests([callback_id])).get(callback_id)

    async def insert_callback(self, callback_id: str, task_id: str, at_ms: int, digest: str) -> None:
        await self.insert_callbacks([(callback_id, task_id, at_ms, digest)])

    async def callback_digests(self, callback_ids: Sequence[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        for condition, params in self.in_list("callback_id", sorted(set(callback_ids))):
            found.update((r[0], r[1]) for r in await self.fetch(q.DIGESTS.format(ids=condition), params))
        return found

    async def insert_callbacks(self, rows: Sequence[tuple[str, str, int, str]]) -> None:
        if rows:
            await self.run_many(q.INSERT_CALLBACK, rows)

    async def receipt(self, idempotency_key: str) -> Receipt | None:
        rows = await self.fetch(q.RECEIPT, (idempotency_key,))
        return Receipt(*rows[0]) if rows else None

    async def insert_receipt(self, receipt: Receipt) -> None:
        await self.run(q.INSERT_RECEIPT, [getattr(receipt, name) for name in q.RECEIPT_COLUMNS])

    async def drain(self, now_ms: int, limit: int) -> list[tuple[int, Notification]]:
        rows = await self.fetch(q.DRAIN.format(claim=self.CLAIM), (now_ms, limit))
        return [(r[0], Notification(*r[1:])) for r in rows]

    async def drain_pending(self) -> bool:
        (row,) = await self.fetch(q.DRAIN_PENDING)
        return bool(row[0])

    async def drain_batch(self, idempotency_key: str) -> DrainBatch | None:
        rows = await self.fetch(q.DRAIN_BATCH, (idempotency_key,))
        if not rows:
            return None
        key, made_at_ms, more, body = rows[0]
        return DrainBatch(key, made_at_ms, bool(more), bytes(body))

    async def insert_drain_batch(self, batch: DrainBatch) -> None:
        await self.run(q.INSERT_DRAIN_BATCH, [getattr(batch, name) for name in q.DRAIN_BATCH_COLUMNS])

    async def forget_drain_batch(self, idempotency_key: str) -> None:
        await self.run(q.FORGET_DRAIN_BATCH, (idempotency_key,))

    async def forget_drain_batches(self, made_before_ms: int, limit: int) -> int:
        return await self.run(q.FORGET_DRAIN_BATCHES.format(claim=self.CLAIM), (made_before_ms, limit))

    async def claim_relay(self, now_ms: int, lease_until_ms: int, limit: int) -> list[Outgoing]:
        rows = await self.fetch(q.RELAY_DUE + self.CLAIM, (now_ms, limit))
        for condition, params in self.in_list("id", [r[0] for r in rows]):
            await self.run(q.RELAY_LEASE.format(ids=condition), (lease_until_ms, *params))
        return [Outgoing(r[0], Notification(*r[1:5]), r[5] + 1) for r in rows]

    async def relay_sent(self, outbox_ids: Sequence[int], now_ms: int) -> None:
        for condition, params in self.in_list("id", sorted(set(outbox_ids))):
            await self.run(q.RELAY_SENT.format(ids=condition), (now_ms, *params))

    async def relay_later(self, outbox_id: int, next_at_ms: int) -> None:
        await self.run(q.RELAY_LATER, (next_at_ms, outbox_id))

    async def notify(self, channel: str, payloads: Sequence[str]) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no NOTIFY")

    # --- retention ----------------------------------------------------------------------------------------

    async def finished_held(self, cutoff_ms: int, *, relay: bool) -> int:
        (row,) = await self.fetch(q.finished_held(relay=relay), (cutoff_ms,))
        return int(row[0])

    async def claim_finished(
        self, cutoff_ms: int, after: tuple[int, str] | None, limit: int, *, relay: bool
    ) -> list[tuple[int, str]]:
        point = q.FINISHED_START if after is None else after
        rows = await self.fetch(q.finished_due(relay=relay) + self.CLAIM, (cutoff_ms, *point, limit))
        return [(r[0], r[1]) for r in rows]

    async def forget(self, task_ids: Sequence[str]) -> int:
        ids = sorted(set(task_ids))
        for table, column in q.TASK_OWNED:
            for condition, params in self.in_list(column, ids):
                await self.run(q.FORGET.format(table=table, ids=condition), params)
        gone = 0
        for condition, params in self.in_list("id", ids):
            gone += await self.run(q.FORGET.format(table="tasks", ids=condition), params)
        for task_id in ids:
            self._read.pop(task_id, None)
        return gone

    async def _select_task(self, task_id: str, lock: str) -> StoredTask | None:
        if "\x00" in task_id:  # no task has one (create refuses it), and PostgreSQL text cannot hold it
            return None
        rows = await self.fetch(q.TASK + lock, (task_id,))
        return stored_from_row(rows[0]) if rows else None

    # --- the rows as this transaction knows them ----------------------------------------------------------

    def _seen(self, task: Task) -> Task:
        self._read[task.id] = task
        return task

    def _changes(self, task: Task) -> dict[str, Any]:
        """The columns of ``task`` that differ from the row as this transaction knows it."""
        before = self._read.get(task.id)
        self._read[task.id] = task
        return changed_values(before, task)
