"""The store on SQLite or PostgreSQL: which connection each transaction runs on.

Every transaction is a :class:`~gateway.store.transaction.SqlTx` (the statements: ``gateway.store.queries``)
on the database's own driver:

- a SQLite file's writes on the writer's connection and thread, a whole transaction in one hop
  (``gateway.store.sqlite_writer``), its reads on the engine's aiosqlite connections: WAL readers, which
  never wait for the writer, nor it for them;
- PostgreSQL's reads and writes on asyncpg connections of the engine's pool (``gateway.store.pg_writer``):
  a task is locked with ``SELECT ... FOR UPDATE`` and due work claimed with ``FOR UPDATE SKIP LOCKED``, so
  that several gateway processes sweep and relay without waiting on each other.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from gateway.store.base import ReadTx, WriteTx
from gateway.store.database import Database
from gateway.store.sqlite_writer import SqliteWriter
from gateway.store.transaction import SqlTx

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
    async def read(self) -> AsyncIterator[ReadTx]:
        if self.db.pg_writer is not None:
            async with self.db.pg_writer.read() as tx:
                yield tx
            return
        async with self.db.read() as conn:
            yield SqliteReadTx((await conn.get_raw_connection()).driver_connection)

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


class SqliteReadTx(SqlTx):
    """Reads on an aiosqlite connection of the engine's pool (``conn``: aiosqlite's own, beneath SQLAlchemy's
    adapter): its thread is not the writer's, so a read never queues behind a write, and
    ``execute_fetchall`` takes one hop to that thread where the adapter's cursor took several."""

    __slots__ = ("_conn",)

    def __init__(self, conn: Any) -> None:
        super().__init__()
        self._conn = conn

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> Sequence[Sequence[Any]]:
        rows: Sequence[Sequence[Any]] = await self._conn.execute_fetchall(sql, params)
        return rows
