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

Reads stay on SQLAlchemy's connections (``gateway.store.sql``): in WAL mode they never wait for a write.
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

from gateway.machine import Task, Transition
from gateway.store.base import Notification, Outgoing, Receipt, StoredTask, StoreRace
from gateway.store.tables import ACTIVE_STATES, TASK_COLUMNS, changed_values, task_values

R = TypeVar("R")

# ``IN (...)`` lists go in chunks of this size (SQLite's default limit is 32,766 parameters).
_IN_CHUNK = 500
_SELECT_TASK = f"SELECT {', '.join(TASK_COLUMNS)}, ttl_ms FROM tasks"
_ACTIVE = "state IN ({})".format(", ".join(f"'{s}'" for s in ACTIVE_STATES))


def apply_pragmas(connection: Any) -> None:
    """The settings of every connection to the gateway's SQLite file (a DB-API connection: SQLAlchemy's and
    the writer's)."""
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    # FULL: an acknowledged callback survives a power cut, not only a crash of the process.
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA busy_timeout=5000")
    cursor.close()


def _task(row: Sequence[Any]) -> Task:
    return Task(*row[:10])


def _marks(count: int) -> str:
    return ", ".join("?" * count)


class SqliteWriter:
    """The process's write connection to one SQLite file, on a thread of its own."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateway-sqlite-writer")
        self._conn: sqlite3.Connection | None = None

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

    async def transact(self, work: Callable[[DirectTx], Awaitable[R]]) -> R:
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

    def _run(self, work: Callable[[DirectTx], Awaitable[R]], handover: _Handover) -> R:
        conn = self._connection()
        conn.execute("BEGIN IMMEDIATE")
        try:
            result: R = _drive(work(DirectTx(conn, None)))
            if not handover.commit():
                raise _Abandoned
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return result

    @asynccontextmanager
    async def write(self) -> AsyncIterator[DirectTx]:
        """A transaction whose statements each take a hop to the writer's thread (for writes that await
        other things between statements). The caller holds the process's write turn."""
        conn = await self._hop(self._connection)
        try:
            await self._hop(lambda: conn.execute("BEGIN IMMEDIATE"))
            yield DirectTx(conn, self._hop)
        except BaseException:
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
        except BaseException:  # a failed COMMIT can leave the transaction open: never for the next one
            self._rollback()
            raise

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


class DirectTx:
    """A write transaction on the writer's connection: the store's statements in SQLite's SQL.

    With ``hop`` None it runs on the writer's thread (inside :meth:`SqliteWriter.transact`) and each
    method returns without suspending; with ``hop`` each statement is sent to that thread."""

    __slots__ = ("_conn", "_hop", "_read")

    def __init__(
        self, conn: sqlite3.Connection, hop: Callable[[Callable[[], Any]], Awaitable[Any]] | None
    ) -> None:
        self._conn = conn
        self._hop = hop
        # Each task row as this transaction read it (or last wrote it): an update writes only the columns
        # that differ from it (a progress callback writes two: progress and version).
        self._read: dict[str, Task] = {}

    async def _do(self, fn: Callable[[sqlite3.Connection], R]) -> R:
        try:
            if self._hop is None:
                return fn(self._conn)
            result: R = await self._hop(lambda: fn(self._conn))
            return result
        except sqlite3.IntegrityError as exc:
            raise StoreRace(str(exc)) from exc

    def _seen(self, task: Task) -> Task:
        self._read[task.id] = task
        return task

    # --- reads ----------------------------------------------------------------------------------------

    async def task(self, task_id: str) -> StoredTask | None:
        def run(c: sqlite3.Connection) -> StoredTask | None:
            row = c.execute(f"{_SELECT_TASK} WHERE id = ?", (task_id,)).fetchone()
            return None if row is None else StoredTask(_task(row), row[10])

        return await self._do(run)

    async def lock_task(self, task_id: str) -> StoredTask | None:
        stored = await self.task(task_id)  # the write transaction holds SQLite's one write lock already
        if stored is not None:
            self._seen(stored.task)
        return stored

    async def entries(self, task_id: str, after: int, upto: int) -> list[tuple[int, bytes]]:
        return await self._do(
            lambda c: c.execute(
                "SELECT version, event FROM entries WHERE task_id = ? AND version > ? AND version <= ? "
                "ORDER BY version",
                (task_id, after, upto),
            ).fetchall()
        )

    async def versions(self, task_ids: Sequence[str]) -> dict[str, int]:
        ids = [i for i in task_ids if "\x00" not in i]

        def run(c: sqlite3.Connection) -> dict[str, int]:
            found: dict[str, int] = {}
            for start in range(0, len(ids), _IN_CHUNK):
                chunk = ids[start : start + _IN_CHUNK]
                found.update(
                    c.execute(f"SELECT id, version FROM tasks WHERE id IN ({_marks(len(chunk))})", chunk)
                )
            return found

        return await self._do(run)

    async def relay_pending(self) -> int:
        return await self._do(
            lambda c: int(c.execute("SELECT count(*) FROM outbox WHERE relayed_at_ms IS NULL").fetchone()[0])
        )

    async def next_deadline(self) -> int | None:
        return await self._do(
            lambda c: c.execute(f"SELECT min(expires_at_ms) FROM tasks WHERE {_ACTIVE}").fetchone()[0]
        )

    async def list_tasks(self, *, state: str | None, after: str | None, limit: int) -> list[Task]:
        where, params = [], []
        if state is not None:
            where.append("state = ?")
            params.append(state)
        if after is not None:
            where.append("id > ?")
            params.append(after)
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        query = f"{_SELECT_TASK}{clause} ORDER BY id LIMIT ?"
        return await self._do(lambda c: [_task(r) for r in c.execute(query, (*params, limit))])

    # --- writes ---------------------------------------------------------------------------------------

    async def lock_tasks(self, task_ids: Sequence[str]) -> dict[str, StoredTask]:
        ids = sorted({i for i in task_ids if "\x00" not in i})

        def run(c: sqlite3.Connection) -> dict[str, StoredTask]:
            found: dict[str, StoredTask] = {}
            for start in range(0, len(ids), _IN_CHUNK):
                chunk = ids[start : start + _IN_CHUNK]
                query = f"{_SELECT_TASK} WHERE id IN ({_marks(len(chunk))}) ORDER BY id"
                for row in c.execute(query, chunk):
                    found[row[0]] = StoredTask(self._seen(_task(row)), row[10])
            return found

        return await self._do(run)

    async def insert_task(self, task: Task, ttl_ms: int, created_at_ms: int) -> None:
        columns = ", ".join((*TASK_COLUMNS, "ttl_ms", "created_at_ms"))
        query = f"INSERT INTO tasks ({columns}) VALUES ({_marks(len(TASK_COLUMNS) + 2)})"
        await self._do(lambda c: c.execute(query, (*task_values(task).values(), ttl_ms, created_at_ms)))

    def _changes(self, task: Task) -> dict[str, Any]:
        """The columns of ``task`` that differ from the row as this transaction knows it."""
        before = self._read.get(task.id)
        self._read[task.id] = task
        return changed_values(before, task)

    async def record(self, transition: Transition, encoded_event: bytes, notify_at_ms: float) -> None:
        await self.record_many([(transition, encoded_event, notify_at_ms)])

    async def record_many(self, items: Sequence[tuple[Transition, bytes, float]]) -> None:
        # One row write per task, from the version before its first transition to its last state.
        first: dict[str, Transition] = {}
        last: dict[str, Transition] = {}
        for transition, _, _ in items:
            first.setdefault(transition.task.id, transition)
            last[transition.task.id] = transition
        # One executemany per set of changed columns (a batch of progress callbacks: one).
        updates: dict[str, list[tuple[Any, ...]]] = {}
        for task_id, transition in last.items():
            changes = self._changes(transition.task)
            query = f"UPDATE tasks SET {', '.join(f'{n} = ?' for n in changes)} WHERE id = ? AND version = ?"
            before = first[task_id].task.version - 1
            updates.setdefault(query, []).append((*changes.values(), task_id, before))
        history = [
            (t.task.id, t.entry.version, t.entry.event.type, t.entry.event.at_ms, encoded)
            for t, encoded, _ in items
            if t.entry is not None
        ]
        notified = [(t.task.id, t.task.state, at, t.task.version) for t, _, at in items if t.notify]

        def run(c: sqlite3.Connection) -> None:
            for query, rows in updates.items():
                if c.executemany(query, rows).rowcount != len(rows):
                    # The write lock makes this impossible; never write over a concurrent change.
                    raise RuntimeError("a task changed under its lock")
            c.executemany(
                "INSERT INTO entries (task_id, version, type, at_ms, event) VALUES (?, ?, ?, ?, ?)", history
            )
            if notified:
                c.executemany(
                    "INSERT INTO outbox (task_id, state, at_ms, version) VALUES (?, ?, ?, ?)", notified
                )

        await self._do(run)

    async def claim_due(self, now_ms: int, limit: int) -> list[Task]:
        # The partial index ix_tasks_live_deadline answers this in O(batch), whatever the table's size.
        query = f"{_SELECT_TASK} WHERE {_ACTIVE} AND expires_at_ms <= ? ORDER BY expires_at_ms LIMIT ?"
        return await self._do(lambda c: [self._seen(_task(r)) for r in c.execute(query, (now_ms, limit))])

    async def callback_digest(self, callback_id: str) -> str | None:
        return (await self.callback_digests([callback_id])).get(callback_id)

    async def insert_callback(self, callback_id: str, task_id: str, at_ms: int, digest: str) -> None:
        await self.insert_callbacks([(callback_id, task_id, at_ms, digest)])

    async def callback_digests(self, callback_ids: Sequence[str]) -> dict[str, str]:
        ids = sorted(set(callback_ids))

        def run(c: sqlite3.Connection) -> dict[str, str]:
            found: dict[str, str] = {}
            for start in range(0, len(ids), _IN_CHUNK):
                chunk = ids[start : start + _IN_CHUNK]
                marks = _marks(len(chunk))
                found.update(
                    c.execute(
                        f"SELECT callback_id, digest FROM callbacks WHERE callback_id IN ({marks})", chunk
                    )
                )
            return found

        return await self._do(run)

    async def insert_callbacks(self, rows: Sequence[tuple[str, str, int, str]]) -> None:
        if rows:
            await self._do(
                lambda c: c.executemany(
                    "INSERT INTO callbacks (callback_id, task_id, at_ms, digest) VALUES (?, ?, ?, ?)", rows
                )
            )

    async def receipt(self, idempotency_key: str) -> Receipt | None:
        def run(c: sqlite3.Connection) -> Receipt | None:
            row = c.execute(
                "SELECT task_id, result_ref, result_hash, idempotency_key, delivered_at_ms FROM deliveries "
                "WHERE idempotency_key = ?",
                (idempotency_key,),
            ).fetchone()
            return None if row is None else Receipt(*row)

        return await self._do(run)

    async def insert_receipt(self, receipt: Receipt) -> None:
        await self._do(
            lambda c: c.execute(
                "INSERT INTO deliveries (idempotency_key, task_id, result_ref, result_hash, delivered_at_ms) "
                "VALUES (?, ?, ?, ?, ?)",
                (
                    receipt.idempotency_key,
                    receipt.task_id,
                    receipt.result_ref,
                    receipt.result_hash,
                    receipt.delivered_at_ms,
                ),
            )
        )

    async def drain(self, now_ms: int) -> list[tuple[int, Notification]]:
        rows = await self._do(
            lambda c: c.execute(
                "UPDATE outbox SET drained_at_ms = ? WHERE drained_at_ms IS NULL "
                "RETURNING id, task_id, state, at_ms, version",
                (now_ms,),
            ).fetchall()
        )
        return [(r[0], Notification(*r[1:])) for r in rows]

    async def claim_relay(self, now_ms: int, lease_until_ms: int, limit: int) -> list[Outgoing]:
        # The partial index ix_outbox_relay_due answers this in O(batch): relayed rows are not in it.
        def run(c: sqlite3.Connection) -> list[Outgoing]:
            rows = c.execute(
                "SELECT id, task_id, state, at_ms, version, relay_attempts FROM outbox "
                "WHERE relayed_at_ms IS NULL AND relay_next_at_ms <= ? ORDER BY relay_next_at_ms, id LIMIT ?",
                (now_ms, limit),
            ).fetchall()
            c.executemany(
                "UPDATE outbox SET relay_next_at_ms = ?, relay_attempts = relay_attempts + 1 WHERE id = ?",
                [(lease_until_ms, r[0]) for r in rows],
            )
            return [Outgoing(r[0], Notification(*r[1:5]), r[5] + 1) for r in rows]

        return await self._do(run)

    async def relay_sent(self, outbox_ids: Sequence[int], now_ms: int) -> None:
        rows = [(now_ms, i) for i in sorted(set(outbox_ids))]
        await self._do(
            lambda c: c.executemany(
                "UPDATE outbox SET relayed_at_ms = ? WHERE id = ? AND relayed_at_ms IS NULL", rows
            )
        )

    async def relay_later(self, outbox_id: int, next_at_ms: int) -> None:
        await self._do(
            lambda c: c.execute(
                "UPDATE outbox SET relay_next_at_ms = ? WHERE id = ? AND relayed_at_ms IS NULL",
                (next_at_ms, outbox_id),
            )
        )

    async def notify(self, channel: str, payloads: Sequence[str]) -> None:
        raise NotImplementedError("SQLite has no NOTIFY")
