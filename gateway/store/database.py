"""The database: engine set-up for a SQLite file (the zero-configuration default) and PostgreSQL.

The engine owns the connections (its pool) and the schema (Alembic, ``migrate``); the store's statements
run on the drivers beneath it (``gateway.store.sql``). Transactions that change data: on PostgreSQL plain
transactions on asyncpg connections of the engine's pool (``pg_writer``), rows locked with ``SELECT ...
FOR UPDATE``; on SQLite, which has one writer anyway, the writer's own connection (``sqlite_writer``),
writes of this process queuing on an in-process lock for their turn (an urgent write, expiry, goes before
the others waiting), and a lock file keeps a second process off the file (SQLite serves one gateway
process; any number share a PostgreSQL database). A SQLite database in memory is refused: every task
would vanish with the process, and each connection of the pool would see a database of its own.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import IO, Any
from urllib.parse import quote

import anyio
import asyncpg  # type: ignore[import-untyped]
from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from gateway.errors import ConfigError
from gateway.store import tables  # noqa: F401  (registers the tables on SQLModel.metadata)
from gateway.store.migrate import migrate
from gateway.store.pg_writer import PgWriter
from gateway.store.priority_lock import PriorityLock
from gateway.store.queries import TASK_EXISTS, numbered
from gateway.store.sqlite_writer import SqliteWriter, apply_pragmas, disk_full

# Free space on a SQLite file's filesystem after which a disk that filled counts as having room again
# (a checkpoint of SQLite's default WAL copies up to about 4 MiB into the file).
ROOM_AGAIN_BYTES = 4 * 1024 * 1024
# Callback batches committing at once on PostgreSQL (of the pool's 10 connections, and 10 more on demand),
# by the processes of one `gateway serve --workers N` together: each commits its share, and at least one.
# Every batch costs its round trips and its commit whatever its size, and batches grow when fewer commit at
# once: N processes each committing 3 would commit N times as many batches, each smaller (measured on two
# processes: 6-10 callbacks a batch where one process made 16, and 1.35x its CPU per callback; one batch
# each, 1.13x, the throughput kept: bench/workers_cost.py).
# The pool's kept connections the reads leave to them (see PgWriter).
COMMITS_IN_FLIGHT = 3
DISK_FULL = "the disk holding the database is full"


def async_url(url: str) -> str:
    """``postgresql://u@h/db`` -> asyncpg, ``sqlite:///f.db`` -> aiosqlite; a named driver is kept."""
    try:
        parsed = make_url(url)
    except ArgumentError:  # its text may hold a password: not repeated
        raise ConfigError(
            "GATEWAY_DATABASE_URL: not a database URL (use sqlite:///file.db or postgresql://user@host/db)"
        ) from None
    backend, _, driver = parsed.drivername.partition("+")
    if backend in ("postgresql", "postgres"):
        return parsed.set(drivername="postgresql+asyncpg").render_as_string(hide_password=False)
    if backend == "sqlite":
        if parsed.host or parsed.username or parsed.port:
            # sqlite://gateway.db: two slashes make the file name a host name.
            raise ConfigError(
                "GATEWAY_DATABASE_URL: a SQLite URL has three slashes before a relative path "
                "(sqlite:///gateway.db) and four before an absolute one (sqlite:////var/lib/gateway.db)"
            )
        return parsed.set(drivername=f"sqlite+{driver or 'aiosqlite'}").render_as_string(hide_password=False)
    raise ConfigError(f"GATEWAY_DATABASE_URL: unsupported database {backend!r} (use sqlite or postgresql)")


class Database:
    def __init__(
        self, url: str, *, pool_size: int = 10, max_overflow: int = 10, reads_at_once: int | None = None
    ) -> None:
        """``pool_size`` and ``max_overflow``: PostgreSQL's connections, kept open and opened on demand;
        ``reads_at_once``: reads on them at once (default: ``pool_size`` less :data:`COMMITS_IN_FLIGHT`)."""
        self.url = async_url(url)
        path = sqlite_path(self.url)
        self.is_sqlite = path is not None
        self._write_lock = PriorityLock() if self.is_sqlite else None
        # A SQLite file's writes go through one connection on a thread of its own, a transaction a hop.
        self.writer = SqliteWriter(path) if path is not None else None
        self._lock_file: IO[str] | None = None
        kwargs: dict[str, Any] = {}
        if not self.is_sqlite:
            # A database that does not answer is noticed in seconds, not asyncpg's default minute. asyncpg
            # keeps each statement of the writes prepared (pg_writer), the batch writes' too: longer than
            # its default limit of 1 KiB, it would be parsed and planned again for every batch.
            connect_args = {"timeout": 5, "max_cacheable_statement_size": 16 * 1024}
            kwargs.update(
                pool_size=pool_size, max_overflow=max_overflow, pool_timeout=10, connect_args=connect_args
            )
        self.engine: AsyncEngine = create_async_engine(self.url, **kwargs)
        # PostgreSQL's writes go on asyncpg itself, on connections of the engine's pool.
        self.pg_writer = (
            None
            if self.is_sqlite
            else PgWriter(
                self.engine,
                pool_capacity=pool_size + max_overflow,
                reads_at_once=(
                    max(1, pool_size - COMMITS_IN_FLIGHT) if reads_at_once is None else reads_at_once
                ),
            )
        )
        if self.is_sqlite:
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)

    async def open(self) -> None:
        """Take the single-process lock (SQLite) and migrate the schema to head (gateway.store.migrate)."""
        if self.is_sqlite:
            self._lock_sqlite_file()
        await migrate(self.engine)
        if self.writer is not None:
            await self.writer.open()

    async def close(self) -> None:
        if self.writer is not None:
            await self.writer.close()
        await self.engine.dispose()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    @asynccontextmanager
    async def write_turn(self, *, urgent: bool = False) -> AsyncIterator[None]:
        """This process's turn to write to a SQLite file (``urgent`` ones first); at once on PostgreSQL."""
        if self._write_lock is None:
            yield
            return
        async with self._write_lock.hold(urgent=urgent):
            yield

    @asynccontextmanager
    async def read(self) -> AsyncIterator[AsyncConnection]:
        """A connection of the engine's pool, for reads."""
        async with self.engine.connect() as conn:
            yield conn

    async def ping(self, deadline_s: float = 3.0) -> None:
        """``SELECT 1``, answered within ``deadline_s`` or ``TimeoutError`` (readiness probes wait less)."""
        with anyio.fail_after(deadline_s, shield=True):
            async with self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))

    def disk_full(self) -> bool:
        """Whether writes to the SQLite file fail for a full disk: the last write did, and its filesystem
        has not got ``ROOM_AGAIN_BYTES`` free since (once it has, writes are let try again, and the next
        one tells). Always ``False`` on PostgreSQL, which says so itself (a 53xxx error, a 503)."""
        writer = self.writer
        if writer is None or not writer.full:
            return False
        if shutil.disk_usage(os.path.dirname(writer.path)).free >= ROOM_AGAIN_BYTES:
            writer.full = False
        return writer.full

    def _lock_sqlite_file(self) -> None:
        self._lock_file = _lock_sqlite(self.url)


IN_MEMORY = (
    "GATEWAY_DATABASE_URL: an in-memory SQLite database is not supported (every task would vanish with the "
    "process, and other connections would not see it); use a file, sqlite:///gateway.db, or PostgreSQL"
)


def sqlite_path(url: str) -> str | None:
    """The absolute path of a SQLite database's file; ``None`` for PostgreSQL. ``ConfigError`` for a SQLite
    database that is not a file named by its path: in memory, or a URI filename (``uri=true``), which the
    writer's connection and the lock file beside it would not find."""
    parsed = make_url(async_url(url))
    if not parsed.drivername.startswith("sqlite"):
        return None
    database = parsed.database or ":memory:"
    if database == ":memory:" or database.startswith("file::memory:") or parsed.query.get("mode") == "memory":
        raise ConfigError(IN_MEMORY)
    if "uri" in parsed.query:
        raise ConfigError(
            "GATEWAY_DATABASE_URL: a SQLite URI filename (uri=true) is not supported; "
            "name the file by its path, sqlite:///gateway.db"
        )
    return os.path.abspath(database)


async def task_exists(url: str, task_id: str, deadline_s: float = 5.0) -> bool | None:
    """Whether the database at ``url`` holds the task; ``None`` when that cannot be told within
    ``deadline_s`` (a SQLite file that does not exist, which is not made; a database that cannot be
    reached, or has no schema yet). Reads only."""
    path = sqlite_path(url)
    if path is not None:
        return await anyio.to_thread.run_sync(_sqlite_task_exists, path, task_id)
    engine = create_async_engine(async_url(url), connect_args={"timeout": deadline_s})
    try:
        with anyio.fail_after(deadline_s):
            async with engine.connect() as conn:
                found = await conn.exec_driver_sql(numbered(TASK_EXISTS), (task_id,))
                return found.first() is not None
    except Exception:  # whatever the reason, it could not be told
        return None
    finally:
        await engine.dispose()


def _sqlite_task_exists(path: str, task_id: str) -> bool | None:
    if not os.path.isfile(path):
        return None
    try:
        conn = sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True, timeout=5)
        try:
            return conn.execute(TASK_EXISTS, (task_id,)).fetchone() is not None
        finally:
            conn.close()
    except sqlite3.Error:
        return None


def check_database_url(url: str) -> None:
    """``ConfigError`` for a URL the gateway cannot use: unparsable, an unsupported database, a SQLite
    database in memory (``sqlite_path`` says why), or a SQLite file whose directory does not exist (it is
    not made: a typo in a path must not grow a tree)."""
    path = sqlite_path(url)
    if path is not None:
        directory = os.path.dirname(path)
        if not os.path.isdir(directory):
            raise ConfigError(
                f"GATEWAY_DATABASE_URL: the directory {directory} does not exist (create it, or fix the path)"
            )


def _lock_sqlite(url: str) -> IO[str] | None:
    """Take the SQLite file's process lock (a ``.lock`` file beside it), or raise ``ConfigError``."""
    path = sqlite_path(url)
    if path is None:
        return None
    check_database_url(url)
    handle = open(path + ".lock", "w")  # noqa: SIM115  (held for the life of the gateway)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise ConfigError(
            f"another gateway process is serving {path}: a SQLite gateway runs as one process "
            "(set GATEWAY_DATABASE_URL to a PostgreSQL database to run several)"
        ) from None
    return handle


def check_processes(url: str, workers: int) -> None:
    """Refuse a second process on a SQLite file (``--workers``, or a file another gateway serves)."""
    if not url.strip().lower().startswith("sqlite"):
        return
    if workers > 1:
        raise ConfigError(
            f"--workers {workers}: a SQLite gateway runs as one process; set GATEWAY_DATABASE_URL "
            "to a PostgreSQL database to run several"
        )
    check_sqlite_free(url)


def check_sqlite_free(url: str) -> None:
    """Raise ``ConfigError`` if another process serves this SQLite file (checked before the server starts,
    so that the refusal is one line; the lifespan takes the lock for real)."""
    handle = _lock_sqlite(async_url(url))
    if handle is not None:
        handle.close()


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    apply_pragmas(dbapi_connection)


# SQLSTATE classes of a database that cannot serve now: connection exceptions (08), insufficient resources
# (53), operator intervention such as a shutdown (57); and "not accepting connections" (55000) and a
# database that does not exist (3D000).
_UNAVAILABLE_CLASSES = ("08", "53", "57")
_UNAVAILABLE_STATES = ("55000", "3D000")


def unavailable_reason(exc: BaseException) -> str:
    """What an exception of :func:`database_unavailable` means, in the words of a 503 and a log line."""
    return DISK_FULL if disk_full(exc) else "the database is unreachable"


def database_unavailable(exc: BaseException) -> bool:
    """Whether an exception means "the database cannot be reached now" (a 503), not a bug (a 500)."""
    if isinstance(exc, (OSError, PoolTimeout)):  # TimeoutError (a deadline) is an OSError
        return True
    if isinstance(exc, sqlite3.OperationalError):  # the SQLite writer's own connection (locked, disk I/O)
        return True
    if isinstance(exc, asyncpg.InterfaceError):  # PostgreSQL's writes on asyncpg itself: a connection closed
        return True
    if isinstance(exc, DBAPIError):
        if exc.connection_invalidated or isinstance(exc, (OperationalError, InterfaceError)):
            return True
        state = getattr(exc.orig, "sqlstate", None) or getattr(exc.orig, "pgcode", None)
    elif isinstance(exc, asyncpg.PostgresError):  # (there, the server's errors come as asyncpg raised them)
        state = exc.sqlstate
    else:
        return False
    return isinstance(state, str) and (state[:2] in _UNAVAILABLE_CLASSES or state in _UNAVAILABLE_STATES)
