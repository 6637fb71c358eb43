"""The store on SQLite or PostgreSQL: reads in SQLAlchemy Core, and where the writes go.

The writes take the database's own way (``gateway.store.direct``: the statements written once in SQL): on
a SQLite file the writer's own connection and thread, a whole transaction in one hop
(``gateway.store.sqlite_writer``); on PostgreSQL asyncpg itself, on a connection of the engine's pool
(``gateway.store.pg_writer``). Reads, and the writes of an in-memory SQLite database, are here.

A transaction is one :class:`~gateway.store.database.Database` connection. On PostgreSQL a task is locked
with ``SELECT ... FOR UPDATE`` and due tasks are claimed with ``FOR UPDATE SKIP LOCKED``, so several gateway
processes sweep without waiting on each other; on SQLite writes are serialised by the database anyway.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from sqlalchemy import Row, Update, bindparam, func, insert, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.machine import Task, Transition
from gateway.store.base import Notification, Outgoing, Receipt, StoredTask, StoreRace, WriteTx
from gateway.store.database import Database
from gateway.store.direct import IN_CHUNK, KnownRows
from gateway.store.tables import (
    ACTIVE_STATES,
    callbacks,
    deliveries,
    entries,
    outbox,
    task_values,
    tasks,
)

R = TypeVar("R")


class SqlStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def open(self) -> None:
        await self.db.open()

    async def close(self) -> None:
        await self.db.close()

    async def ping(self, deadline_s: float = 3.0) -> None:
        await self.db.ping(deadline_s)

    @asynccontextmanager
    async def read(self) -> AsyncIterator[SqlTx]:
        async with self.db.read() as conn:
            yield SqlTx(conn, self.db.is_sqlite)

    @asynccontextmanager
    async def write(self, *, urgent: bool = False) -> AsyncIterator[WriteTx]:
        writer = self.db.writer
        if writer is not None:  # a SQLite file: its writer's connection, a hop per statement
            async with self.db.write_turn(urgent=urgent), writer.write() as tx:
                yield tx
            return
        if self.db.pg_writer is not None:  # PostgreSQL: asyncpg's own connection, writes sent together
            async with self.db.pg_writer.write() as tx:
                yield tx
            return
        try:
            async with self.db.write(urgent=urgent) as conn:
                yield SqlTx(conn, self.db.is_sqlite)
        except IntegrityError as exc:
            raise StoreRace(str(exc.orig)) from exc

    async def transact(self, work: Callable[[WriteTx], Awaitable[R]], *, urgent: bool = False) -> R:
        writer = self.db.writer
        if writer is None:
            async with self.write(urgent=urgent) as tx:
                return await work(tx)
        async with self.db.write_turn(urgent=urgent):  # a SQLite file: the whole transaction in one hop
            return await writer.transact(work)


class SqlTx(KnownRows):
    __slots__ = ("conn", "is_sqlite")

    def __init__(self, conn: AsyncConnection, is_sqlite: bool) -> None:
        super().__init__()
        self.conn = conn
        self.is_sqlite = is_sqlite

    # --- reads ----------------------------------------------------------------------------------------

    async def task(self, task_id: str) -> StoredTask | None:
        return await self._select_task(task_id, lock=False)

    async def entries(self, task_id: str, after: int, upto: int) -> list[tuple[int, bytes]]:
        result = await self.conn.execute(
            select(entries.c.version, entries.c.event)
            .where(entries.c.task_id == task_id, entries.c.version > after, entries.c.version <= upto)
            .order_by(entries.c.version)
        )
        return [(r.version, r.event) for r in result]

    async def versions(self, task_ids: Sequence[str]) -> dict[str, int]:
        found: dict[str, int] = {}
        ids = [i for i in task_ids if "\x00" not in i]
        for start in range(0, len(ids), IN_CHUNK):
            chunk = ids[start : start + IN_CHUNK]
            result = await self.conn.execute(select(tasks.c.id, tasks.c.version).where(tasks.c.id.in_(chunk)))
            found.update((r.id, r.version) for r in result)
        return found

    async def relay_pending(self) -> int:
        result = await self.conn.execute(
            select(func.count()).select_from(outbox).where(outbox.c.relayed_at_ms.is_(None))
        )
        return int(result.scalar_one())

    async def next_deadline(self) -> int | None:
        # The first row of the partial index ix_tasks_live_deadline.
        result = await self.conn.execute(
            select(func.min(tasks.c.expires_at_ms)).where(tasks.c.state.in_(ACTIVE_STATES))
        )
        deadline: int | None = result.scalar_one()
        return deadline

    async def list_tasks(self, *, state: str | None, after: str | None, limit: int) -> list[Task]:
        # Keyset pagination over the primary key: each page is one index range, however deep it is.
        query = select(tasks).order_by(tasks.c.id).limit(limit)
        if state is not None:
            query = query.where(tasks.c.state == state)
        if after is not None:
            query = query.where(tasks.c.id > after)
        return [task_from_row(row) for row in await self.conn.execute(query)]

    # --- writes ---------------------------------------------------------------------------------------

    async def lock_task(self, task_id: str) -> StoredTask | None:
        return await self._select_task(task_id, lock=True)

    async def lock_tasks(self, task_ids: Sequence[str]) -> dict[str, StoredTask]:
        found: dict[str, StoredTask] = {}
        ids = sorted({i for i in task_ids if "\x00" not in i})
        for start in range(0, len(ids), IN_CHUNK):
            query = select(tasks).where(tasks.c.id.in_(ids[start : start + IN_CHUNK])).order_by(tasks.c.id)
            if not self.is_sqlite:
                query = query.with_for_update()
            found.update(
                (row.id, StoredTask(self._seen(task_from_row(row)), row.ttl_ms))
                for row in await self.conn.execute(query)
            )
        return found

    async def insert_task(self, task: Task, ttl_ms: int, created_at_ms: int) -> None:
        await self.conn.execute(
            insert(tasks).values(**task_values(task), ttl_ms=ttl_ms, created_at_ms=created_at_ms)
        )

    async def record(self, transition: Transition, encoded_event: bytes, notify_at_ms: float) -> None:
        entry = transition.entry
        assert entry is not None
        task = transition.task
        result = await self.conn.execute(
            update(tasks)
            .where(tasks.c.id == task.id, tasks.c.version == task.version - 1)
            .values(**self._changes(task))
        )
        if result.rowcount != 1:  # the row lock makes this impossible; never write over a concurrent change
            raise RuntimeError(f"task {task.id} changed under its lock")
        await self.conn.execute(
            insert(entries).values(
                task_id=task.id,
                version=entry.version,
                type=entry.event.type,
                at_ms=entry.event.at_ms,
                event=encoded_event,
            )
        )
        if transition.notify:
            await self.conn.execute(
                insert(outbox).values(
                    task_id=task.id, state=task.state, at_ms=notify_at_ms, version=task.version
                )
            )

    async def record_many(self, items: Sequence[tuple[Transition, bytes, float]]) -> None:
        if len(items) <= 1:
            for transition, encoded_event, notify_at_ms in items:
                await self.record(transition, encoded_event, notify_at_ms)
            return
        # Set-based: one executemany per table instead of three statements per transition, and one row
        # write per task, from the version before its first transition to its last state.
        first: dict[str, Transition] = {}
        last: dict[str, Transition] = {}
        for transition, _, _ in items:
            first.setdefault(transition.task.id, transition)
            last[transition.task.id] = transition
        # One executemany per set of changed columns (a batch of progress callbacks: one).
        shapes: dict[tuple[str, ...], list[dict[str, Any]]] = {}
        for task_id, transition in last.items():
            changes = self._changes(transition.task)
            params = {f"v_{name}": value for name, value in changes.items()}
            params.update(w_id=task_id, w_before=first[task_id].task.version - 1)
            shapes.setdefault(tuple(sorted(changes)), []).append(params)
        for columns, rows in shapes.items():
            result = await self.conn.execute(_update_at_version(columns), rows)
            if self.conn.dialect.supports_sane_multi_rowcount and result.rowcount != len(rows):
                raise RuntimeError("a task changed under its lock")
        await self.conn.execute(
            insert(entries),
            [
                {
                    "task_id": t.task.id,
                    "version": t.entry.version,
                    "type": t.entry.event.type,
                    "at_ms": t.entry.event.at_ms,
                    "event": encoded,
                }
                for t, encoded, _ in items
                if t.entry is not None
            ],
        )
        notified = [
            {"task_id": t.task.id, "state": t.task.state, "at_ms": at, "version": t.task.version}
            for t, _, at in items
            if t.notify
        ]
        if notified:
            await self.conn.execute(insert(outbox), notified)

    async def claim_due(self, now_ms: int, limit: int) -> list[Task]:
        # The partial index ix_tasks_live_deadline answers this in O(batch), whatever the table's size.
        query = (
            select(tasks)
            .where(tasks.c.state.in_(ACTIVE_STATES), tasks.c.expires_at_ms <= now_ms)
            .order_by(tasks.c.expires_at_ms)
            .limit(limit)
        )
        if not self.is_sqlite:
            query = query.with_for_update(skip_locked=True)
        return [self._seen(task_from_row(row)) for row in await self.conn.execute(query)]

    async def callback_digest(self, callback_id: str) -> str | None:
        result = await self.conn.execute(
            select(callbacks.c.digest).where(callbacks.c.callback_id == callback_id)
        )
        digest: str | None = result.scalar_one_or_none()
        return digest

    async def insert_callback(self, callback_id: str, task_id: str, at_ms: int, digest: str) -> None:
        await self.conn.execute(
            insert(callbacks).values(callback_id=callback_id, task_id=task_id, at_ms=at_ms, digest=digest)
        )

    async def callback_digests(self, callback_ids: Sequence[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        ids = sorted(set(callback_ids))
        for start in range(0, len(ids), IN_CHUNK):
            query = select(callbacks.c.callback_id, callbacks.c.digest).where(
                callbacks.c.callback_id.in_(ids[start : start + IN_CHUNK])
            )
            found.update((row.callback_id, row.digest) for row in await self.conn.execute(query))
        return found

    async def insert_callbacks(self, rows: Sequence[tuple[str, str, int, str]]) -> None:
        if rows:
            await self.conn.execute(
                insert(callbacks),
                [{"callback_id": c, "task_id": t, "at_ms": at, "digest": d} for c, t, at, d in rows],
            )

    async def receipt(self, idempotency_key: str) -> Receipt | None:
        row = (
            await self.conn.execute(select(deliveries).where(deliveries.c.idempotency_key == idempotency_key))
        ).first()
        if row is None:
            return None
        return Receipt(row.task_id, row.result_ref, row.result_hash, row.idempotency_key, row.delivered_at_ms)

    async def insert_receipt(self, receipt: Receipt) -> None:
        await self.conn.execute(
            insert(deliveries).values(
                idempotency_key=receipt.idempotency_key,
                task_id=receipt.task_id,
                result_ref=receipt.result_ref,
                result_hash=receipt.result_hash,
                delivered_at_ms=receipt.delivered_at_ms,
            )
        )

    async def drain(self, now_ms: int) -> list[tuple[int, Notification]]:
        result = await self.conn.execute(
            update(outbox)
            .where(outbox.c.drained_at_ms.is_(None))
            .values(drained_at_ms=now_ms)
            .returning(outbox.c.id, outbox.c.task_id, outbox.c.state, outbox.c.at_ms, outbox.c.version)
        )
        return [(r.id, Notification(r.task_id, r.state, r.at_ms, r.version)) for r in result.all()]

    async def claim_relay(self, now_ms: int, lease_until_ms: int, limit: int) -> list[Outgoing]:
        # The partial index ix_outbox_relay_due answers this in O(batch): relayed rows are not in it.
        query = (
            select(outbox.c.id, outbox.c.task_id, outbox.c.state, outbox.c.at_ms, outbox.c.version)
            .add_columns(outbox.c.relay_attempts)
            .where(outbox.c.relayed_at_ms.is_(None), outbox.c.relay_next_at_ms <= now_ms)
            .order_by(outbox.c.relay_next_at_ms, outbox.c.id)
            .limit(limit)
        )
        if not self.is_sqlite:
            query = query.with_for_update(skip_locked=True)
        rows = (await self.conn.execute(query)).all()
        if not rows:
            return []
        await self.conn.execute(
            update(outbox)
            .where(outbox.c.id.in_([r.id for r in rows]))
            .values(relay_next_at_ms=lease_until_ms, relay_attempts=outbox.c.relay_attempts + 1)
        )
        return [
            Outgoing(r.id, Notification(r.task_id, r.state, r.at_ms, r.version), r.relay_attempts + 1)
            for r in rows
        ]

    async def relay_sent(self, outbox_ids: Sequence[int], now_ms: int) -> None:
        ids = sorted(set(outbox_ids))
        for start in range(0, len(ids), IN_CHUNK):
            await self.conn.execute(
                update(outbox)
                .where(outbox.c.id.in_(ids[start : start + IN_CHUNK]), outbox.c.relayed_at_ms.is_(None))
                .values(relayed_at_ms=now_ms)
            )

    async def relay_later(self, outbox_id: int, next_at_ms: int) -> None:
        await self.conn.execute(
            update(outbox)
            .where(outbox.c.id == outbox_id, outbox.c.relayed_at_ms.is_(None))
            .values(relay_next_at_ms=next_at_ms)
        )

    async def notify(self, channel: str, payloads: Sequence[str]) -> None:
        if self.is_sqlite:
            raise NotImplementedError("SQLite has no NOTIFY")
        if len(payloads) == 1:
            await self.conn.execute(select(func.pg_notify(channel, payloads[0])))
        elif payloads:  # one statement for a batch; unnest keeps the array's order
            await self.conn.execute(_NOTIFY_MANY, {"channel": channel, "payloads": list(payloads)})

    async def _select_task(self, task_id: str, *, lock: bool) -> StoredTask | None:
        if "\x00" in task_id:  # no task has one (create refuses it), and PostgreSQL text cannot hold it
            return None
        query = select(tasks).where(tasks.c.id == task_id)
        if lock:
            query = query.with_for_update()
        row = (await self.conn.execute(query)).first()
        if row is None:
            return None
        task = task_from_row(row)
        if lock:
            self._seen(task)
        return StoredTask(task, row.ttl_ms)


_NOTIFY_MANY = text(
    "SELECT pg_notify(:channel, p) "
    "FROM unnest(CAST(:payloads AS text[])) WITH ORDINALITY AS u(p, n) ORDER BY n"
)


@functools.cache
def _update_at_version(columns: tuple[str, ...]) -> Update:
    """``UPDATE tasks SET <columns> WHERE id = :w_id AND version = :w_before``, one per set of columns."""
    return (
        update(tasks)
        .where(tasks.c.id == bindparam("w_id"), tasks.c.version == bindparam("w_before"))
        .values({name: bindparam(f"v_{name}") for name in columns})
    )


def task_from_row(row: Row[Any]) -> Task:
    """A ``tasks`` row as the machine's task."""
    return Task(
        id=row.id,
        state=row.state,
        expires_at_ms=row.expires_at_ms,
        attempts=row.attempts,
        max_attempts=row.max_attempts,
        progress=row.progress,
        version=row.version,
        result_ref=row.result_ref,
        result_hash=row.result_hash,
        error=row.error,
    )
