"""PostgreSQL on asyncpg itself: transactions on connections of SQLAlchemy's pool, their statements
(``gateway.store.queries``) sent with no SQLAlchemy between. The writes, and the reads too.

Why: under a stream of callbacks the gateway's process is the bottleneck, not PostgreSQL, and through
SQLAlchemy Core a callback batch spent more of its CPU compiling, caching and crossing greenlets than in
the driver, for nine round trips (begin, lock, dedup, three writes, the callback ids, ``NOTIFY``, commit).
Here the statement texts are made once, asyncpg prepares each once per connection, and a batch makes five
round trips: ``BEGIN``, the lock, the dedup lookup, every write at once, ``COMMIT``. A read runs its
statements outside any transaction, each with a snapshot of its own: what a read-committed transaction
gives them anyway, without the round trips of its ``BEGIN`` and ``ROLLBACK``.

A batch of stream appends makes four: ``BEGIN``, the lock with the streams' heads, every write at once (the
batches, the heads, the lease renewals and the ``NOTIFY`` messages among them), ``COMMIT``.

Every write at once: the batch writes of a transaction (task rows, their entries and notifications, the
callback ids, the ``NOTIFY`` messages, stream appends, lease renewals) are held by :class:`PgTx` until the
transaction's next statement or its commit, then sent as one statement (data-modifying CTEs over
``unnest`` of one array per column). The task rows go first and the rest only if each of them was at the
version the transaction read: a task row changed under its lock (impossible while the lock holds) writes
nothing and raises.

The connection comes from the engine's pool, shared with the reads, and goes back to it as it came:
outside any transaction. A transaction cut short (an error, a stop) before its ``COMMIT`` is rolled back
before the connection goes back; one cut short during its ``COMMIT`` waits for the answer, so that the
caller is told what PostgreSQL did (as the SQLite writer's ``transact`` does). A connection that is
broken, or cannot roll back in time, is invalidated (the pool opens another), and one found closed when
taken (PostgreSQL restarted meanwhile) is replaced before the transaction starts.

Reads at once: at most ``reads_at_once`` (the pool's kept connections less the group commit's), the others
waiting their turn. A burst of reads (a reconnect storm: a read per task resumed) would otherwise take
every connection the pool may open, and one above its kept size is opened for one read and closed after
it: a new PostgreSQL connection (a process forked on its side, the driver's setup on this one) per read
for as long as the burst lasts, and past ``max_connections`` the reads fail. Waiting, they are fewer:
resumes of one task share a read that has not started (``gateway.book``).

One deadline for the whole transaction: the caller's (the book's database deadline, the cancel scope it
writes in), read when the transaction starts. Its statements, its ``COMMIT`` and its rollback all end by
then: a network that stopped answering (a partition: packets dropped, no reset) is not waited on for a
rollback or a commit after the deadline. Past it the connection is abandoned (terminated: closed at
once, nothing sent or awaited) and PostgreSQL rolls back whatever it had not committed; a transaction
whose ``COMMIT`` was sent and not answered has an unknown outcome, which is a 503 (callbacks carry ids).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
import asyncpg  # type: ignore[import-untyped]
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.machine import Task, Transition
from gateway.store import queries as q
from gateway.store.base import StoredTask, StoreRace, StreamWrites
from gateway.store.tables import task_values
from gateway.store.transaction import SqlTx, finished, spans, stream_rows, task_row
from gateway.streams import Head

# The longest a rollback may take before its connection is given up (invalidated) instead, within what is
# left of the transaction's deadline.
ROLLBACK_DEADLINE_S = 5.0
# The longest a caller waits for the answer to its COMMIT, a stop included: at most this, and never past
# the transaction's deadline.
COMMIT_DEADLINE_S = 5.0
_DRIVER_ERRORS = (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError)
# The columns of a stream batch's row and of a head's, with their key (task id; and the stream's name).
_BATCH_WIDTH = 2 + len(q.BATCH_COLUMNS)
_HEAD_WIDTH = 1 + len(q.HEAD_COLUMNS)


class PgWriter:
    """Transactions on the raw asyncpg connections of ``engine``'s pool."""

    def __init__(self, engine: AsyncEngine, *, pool_capacity: int, reads_at_once: int) -> None:
        self.engine = engine
        # Connections the pool may hold: how many closed ones a checkout may find before an open one.
        self._capacity = pool_capacity
        self._reads = anyio.Semaphore(reads_at_once)  # see the module's docstring

    @asynccontextmanager
    async def write(self) -> AsyncIterator[PgTx]:
        """A transaction that commits when the block ends without an exception; :class:`StoreRace` when
        a unique key was taken by a concurrent transaction (nothing written). It ends by the deadline of
        the cancel scope it is written in, its commit and rollback included."""
        deadline = anyio.current_effective_deadline()
        conn, driver = await self._checkout()
        try:
            await driver.execute("BEGIN")
            tx = PgTx(driver)
            yield tx
            await tx.flush()
            await anyio.lowlevel.checkpoint_if_cancelled()  # cut short before its COMMIT: rolled back
            status = await _commit(driver, deadline)
            if status != "COMMIT":  # a statement failed and its error was swallowed: nothing was written
                raise RuntimeError(f"the transaction did not commit ({status})")
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                kept = await self._checkin(conn, driver, committed=False, deadline=deadline)
            if isinstance(exc, asyncpg.UniqueViolationError):  # from any statement, or the COMMIT
                raise StoreRace(str(exc)) from exc
            if isinstance(exc, asyncpg.DeadlockDetectedError):
                # Rolled back, nothing written: a child's write locks its parent after it, and a batch
                # holding the parent's own callback may have locked them the other way round
                # (gateway.book.batches). Run again, it finds the other committed.
                raise StoreRace(str(exc)) from exc
            if not kept and isinstance(exc, _DRIVER_ERRORS):
                # What the driver says of a connection that died under a statement varies (the server's
                # FATAL message, "connection is closed", a protocol state error): it is one thing.
                raise ConnectionError("the connection to PostgreSQL was lost during a write") from exc
            raise
        with anyio.CancelScope(shield=True):
            await self._checkin(conn, driver, committed=True)

    @asynccontextmanager
    async def read(self) -> AsyncIterator[PgTx]:
        """Reads on a connection of the pool, in no transaction: nothing to commit or roll back. A read is
        cut short in the middle of a statement only by its deadline, when PostgreSQL did not answer: its
        connection is then given up at once, rather than kept at the price of waiting (asyncpg would, for
        the statement's cancellation) on the network that did not answer."""
        async with self._reads:
            conn, driver = await self._checkout()
            tx = PgTx(driver)
            try:
                yield tx
            finally:
                with anyio.CancelScope(shield=True):
                    if tx.unanswered:
                        driver.terminate()
                    await self._checkin(conn, driver, committed=True)

    async def _checkout(self) -> tuple[AsyncConnection, Any]:
        """A pooled connection and its asyncpg connection, open (as far as can be told without a query)."""
        for attempt in range(self._capacity + 1):
            conn = await self.engine.connect()
            try:
                driver: Any = (await conn.get_raw_connection()).driver_connection
            except BaseException:
                with anyio.CancelScope(shield=True):
                    await conn.close()
                raise
            if not driver.is_closed() or attempt == self._capacity:
                return conn, driver
            # Closed while it waited in the pool (PostgreSQL restarted, an idle timeout): replaced.
            with anyio.CancelScope(shield=True):
                await conn.invalidate()
                await conn.close()
        raise AssertionError("unreachable")

    async def _checkin(
        self, conn: AsyncConnection, driver: Any, *, committed: bool, deadline: float = math.inf
    ) -> bool:
        """Give the connection back to the pool outside any transaction (``True``), or give it up: past
        ``deadline`` it is not rolled back but terminated at once."""
        kept = not driver.is_closed()
        if kept and not committed:
            # Also after a statement cut short: asyncpg waits for its cancellation first. Outside a
            # transaction (BEGIN never ran, or COMMIT failed and ended it) this is a harmless warning.
            left = min(ROLLBACK_DEADLINE_S, deadline - anyio.current_time())
            try:
                with anyio.fail_after(left):
                    await driver.execute("ROLLBACK")
            except Exception:
                kept = False
        kept = kept and not driver.is_in_transaction()
        if not kept:
            # Abandoned, not closed politely: a close would wait on a network that may not answer.
            driver.terminate()
            await conn.invalidate()
        await conn.close()
        return kept


async def _commit(driver: Any, deadline: float) -> str:
    """``COMMIT``, its answer waited for whatever cancels the caller meanwhile: once it is sent, PostgreSQL
    may commit whatever the client does (a cancel cannot stop a commit past its point of no return, and
    one lost on the way is never seen), so the caller is told what it did. No answer within
    ``COMMIT_DEADLINE_S`` or by the transaction's ``deadline``: the outcome is unknown, the connection
    closed, and ``ConnectionError`` (a 503)."""
    with anyio.CancelScope(shield=True, deadline=min(deadline, anyio.current_time() + COMMIT_DEADLINE_S)):
        status: str = await driver.execute("COMMIT")
        return status
    driver.terminate()
    raise ConnectionError("PostgreSQL did not answer a COMMIT in time: its outcome is unknown")


class PgTx(SqlTx):
    """A transaction on an asyncpg connection: the statements of :class:`SqlTx` numbered for PostgreSQL,
    rows locked, lists of keys as one array, the batch writes held and sent together."""

    __slots__ = ("_batch", "_conn", "unanswered")

    LOCK = q.LOCK
    CLAIM = q.CLAIM

    def __init__(self, conn: Any) -> None:
        super().__init__()
        self._conn = conn
        self._batch = _Batch()
        # A query (what a read runs) was sent and its answer never came (cut short), or came as an error.
        self.unanswered = False

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> Sequence[Sequence[Any]]:
        await self.flush()
        self.unanswered = True
        with self._usable():
            rows: Sequence[Sequence[Any]] = await self._conn.fetch(q.numbered(sql), *params)
        self.unanswered = False
        return rows

    async def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        await self.flush()
        with self._usable():
            status: str = await self._conn.execute(q.numbered(sql), *params)
        return int(status.rpartition(" ")[2])  # "UPDATE 3", "INSERT 0 1"

    @contextmanager
    def _usable(self) -> Iterator[None]:
        """A connection whose protocol the driver finds in the middle of another operation (``cannot switch
        to state 12; another operation (2) is in progress``: seen on a pooled connection when PostgreSQL
        stopped, its error never followed by the end of it) can run nothing more: it is given up, and
        what the caller is told is the database's unavailability (a 503 or a one-line warning), not a bug."""
        try:
            yield
        except asyncpg.InternalClientError as exc:
            self._conn.terminate()
            raise ConnectionError(f"the connection to PostgreSQL cannot be used: {exc}") from exc

    def in_list(self, column: str, values: Sequence[Any]) -> Iterator[tuple[str, list[Any]]]:
        if values:
            yield q.IN_ARRAY.format(column=column), [list(values)]

    async def insert_task(
        self, task: Task, ttl_ms: int, created_at_ms: int, heartbeat_ms: int | None = None
    ) -> None:
        if not task.tags:
            await super().insert_task(task, ttl_ms, created_at_ms, heartbeat_ms)
            return
        row = task_row(task, ttl_ms, created_at_ms, heartbeat_ms)
        await self.run(q.PG_INSERT_TAGGED, (*row, task.id, created_at_ms, list(task.tags)))

    def cursor_rows(self, cursors: Mapping[str, int]) -> tuple[str, list[Any]]:
        ids = [i for i in cursors if "\x00" not in i]  # no task has one; PostgreSQL text cannot hold it
        return q.PG_CURSORS, [ids, [cursors[i] for i in ids]]

    # Locks and dedup look each key up on its own (queries.PG_LOCK_TASKS says why).

    async def lock_tasks(self, task_ids: Sequence[str]) -> dict[str, StoredTask]:
        # Locked in the order of the ids (sorted), so that concurrent batches lock in one order.
        ids = sorted({i for i in task_ids if "\x00" not in i})
        if not ids:
            return {}
        return self._locked(await self.fetch(q.PG_LOCK_TASKS, (ids,)))

    async def lock_tasks_and_heads(
        self, task_ids: Sequence[str], streamed: Sequence[str]
    ) -> tuple[dict[str, StoredTask], dict[str, list[Head]]]:
        # One statement (a round trip less for every group commit of appends): each task's row locked, as
        # lock_tasks does, with its streams' heads if it is among ``streamed``.
        ids = sorted({i for i in task_ids if "\x00" not in i})
        if not ids:
            return {}, {}
        wanted = set(streamed)
        rows = await self.fetch(q.PG_LOCK_TASKS_HEADS, (ids, [i in wanted for i in ids]))
        heads = {row[0]: [Head(*h) for h in row[-1]] for row in rows if row[-1]}
        return self._locked([tuple(row)[:-1] for row in rows]), heads

    async def callback_digests(self, callback_ids: Sequence[str]) -> dict[str, str]:
        if not callback_ids:
            return {}
        rows = await self.fetch(q.PG_DIGESTS, (sorted(set(callback_ids)),))
        return {r[0]: r[1] for r in rows if r[1] is not None}

    # --- the batch writes, held until the next statement or the commit ----------------------------------

    async def record_many(self, items: Sequence[tuple[Transition, bytes, float]]) -> None:
        batch = self._batch
        batch.finished.update(finished(items))
        for task_id, (before, task) in spans(items).items():
            batch.columns.update(self._changes(task))
            if task_id in batch.finished:
                batch.columns.add("finished_at_ms")
            held = batch.updates.get(task_id)
            batch.updates[task_id] = (before if held is None else held[0], task)
        for t, encoded, at in items:
            if t.entry is not None:
                batch.entries.append(
                    (t.task.id, t.entry.version, t.entry.event.type, t.entry.event.at_ms, encoded)
                )
            if t.notify:
                batch.outbox.append((t.task.id, t.task.state, at, t.task.version))

    async def write_tasks(self, tasks: Sequence[Task]) -> None:
        batch = self._batch
        for task in tasks:
            changes = self._changes(task)
            if changes:
                batch.columns.update(changes)
                held = batch.updates.get(task.id)
                batch.updates[task.id] = (task.version if held is None else held[0], task)

    async def insert_callbacks(self, rows: Sequence[tuple[str, str, int, str]]) -> None:
        self._batch.callbacks.extend(rows)

    async def renew_leases(self, leases: Sequence[tuple[str, int]]) -> None:
        # Held, and sent with the batch's writes (or after them: see flush).
        self._batch.leases.update(leases)

    async def notify(self, channel: str, payloads: Sequence[str]) -> None:
        self._batch.notices.extend((channel, p) for p in payloads)

    async def write_streams(self, writes: StreamWrites) -> None:
        # Held, and sent with the batch's writes: the drops, the batches and the heads (made, then moved
        # with their key first).
        if self._batch.streams is not None:
            await self.flush()
        drops, batches, made, moved = (rows for _, rows in stream_rows(writes))
        moved = [(*row[-2:], *row[:-2]) for row in moved]
        self._batch.streams = [
            column
            for rows, width in (
                (drops, 3),
                (batches, _BATCH_WIDTH),
                (made, _HEAD_WIDTH),
                (moved, _HEAD_WIDTH),
            )
            for column in _arrays(rows, width)
        ]

    async def flush(self) -> None:
        """Send the writes held so far, in one statement; the lease renewals of tasks whose rows it updates
        in one more, after it (PostgreSQL updates a row once a statement)."""
        batch = self._batch
        if not batch:
            return
        self._batch = _Batch()
        columns = tuple(sorted(batch.columns))
        params: list[Any] = []
        if batch.updates:
            ids = list(batch.updates)
            # finished_at_ms is the task's ended_at_ms: set on the tasks that end here (the book stamps it at
            # their notification's time), kept on those that ended before (a parent whose children change).
            values = [
                {**task_values(task), "finished_at_ms": batch.finished.get(task_id, task.ended_at_ms)}
                for task_id, (_, task) in batch.updates.items()
            ]
            params += [ids, [before for before, _ in batch.updates.values()]]
            params += [[v[name] for v in values] for name in columns]
            params.append(len(ids))
        # Callback ids in one order, so that two batches inserting the same ones cannot deadlock: the
        # second waits for the first, then loses the race (StoreRace) and runs again.
        for rows, width in (
            (batch.entries, len(q.ENTRY_COLUMNS)),
            (batch.outbox, len(q.NOTIFICATION_COLUMNS)),
            (sorted(batch.callbacks), len(q.CALLBACK_COLUMNS)),
            (batch.notices, 2),
        ):
            params += _arrays(rows, width)
        if batch.streams is not None:
            params += batch.streams
        leases = batch.leases
        after = not leases.keys().isdisjoint(batch.updates)
        held = bool(leases) and not after
        if held:
            params += [list(leases), list(leases.values())]
        sql = q.pg_batch(columns if batch.updates else None, streams=batch.streams is not None, leases=held)
        checked, _ = await self._conn.fetchrow(sql, *params)
        if not checked:  # the row locks make this impossible; never write over a concurrent change
            raise RuntimeError("a task changed under its lock")
        if after:
            await self._conn.execute(q.numbered(q.PG_RENEW_LEASES), list(leases), list(leases.values()))


class _Batch:
    """The writes a :class:`PgTx` holds."""

    __slots__ = (
        "callbacks",
        "columns",
        "entries",
        "finished",
        "leases",
        "notices",
        "outbox",
        "streams",
        "updates",
    )

    def __init__(self) -> None:
        # Each task's row write: the version it was read at, its last state; and the columns to set.
        self.updates: dict[str, tuple[int, Task]] = {}
        self.columns: set[str] = set()
        # When the tasks that end in this batch finished (transaction.finished).
        self.finished: dict[str, int] = {}
        self.entries: list[tuple[str, int, str, float, bytes]] = []
        self.outbox: list[tuple[str, str, float, int]] = []
        self.callbacks: list[tuple[str, str, int, str]] = []
        self.notices: list[tuple[str, str]] = []
        # The stream appends' arrays (PgTx.write_streams), and the lease ends to set, by task.
        self.streams: list[list[Any]] | None = None
        self.leases: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(
            self.updates
            or self.entries
            or self.outbox
            or self.callbacks
            or self.notices
            or self.streams is not None
            or self.leases
        )


def _arrays(rows: Sequence[tuple[Any, ...]], width: int) -> list[list[Any]]:
    """Rows as one array per column."""
    return [list(column) for column in zip(*rows, strict=True)] if rows else [[] for _ in range(width)]
