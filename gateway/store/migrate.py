"""Schema migrations: bring a database to the newest revision of ``gateway/store/migrations`` (Alembic).

:func:`migrate` runs at every start (``Database.open``) and as ``gateway migrate``. It works in one
transaction: it takes the migration lock, looks at the database, and stamps or upgrades it; a process that
fails half-way leaves the schema as it found it.

- An empty database is upgraded from scratch.
- A database that 0.1.0 made (tables created with ``create_all``, no ``alembic_version``) is stamped at
  revision ``0001``, which is exactly that schema, and then upgraded: its tasks, history and receipts stay.
- PostgreSQL: the transaction first takes a transaction-level advisory lock, so that N processes starting
  together migrate once; the others wait for it, then find the database at head and do nothing.
- SQLite: the transaction is begun with ``BEGIN IMMEDIATE``, which takes the file's write lock at once.
  (Python's sqlite3 otherwise runs DDL outside any transaction, so that a crash could leave half a
  schema.) A second gateway on the file is refused by the lock file anyway; this covers ``gateway
  migrate`` run next to a serving gateway.

A new revision: change ``gateway/store/tables.py``, then write ``versions/NNNN_<what>.py`` from
``script.py.mako`` (``alembic.command.revision(alembic_config(conn), message, autogenerate=True,
rev_id="NNNN")`` on a connection to a database at head drafts it; ruff formats it), spelling out its tables
with plain ``sqlalchemy``; tests/integration/test_migrations.py checks that the migrated schema equals the
models.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import weakref
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

MIGRATIONS_DIR = Path(__file__).parent / "migrations"

# The revision that is exactly the schema 0.1.0 created without Alembic.
BASELINE = "0001"

# Any fixed 64-bit number; the same key 0.1.0 held around its create_all, so that a 0.1.0 process and a
# newer one starting together on a database also take turns.
MIGRATION_LOCK_KEY = 0x7461736B67617465


log = logging.getLogger("gateway.store")


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic's configuration, built in code (no alembic.ini); ``connection`` is the one env.py runs on."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@functools.cache
def head_revision() -> str:
    """The newest revision this gateway knows (read once a process: Alembic parses every revision's module
    to find it, and they do not change while the process runs)."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no revision in {MIGRATIONS_DIR / 'versions'}")
    return head


async def migrate(engine: AsyncEngine) -> None:
    """Upgrade the database to head, once, whoever else is starting on it at the same time."""
    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
        elif conn.dialect.name == "sqlite":
            await conn.exec_driver_sql("BEGIN IMMEDIATE")
        # Alembic reaches its running migration through module globals (``alembic.context``, ``alembic.op``),
        # and run_sync lets other tasks of this event loop run whenever the database is awaited: two
        # migrations interleaved in one process (two gateways on two databases) would run each other's
        # operations. So, in a process, one runs at a time; taken after the database's lock, it never waits
        # for a migration that is itself waiting for that lock.
        async with _in_process_lock():
            await conn.run_sync(_upgrade)


async def current_revision(engine: AsyncEngine) -> str | None:
    """The revision the database is at (``None``: not under migrations yet)."""
    async with engine.connect() as conn:
        return await conn.run_sync(lambda sync: MigrationContext.configure(sync).get_current_revision())


_locks: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()


def _in_process_lock() -> asyncio.Lock:
    """This event loop's migration lock (an asyncio lock belongs to one loop; tests run many)."""
    loop = asyncio.get_running_loop()
    lock = _locks.get(loop)
    if lock is None:
        lock = _locks[loop] = asyncio.Lock()
    return lock


def _upgrade(conn: Connection) -> None:
    # Alembic's own lines ("Context impl ...") are noise at every start; one line says what changed.
    logging.getLogger("alembic.runtime.migration").setLevel(logging.WARNING)
    config = alembic_config(conn)
    schema = inspect(conn)
    before: str | None = None
    if schema.has_table("alembic_version"):
        before = MigrationContext.configure(conn).get_current_revision()
    elif schema.has_table("tasks"):
        command.stamp(config, BASELINE)
        before = f"{BASELINE} (a 0.1.0 database)"
    head = head_revision()
    if before == head:
        return  # the usual start: nothing to do, nothing to say
    command.upgrade(config, "head")
    log.info("database schema migrated from %s to %s", before or "nothing", head)
