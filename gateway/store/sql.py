"""The store on a SQLite file or PostgreSQL: reads in SQLAlchemy Core, and where the writes go.

The writes take the database's own way (``gateway.store.direct``: the statements written once in SQL): on
a SQLite file the writer's own connection and thread, a whole transaction in one hop
(``gateway.store.sqlite_writer``); on PostgreSQL asyncpg itself, on a connection of the engine's pool
(``gateway.store.pg_writer``). Reads are here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from sqlalchemy import Row, func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.machine import Task
from gateway.store.base import StoredTask, WriteTx
from gateway.store.database import Database
from gateway.store.direct import IN_CHUNK
from gateway.store.sqlite_writer import SqliteWriter
from gateway.store.tables import ACTIVE_STATES, entries, outbox, tasks

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
            yield SqlTx(conn)

    @asynccontextmanager
    async def write(self, *, urgent: bool = False) -> AsyncIterator[WriteTx]:
        if self.db.pg_writer is not None:  # PostgreSQL: asyncpg's own connection, writes sent together
            async with self.db.pg_writer.write() as tx:
                yield tx
            return
        # A SQLite file: its writer's connection, a hop per statement.
        async with self.db.write_turn(urgent=urgent), self._sqlite_writer().write() as tx:
            yield tx

    async def transact(self, work: Callable[[WriteTx], Awaitable[R]], *, urgent: bool = False) -> R:
        if self.db.pg_writer is not None:
            async with self.db.pg_writer.write() as tx:
                return await work(tx)
        async with self.db.write_turn(urgent=urgent):  # a SQLite file: the whole transaction in one hop
            return await self._sqlite_writer().transact(work)

    def _sqlite_writer(self) -> SqliteWriter:
        writer = self.db.writer
        assert writer is not None, "a database is PostgreSQL or a SQLite file (Database refuses the rest)"
        return writer


class SqlTx:
    """A read transaction on a connection of the engine's pool."""

    __slots__ = ("conn",)

    def __init__(self, conn: AsyncConnection) -> None:
        self.conn = conn

    async def task(self, task_id: str) -> StoredTask | None:
        if "\x00" in task_id:  # no task has one (create refuses it), and PostgreSQL text cannot hold it
            return None
        row = (await self.conn.execute(select(tasks).where(tasks.c.id == task_id))).first()
        return None if row is None else StoredTask(task_from_row(row), row.ttl_ms)

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
