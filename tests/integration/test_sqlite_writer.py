"""A SQLite file's writes go through one connection on a thread of its own (gateway.store.sqlite_writer).

What a caller is told must be what the file holds when a write is cut short by its deadline or a stop:
a caller answered 503 must find nothing written (subscribers were never told of it), a caller whose
commit went through must get its result (its news is published), and a write cut short must leave the
writer's connection ready for the next one.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from gateway.book.book import Book
from gateway.machine import Start
from gateway.machine import create_task as new_task
from gateway.store import Database
from gateway.store.base import WriteTx
from gateway.store.sql import SqlStore
from gateway.store.sqlite_writer import SqliteWriter
from tests.support import FakeClock, create_task, error, running_gateway, transact_cut_short

pytestmark = pytest.mark.anyio


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "gateway.db"


@pytest.fixture
async def store(path: Path) -> AsyncIterator[SqlStore]:
    opened = SqlStore(Database(f"sqlite:///{path}"))
    await opened.open()
    try:
        yield opened
    finally:
        await opened.close()


def writer_of(store: SqlStore) -> SqliteWriter:
    writer = store.db.writer
    assert writer is not None
    return writer


class StatementGate:
    """Holds the writer's thread at the first statement that starts with ``prefix`` until ``open()``;
    ``reached`` is set (on the event loop) once it is held there."""

    def __init__(self, writer: SqliteWriter, prefix: str) -> None:
        self.reached = anyio.Event()
        self._open = threading.Event()
        self._held = False
        loop = asyncio.get_running_loop()

        def seen(statement: str) -> None:
            if not self._held and statement.startswith(prefix):
                self._held = True
                loop.call_soon_threadsafe(self.reached.set)
                self._open.wait(10)

        writer.trace(seen)

    def open(self) -> None:
        # (The trace stays set: unsetting it from here would wait for the thread, inside a statement.)
        self._open.set()


async def version(store: SqlStore, task_id: str) -> int:
    async with store.read() as tx:
        stored = await tx.task(task_id)
    assert stored is not None
    return stored.task.version


async def test_a_callback_answered_503_at_its_deadline_is_not_applied_afterwards(
    store: SqlStore, path: Path
) -> None:
    """Another program holds the file's write lock (an operator's sqlite3 shell) past the database
    deadline: the worker is answered 503, so the callback must not be applied once the lock is let go
    (live subscribers would never hear of it, and the worker retries it)."""
    book = Book(store, FakeClock())
    await book.create("t", 60_000, 3)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        book.deadline_s = 0.5  # the writer waits up to 5 s for a lock
        with pytest.raises(TimeoutError):
            await book.callback("t", lambda now: Start(now, "w1"))
        other.execute("ROLLBACK")
    finally:
        other.close()
    book.deadline_s = 10.0
    await book.create("u", 60_000, 3)  # the writer's thread has finished with the callback by now
    assert await version(store, "t") == 0
    outcome = await book.callback("t", lambda now: Start(now, "w1"))  # the worker's retry
    assert outcome.transition.task.version == 1 and await version(store, "t") == 1


async def test_a_caller_cut_short_during_its_commit_gets_what_was_committed(store: SqlStore) -> None:
    writer = writer_of(store)
    task = new_task(id="t", now_ms=1_000, ttl_ms=60_000, max_attempts=3)

    async def work(tx: WriteTx) -> str:
        await tx.insert_task(task, 60_000, 1_000)
        return "created"

    gate = StatementGate(writer, "COMMIT")

    async def finish_commit() -> None:
        gate.open()

    outcome = await transact_cut_short(store, work, gate.reached.wait, finish_commit)
    assert await version(store, "t") == 0  # committed: the caller must have been told
    assert outcome == ["created"]


async def test_a_relay_write_cut_short_at_its_begin_leaves_the_writer_usable(store: SqlStore) -> None:
    """The webhook relay's write (a hop per statement) cut short by its deadline while the writer's
    thread is still beginning the transaction: every later write must still work, not fail with "cannot
    start a transaction within a transaction" (a 503 for every callback until a restart)."""
    writer = writer_of(store)
    gate = StatementGate(writer, "BEGIN")
    ended = anyio.Event()

    async def relay_round(scope: anyio.CancelScope) -> None:
        with scope:
            async with store.write() as tx:
                await tx.relay_sent([1], 5_000)
        ended.set()

    async with anyio.create_task_group() as tg:
        scope = anyio.CancelScope()
        tg.start_soon(relay_round, scope)
        with anyio.fail_after(5):
            await gate.reached.wait()
        scope.cancel()
        await anyio.wait_all_tasks_blocked()
        gate.open()
    assert ended.is_set()
    book = Book(store, FakeClock())
    with anyio.fail_after(5):
        _, created = await book.create("t", 60_000, 3)
    assert created and await version(store, "t") == 0


async def test_a_database_locked_by_another_program_is_a_503_not_a_500(path: Path) -> None:
    """Another program holds the file's write lock past the writer's busy timeout (5 s): the writer's
    own ``sqlite3`` error must be answered like the database's others, 503 and retry, not 500."""
    async with running_gateway(f"sqlite:///{path}") as gw:
        other = sqlite3.connect(path, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")
            answer = await create_task(gw, "t", expect=None)
            other.execute("ROLLBACK")
        finally:
            other.close()
        error(answer, 503, "unavailable")
        await create_task(gw, "t")
