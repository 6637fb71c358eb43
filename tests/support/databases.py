"""The tests' databases: a SQLite file or a PostgreSQL database of their own, already at the newest schema.

A test never pays for the migrations: each process migrates one template of each kind once and copies it.

- SQLite: :func:`sqlite_database` copies a migrated file (made on first use, in a temporary folder of the
  process) to the path the test names, a file copy of a few kilobytes.
- PostgreSQL: :func:`postgres_database` hands out a copy of the process's template database (``CREATE
  DATABASE ... TEMPLATE``). Copies are made ahead and dropped behind, on a thread of their own
  (:class:`_Pool`): a ``DROP DATABASE`` waits for a checkpoint and a ``CREATE`` writes the template's pages
  to the WAL, which
  together cost a test several tenths of a second on a busy disk, none of which is the test's work. A test
  still gets a database no other test has used, and its database is still gone once the session ends.

Tests marked ``empty_database`` (the migrations' own tests) get empty ones instead (tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import queue
import shutil
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import asyncpg  # type: ignore[import-untyped]  # no stubs, no py.typed (as in gateway/store/database.py)
import pytest

from gateway.store.database import Database
from gateway.store.migrate import migrate

# The PostgreSQL of this machine (trust auth); tests make a database of their own in it and drop it.
PG_ADMIN_URL = os.environ.get("GATEWAY_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/postgres")

# Copies of the template made ahead of the tests that take them.
AHEAD = 2

# Set by :func:`empty_databases`: every database made meanwhile is empty, whatever is asked for.
_empty_only = False


@contextmanager
def empty_databases() -> Iterator[None]:
    """Within the block, :func:`postgres_database` and :func:`sqlite_database` make empty databases only,
    even asked for a copy of the template (tests/conftest.py: tests marked ``empty_database``)."""
    global _empty_only
    before, _empty_only = _empty_only, True
    try:
        yield
    finally:
        _empty_only = before


# --- SQLite -------------------------------------------------------------------------------------------------

_sqlite_template: tuple[Path, int] | None = None
_sqlite_lock = threading.Lock()


def sqlite_database(path: Path) -> str:
    """The URL of a SQLite file at ``path``, at the newest schema (a copy of the process's migrated file;
    nothing is written where the test asked for an empty database)."""
    if not _empty_only:
        shutil.copyfile(_sqlite_template_file(), path)
    return f"sqlite:///{path}"


def _sqlite_template_file() -> Path:
    global _sqlite_template
    with _sqlite_lock:
        if _sqlite_template is None or _sqlite_template[1] != os.getpid():
            folder = Path(tempfile.mkdtemp(prefix="gw-sqlite-template-"))
            atexit.register(shutil.rmtree, folder, True)
            path = folder / "template.db"
            # On a thread of its own: the caller may be a test's running event loop.
            with ThreadPoolExecutor(1) as thread:
                thread.submit(asyncio.run, _migrated(f"sqlite:///{path}")).result()
            _sqlite_template = (path, os.getpid())
        return _sqlite_template[0]


async def _migrated(url: str) -> None:
    engine = Database(url).engine
    try:
        await migrate(engine)
    finally:
        await engine.dispose()  # the last connection checkpoints the WAL into the file: one file to copy


# --- PostgreSQL ---------------------------------------------------------------------------------------------


_reached = False


def postgres_or_skip() -> None:
    """Skip, saying why, where this machine has no PostgreSQL; in CI, fail instead of skipping."""
    global _reached
    if _reached:
        return
    try:
        asyncio.run(_pg_ping())
        _reached = True
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        message = f"PostgreSQL is not reachable at {PG_ADMIN_URL} ({exc}); start it to run this test"
        if os.environ.get("CI"):
            pytest.fail(message + " (CI must run every PostgreSQL test)")
        pytest.skip(message)


async def _pg_ping() -> None:
    conn = await asyncpg.connect(PG_ADMIN_URL, timeout=5)
    await conn.close()


async def pg_admin(sql: str, *args: Any) -> None:
    """Run one statement on the admin database (``PG_ADMIN_URL``)."""
    conn = await asyncpg.connect(PG_ADMIN_URL, timeout=5)
    try:
        await conn.execute(sql, *args)
    finally:
        await conn.close()


def database_url(name: str) -> str:
    return f"{PG_ADMIN_URL.rsplit('/', 1)[0]}/{name}"


class _Pool:
    """This process's template database, copies of it made ahead, and the used ones dropped behind, by one
    thread with an event loop and an admin connection of its own."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.template = f"gw_template_{uuid.uuid4().hex[:12]}"
        self._ready: queue.Queue[str | BaseException] = queue.Queue()
        self._work: queue.Queue[tuple[str, str] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="test-databases", daemon=True)
        self._thread.start()
        for _ in range(AHEAD):
            self._work.put(("copy", ""))

    def take(self) -> str:
        """A copy of the template that no test has used; the next one is made at once."""
        got = self._ready.get(timeout=120)
        if isinstance(got, BaseException):
            raise RuntimeError("the tests' template database could not be made") from got
        self._work.put(("copy", ""))
        return got

    def give_back(self, name: str) -> None:
        """Drop ``name`` behind the test's back (its connections are ended: ``WITH (FORCE)``)."""
        self._work.put(("drop", name))

    def close(self) -> None:
        """Drop every copy made and not taken, every copy given back, and the template; wait for it."""
        self._work.put(None)
        self._thread.join(timeout=300)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve())
        finally:
            loop.close()

    async def _serve(self) -> None:
        conn = await asyncpg.connect(PG_ADMIN_URL, timeout=10)
        try:
            try:
                await _make_template(conn, self.template)
            except BaseException as exc:
                for _ in range(AHEAD + 64):
                    self._ready.put(exc)
                raise
            while (job := self._work.get()) is not None:  # this thread's loop has nothing else to run
                kind, name = job
                if kind == "copy":
                    made = f"gw_test_{uuid.uuid4().hex[:12]}"
                    await conn.execute(f'CREATE DATABASE "{made}" TEMPLATE "{self.template}"')
                    self._ready.put(made)
                else:
                    await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            # Closing: what was made ahead and never taken, then the template.
            while not self._ready.empty():
                left = self._ready.get_nowait()
                if isinstance(left, str):
                    await conn.execute(f'DROP DATABASE IF EXISTS "{left}" WITH (FORCE)')
            await conn.execute(f'DROP DATABASE IF EXISTS "{self.template}" WITH (FORCE)')
        finally:
            await conn.close()


async def _make_template(conn: Any, name: str) -> None:
    await conn.execute(f'CREATE DATABASE "{name}"')
    try:
        engine = Database(database_url(name)).engine
        try:
            await migrate(engine)
        finally:
            await engine.dispose()
        # CREATE DATABASE ... TEMPLATE refuses a template anyone is connected to: from now on nobody can be.
        await conn.execute(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
    except BaseException:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        raise


_pool: _Pool | None = None
_pool_lock = threading.Lock()


def _the_pool() -> _Pool:
    """This process's pool, made on first use (a forked child makes its own: the parent's thread is not
    there, and the parent drops what it made)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool.pid != os.getpid():
            _pool = _Pool()
            atexit.register(close_postgres_databases)
        return _pool


def close_postgres_databases() -> None:
    """Drop every database this process made (idempotent; never raises): at the end of the session
    (tests/conftest.py), at exit otherwise."""
    global _pool
    with _pool_lock:
        made, _pool = _pool, None
    if made is None or made.pid != os.getpid():
        return
    try:
        made.close()
    except Exception as exc:  # a test session that ends must not fail on its clean-up
        print(f"tests: could not drop the test databases: {exc}", file=sys.stderr)


@contextmanager
def postgres_database(template: bool = True) -> Iterator[str]:
    """A new database on this machine's PostgreSQL, dropped afterwards; yields its URL.

    By default it is a copy of the process's template database, already at the newest revision (the
    gateway's migration at start finds nothing to do); ``template=False`` makes an empty one, for tests of
    the migrations themselves.
    """
    postgres_or_skip()
    if template and not _empty_only:
        pool = _the_pool()
        name = pool.take()
        try:
            yield database_url(name)
        finally:
            pool.give_back(name)
        return
    name = f"gw_test_{uuid.uuid4().hex[:12]}"
    asyncio.run(pg_admin(f'CREATE DATABASE "{name}"'))
    try:
        yield database_url(name)
    finally:
        asyncio.run(pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
