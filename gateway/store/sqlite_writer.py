"""SQLite writes in one hop: a write transaction runs whole on the database's own thread.

Through SQLAlchemy's async engine each statement of a transaction is a round trip between the event loop
and the driver's thread (a callback batch made about seven). Here one thread owns one ``sqlite3``
connection that every write of the process goes through, and :meth:`SqliteWriter.transact` hands that
thread the whole transaction: ``BEGIN IMMEDIATE``, the book's work, ``COMMIT`` (one fsync), then one wake-up
of the event loop with the result.

The book's work is a coroutine (the same code runs on PostgreSQL and in memory, where the statements do
wait). Here the transaction's methods never suspend (each statement runs at once, on this thread), so the
thread drives the coroutine to its end with one ``send``; a work that waited on anything else would be a
bug, and raises. Outside ``transact`` (the webhook relay's writes), :meth:`SqliteWriter.write` gives the
same transaction object with each statement a hop of its own.

Reads stay on the engine's own connections (``gateway.store.sql``): in WAL mode they never wait for a write.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio

from gateway.store.base import StoreRace
from gateway.store.transaction import SqlTx

R = TypeVar("R")


def apply_pragmas(connection: Any) -> None:
    """The settings of every connection to the gateway's SQLite file (a DB-API connection: SQLAlchemy's and
    the writer's)."""
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    # FULL: an acknowledged callback survives a power cut, not only a crash of the process.
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def disk_full(exc: BaseException) -> bool:
    """Whether an exception is SQLite's "database or disk is full" (``SQLITE_FULL``), raised by sqlite3 or
    wrapped by SQLAlchemy."""
    for error in (exc, getattr(exc, "orig", None)):
        if (
            isinstance(error, sqlite3.Error)
            and getattr(error, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_FULL
        ):
            return True
    return False


class SqliteWriter:
    """The process's write connection to one SQLite file, on a thread of its own."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-sqlite-writer")
        self._conn: sqlite3.Connection | None = None
        # The last write's outcome: it failed for a full disk (set), or a write committed since (clear).
        self.full = False

    def _outcome(self, exc: BaseException | None) -> None:
        if exc is None:
            self.full = False
        elif disk_full(exc):
            self.full = True

    async def open(self) -> None:
        await self._hop(self._connect)

    async def close(self) -> None:
        if self._conn is not None:
            await self._hop(self._conn.close)
            self._conn = None
        self._pool.shutdown(wait=False)

    def _connect(self) -> None:
        # Autocommit mode: transactions are begun and ended here, explicitly.
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        apply_pragmas(conn)
        self._conn = conn

    async def _hop(self, fn: Callable[[], R]) -> R:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    async def transact(self, work: Callable[[SqliteTx], Awaitable[R]]) -> R:
        """Run ``work`` in one transaction, begun, worked and committed on the writer's thread in one hop.
        The caller holds the process's write turn (``Database.write_turn``).

        Cut short (a deadline, a stop), the caller is told what the file holds: a transaction that has
        not begun its ``COMMIT`` is rolled back (the caller's cancellation goes on), one that has is
        waited for and its result returned, so that what it committed is published."""
        handover = _Handover()
        job = self._pool.submit(self._run, work, handover)
        done = asyncio.wrap_future(job)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            if handover.abandon():
                job.cancel()  # not begun: it never runs; begun: it rolls back instead of committing
                done.add_done_callback(_consume)
                raise
            with anyio.CancelScope(shield=True):
                result: R = await done
            return result

    def _run(self, work: Callable[[SqliteTx], Awaitable[R]], handover: _Handover) -> R:
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            result: R = _drive(work(SqliteTx(conn, None)))
            if not handover.commit():
                raise _Abandoned
            conn.execute("COMMIT")
        except BaseException as exc:
            self._outcome(exc)
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        self._outcome(None)
        return result

    @asynccontextmanager
    async def write(self) -> AsyncIterator[SqliteTx]:
        """A transaction whose statements each take a hop to the writer's thread (for writes that await
        other things between statements). The caller holds the process's write turn."""
        conn = await self._hop(self._connection)
        try:
            await self._hop(lambda: conn.execute("BEGIN IMMEDIATE"))
            yield SqliteTx(conn, self._hop)
        except BaseException as exc:
            self._outcome(exc)
            # Queued behind every statement sent (the thread runs them in order), a BEGIN or a statement
            # whose caller was cut short included: none of it can outlive the rollback.
            with anyio.CancelScope(shield=True):
                await self._hop(self._rollback)
            raise
        with anyio.CancelScope(shield=True):
            await self._hop(self._commit)

    def trace(self, callback: Callable[[str], object] | None) -> None:
        """Call ``callback`` with each statement the writer runs, its values filled in (``None``: stop)."""
        self._connection().set_trace_callback(callback)

    def _rollback(self) -> None:
        conn = self._connection()
        if conn.in_transaction:
            conn.execute("ROLLBACK")

    def _commit(self) -> None:
        conn = self._connection()
        try:
            conn.execute("COMMIT")
        except BaseException as exc:  # a failed COMMIT can leave the transaction open: never for the next one
            self._outcome(exc)
            self._rollback()
            raise
        self._outcome(None)

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise sqlite3.OperationalError("the SQLite writer is closed")
        return self._conn


class _Abandoned(Exception):
    """A transaction whose caller gave up before its ``COMMIT``: rolled back, told to no one."""


class _Handover:
    """Whether a transaction handed to the writer's thread commits: decided once, under a lock, by the
    first of its caller giving up (:meth:`abandon`) and the thread reaching its ``COMMIT``
    (:meth:`commit`)."""

    __slots__ = ("_abandoned", "_committing", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._abandoned = False
        self._committing = False

    def abandon(self) -> bool:
        """The caller gives up: ``True`` when the transaction will not commit, ``False`` when its
        ``COMMIT`` is under way already."""
        with self._lock:
            if not self._committing:
                self._abandoned = True
            return self._abandoned

    def commit(self) -> bool:
        """The thread is about to commit: ``True`` when it may (its caller still waits)."""
        with self._lock:
            if not self._abandoned:
                self._committing = True
            return self._committing


def _consume(done: asyncio.Future[Any]) -> None:
    """Take the outcome of a transaction no one waits for any more (asyncio would log it as unretrieved)."""
    if not done.cancelled():
        done.exception()


def _drive(awaitable: Awaitable[R]) -> R:
    """Run a coroutine that never suspends to its end, on this thread."""
    coroutine = awaitable.__await__()
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    coroutine.close()
    raise RuntimeError("a SQLite write transaction's work waited on something other than its statements")


class SqliteTx(SqlTx):
    """A write transaction on the writer's connection (the statements: ``gateway.store.queries``).

    With ``hop`` None it runs on the writer's thread (inside :meth:`SqliteWriter.transact`) and each
    method returns without suspending; with ``hop`` each statement is sent to that thread."""

    __slots__ = ("_conn", "_hop")

    def __init__(
        self, conn: sqlite3.Connection, hop: Callable[[Callable[[], Any]], Awaitable[Any]] | None
    ) -> None:
        super().__init__()
        self._conn = conn
        self._hop = hop

    async def _do(self, fn: Callable[[sqlite3.Connection], R]) -> R:
        try:
            if self._hop is None:
                return fn(self._conn)
            result: R = await self._hop(lambda: fn(self._conn))
            return result
        except sqlite3.IntegrityError as exc:
            raise StoreRace(str(exc)) from exc

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> Sequence[Sequence[Any]]:
        return await self._do(lambda c: c.execute(sql, params).fetchall())

    async def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        return await self._do(lambda c: c.execute(sql, params).rowcount)

    async def run_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        return await self._do(lambda c: c.executemany(sql, rows).rowcount)

    async def notify(self, channel: str, payloads: Sequence[str]) -> None:
        raise NotImplementedError("SQLite has no NOTIFY")
