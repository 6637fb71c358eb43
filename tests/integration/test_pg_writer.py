"""PostgreSQL's reads and writes go on asyncpg itself, on connections of SQLAlchemy's pool
(gateway.store.pg_writer).

What a caller is told must be what the database holds when a write is cut short by its deadline; a
connection must go back to the pool outside any transaction, whatever ended the one on it (a session left
"idle in transaction" holds its row locks, and every later callback of those tasks would wait on them);
and a connection PostgreSQL closed (a restart, an operator's ``pg_terminate_backend``) must cost at most
the transaction that was on it, answered as the database being unavailable (503, retry), not a bug.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import asyncpg  # type: ignore[import-untyped]
import pytest
import sqlalchemy

import gateway.book.book
import gateway.store.database
import gateway.store.pg_writer
from gateway.book.book import Book
from gateway.machine import Start, create_task
from gateway.store import Database
from gateway.store.base import StoreRace, WriteTx
from gateway.store.database import database_unavailable
from gateway.store.sql import SqlStore
from gateway.store.transaction import SqlTx
from tests.support import FakeClock, opened, postgres_database, transact_cut_short

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


@pytest.fixture
def url() -> Iterator[str]:
    with postgres_database() as made:
        yield made


@pytest.fixture
async def store(url: str) -> AsyncIterator[SqlStore]:
    async with opened(SqlStore(Database(url))) as made:
        yield made


@pytest.fixture
async def other(url: str) -> AsyncIterator[Any]:
    """A connection of another program (an operator's psql)."""
    conn = await asyncpg.connect(url, timeout=5)
    try:
        yield conn
    finally:
        await conn.close()


async def version(store: SqlStore, task_id: str) -> int:
    async with store.read() as tx:
        stored = await tx.task(task_id)
    assert stored is not None
    return stored.task.version


async def sessions_in_a_transaction(other: Any) -> int:
    """The sessions of the database, the caller's aside, that are between statements of a transaction."""
    count: int = await other.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%'"
    )
    return count


async def test_a_callback_answered_503_at_its_deadline_is_not_applied_afterwards(
    store: SqlStore, other: Any
) -> None:
    """Another program holds the task's row lock past the database deadline: the worker is answered
    503, so the callback must not be applied once the lock is let go (live subscribers would never hear
    of it, and the worker retries it), and the connection it waited on is back in the pool, usable."""
    book = Book(store, FakeClock())
    await book.create("t", 60_000, 3)
    async with other.transaction():
        await other.execute("SELECT 1 FROM tasks WHERE id = 't' FOR UPDATE")
        book.deadline_s = 0.5
        with pytest.raises(TimeoutError):
            await book.callback("t", lambda now: Start(now, "w1"))
    book.deadline_s = 10.0
    assert await sessions_in_a_transaction(other) == 0
    assert await version(store, "t") == 0
    outcome = await book.callback("t", lambda now: Start(now, "w1"))  # the worker's retry
    assert outcome.transition.task.version == 1 and await version(store, "t") == 1


async def test_a_failed_transaction_leaves_its_connection_outside_any_transaction(
    store: SqlStore, other: Any
) -> None:
    """Every way a transaction ends without its commit (its work raised, a lost race, a statement the
    database refused) rolls it back before the connection goes back to the pool."""
    book = Book(store, FakeClock())
    await book.create("t", 60_000, 3)
    with pytest.raises(RuntimeError):
        async with store.write() as tx:
            await tx.lock_tasks(["t"])
            raise RuntimeError("the work failed")
    with pytest.raises(asyncpg.StringDataRightTruncationError):
        async with store.write() as tx:
            await tx.lock_tasks(["t"])
            await tx.insert_task(
                create_task(id="x" * 200, now_ms=1_000, ttl_ms=60_000, max_attempts=3), 60_000, 1_000
            )
    with pytest.raises(StoreRace):
        async with store.write() as tx:
            await tx.lock_tasks(["t"])
            await tx.insert_task(
                create_task(id="t", now_ms=1_000, ttl_ms=60_000, max_attempts=3), 60_000, 1_000
            )
    assert await sessions_in_a_transaction(other) == 0
    outcome = await book.callback("t", lambda now: Start(now, "w1"))
    assert outcome.transition.task.version == 1


async def test_a_pooled_connection_postgresql_closed_is_replaced_before_a_write(
    store: SqlStore, other: Any
) -> None:
    """PostgreSQL closes the pool's idle connections (a restart, an operator terminating sessions): the
    next write takes a new connection instead of failing on a closed one (a 503 for nothing)."""
    returned: list[Any] = []

    def checked_in(dbapi_connection: Any, *args: object) -> None:
        if dbapi_connection is not None:  # (None: one invalidated)
            returned.append(dbapi_connection.driver_connection)

    sqlalchemy.event.listen(store.db.engine.sync_engine, "checkin", checked_in)
    book = Book(store, FakeClock())
    await book.create("t", 60_000, 3)
    assert returned
    await other.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
    )
    with anyio.fail_after(5):
        while not all(conn.is_closed() for conn in returned):  # noqa: ASYNC110  (the driver's own state)
            await anyio.sleep(0.01)
    outcome = await book.callback("t", lambda now: Start(now, "w1"))
    assert outcome.transition.task.version == 1


async def test_a_connection_lost_mid_transaction_is_unavailable_and_the_next_write_works(
    store: SqlStore, other: Any
) -> None:
    with pytest.raises(Exception) as lost:
        async with store.write() as tx:
            (row,) = await tx.fetch("SELECT pg_backend_pid()")  # type: ignore[attr-defined]
            await other.execute("SELECT pg_terminate_backend($1)", row[0])
            await tx.insert_task(
                create_task(id="t", now_ms=1_000, ttl_ms=60_000, max_attempts=3), 60_000, 1_000
            )
    assert database_unavailable(lost.value), repr(lost.value)
    book = Book(store, FakeClock())
    _, created = await book.create("t", 60_000, 3)
    assert created


async def test_a_transaction_whose_statement_failed_never_reports_a_commit(store: SqlStore) -> None:
    """A statement's error caught inside the transaction: PostgreSQL has rolled it back, so its end must
    raise rather than pass for a commit of what came before the error."""
    with pytest.raises(RuntimeError, match="did not commit"):
        async with store.write() as tx:
            await tx.insert_task(
                create_task(id="t", now_ms=1_000, ttl_ms=60_000, max_attempts=3), 60_000, 1_000
            )
            with pytest.raises(asyncpg.DivisionByZeroError):
                await tx.fetch("SELECT 1 / 0")  # type: ignore[attr-defined]
    async with store.read() as tx:
        assert await tx.task("t") is None


# A COMMIT that PostgreSQL holds until the test lets it go, and that a cancel cannot stop: a deferred
# trigger waits for an advisory lock the test holds and ignores query_canceled, as a COMMIT past its point
# of no return does (its WAL flush on a slow disk, a synchronous standby).
_HELD_COMMIT = """
CREATE FUNCTION held_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    LOOP
        BEGIN
            PERFORM pg_advisory_xact_lock_shared(4242);
            RETURN NULL;
        EXCEPTION WHEN query_canceled THEN
            NULL;
        END;
    END LOOP;
END $$;
CREATE CONSTRAINT TRIGGER held_commit AFTER INSERT ON tasks DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION held_commit();
"""


async def wait_for_a_commit_held(other: Any) -> None:
    while not await other.fetchval(  # noqa: ASYNC110  (another session's state: nothing to wait on)
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND query = 'COMMIT' AND wait_event_type = 'Lock'"
    ):
        await anyio.sleep(0.01)


async def test_a_caller_cut_short_during_its_commit_gets_what_was_committed(
    store: SqlStore, other: Any
) -> None:
    """The deadline (or a stop) falls while PostgreSQL is committing: the caller must be told what the
    database holds. Told "cancelled" (a 503) for a committed callback, the worker retries what was applied,
    and its news is never published (no bus message, no wake-up of the webhook relay)."""
    await other.execute(_HELD_COMMIT)
    await other.execute("SELECT pg_advisory_lock(4242)")
    task = create_task(id="t", now_ms=1_000, ttl_ms=60_000, max_attempts=3)

    async def work(tx: WriteTx) -> str:
        await tx.insert_task(task, 60_000, 1_000)
        return "created"

    async def finish_commit() -> None:
        await other.execute("SELECT pg_advisory_unlock(4242)")

    outcome = await transact_cut_short(store, work, lambda: wait_for_a_commit_held(other), finish_commit)
    async with store.read() as tx:
        committed = await tx.task("t") is not None
    assert outcome == (["created"] if committed else ["cancelled"])
    assert committed  # the trigger ignores the cancel: the COMMIT went through
    assert await sessions_in_a_transaction(other) == 0


async def test_a_commit_that_never_answers_is_unavailable_and_its_connection_is_not_reused(
    url: str, other: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting for a COMMIT's answer is bounded: past ``COMMIT_DEADLINE_S`` its outcome is unknown, which
    is a 503 (the worker retries with its callbackId), and the connection, in the middle of the COMMIT,
    is closed rather than handed to the next write."""
    await other.execute(_HELD_COMMIT)
    await other.execute("SELECT pg_advisory_lock(4242)")
    monkeypatch.setattr(gateway.store.pg_writer, "COMMIT_DEADLINE_S", 0.2)
    task = create_task(id="t", now_ms=1_000, ttl_ms=60_000, max_attempts=3)
    store = SqlStore(Database(url, pool_size=1, max_overflow=0))  # one connection: the next write's
    await store.open()
    try:
        with anyio.fail_after(5), pytest.raises(ConnectionError) as unknown:
            async with store.write() as tx:
                await tx.insert_task(task, 60_000, 1_000)
        assert database_unavailable(unknown.value)
        with anyio.fail_after(5):
            async with store.write() as tx:
                assert await tx.receipt("k") is None
    finally:
        await other.execute("SELECT pg_advisory_unlock(4242)")
        await store.close()


async def test_a_read_holds_no_transaction_and_one_cut_short_gives_its_connection_up(
    url: str, other: Any
) -> None:
    """Reads take no ``BEGIN`` (each statement has a snapshot of its own, as under read committed), so a
    read held open holds no snapshot and no lock. One cut short in the middle of a statement (only its
    deadline does that: PostgreSQL did not answer) gives its connection up at once instead of waiting for
    the statement's cancellation, and the next transaction gets a working one."""
    store = SqlStore(Database(url, pool_size=1, max_overflow=0))  # one connection: the next one's
    await store.open()
    try:
        async with store.read() as tx:
            assert await tx.task("t") is None
            assert await sessions_in_a_transaction(other) == 0
        with anyio.fail_after(5):
            with anyio.move_on_after(0.3) as scope:
                async with store.read() as tx:
                    assert isinstance(tx, SqlTx)
                    await tx.fetch("SELECT pg_sleep(10)")
            assert scope.cancelled_caught
            async with store.write() as written:
                task = create_task(id="t", now_ms=1_000, ttl_ms=60_000, max_attempts=3)
                await written.insert_task(task, 60_000, 1_000)
            assert await version(store, "t") == 0
    finally:
        await store.close()


async def test_a_burst_of_reads_waits_for_kept_connections_instead_of_opening_new_ones(url: str) -> None:
    """A reconnect storm is a burst of reads. Past the pool's kept connections a read would open one of
    its own, used once and closed (a PostgreSQL process forked for it), over and over while the burst
    lasts, and past ``max_connections`` the reads would fail: they wait for a kept one instead."""
    db = Database(url, pool_size=5, max_overflow=10)
    opened_connections = 0

    def count(*_: Any) -> None:
        nonlocal opened_connections
        opened_connections += 1

    sqlalchemy.event.listen(db.engine.sync_engine, "connect", count)
    store = SqlStore(db)
    await store.open()
    try:
        before = opened_connections
        at_once = 0
        most = 0

        async def read() -> None:
            nonlocal at_once, most
            async with store.read() as tx:
                at_once += 1
                most = max(most, at_once)
                assert isinstance(tx, SqlTx)
                await tx.fetch("SELECT pg_sleep(0.02)")
                at_once -= 1

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for _ in range(60):
                    tg.start_soon(read)
        # The rest waited their turn: the connections kept for writes are the group commit's.
        assert most == 5 - gateway.store.database.COMMITS_IN_FLIGHT
        assert opened_connections - before <= most, "reads opened connections past the kept ones"
    finally:
        await store.close()


async def test_a_connection_the_driver_finds_mid_operation_is_unavailable_and_given_up(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncpg can find a pooled connection's protocol still in another operation's state (seen when
    PostgreSQL stopped: ``cannot switch to state 12; another operation (2) is in progress``). The read
    on it is the database being unavailable (a 503, the sweeper's one-line warning), not a bug with a
    traceback; the connection is given up, and the next read, on a new one, works."""
    store = SqlStore(Database(url, pool_size=1, max_overflow=0))
    await store.open()
    try:
        broken: list[Any] = []
        real_fetch = asyncpg.Connection.fetch

        async def mid_operation(self: Any, *args: Any, **kwargs: Any) -> Any:
            broken.append(self)
            monkeypatch.setattr(asyncpg.Connection, "fetch", real_fetch)
            raise asyncpg.InternalClientError(
                "cannot switch to state 12; another operation (2) is in progress"
            )

        monkeypatch.setattr(asyncpg.Connection, "fetch", mid_operation)
        with pytest.raises(Exception) as failed:
            async with store.read() as tx:
                await tx.task("t")
        assert database_unavailable(failed.value), repr(failed.value)
        assert [conn.is_closed() for conn in broken] == [True]
        async with store.read() as tx:
            assert await tx.task("t") is None
    finally:
        await store.close()
