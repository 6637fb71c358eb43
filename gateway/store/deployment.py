"""The deployment's identity: a random id kept in its database, the same for every process that serves it.

The first gateway that starts on a database makes the id (``deployment`` row ``id``); every later start,
on any host, reads it. Processes starting together on a new database make one id between them: the one
that finds none makes it under the migration lock (PostgreSQL's advisory lock; SQLite's write lock), and
the others wait for that lock and then read it. It is made at the first start rather than by a migration,
so that a copy of a database that was migrated but never served gets an id of its own.

It names the deployment's Redis channel (``gateway.bus``): two deployments on one Redis never hear each
other's entries, whatever URLs they are given (Redis pub/sub ignores the database number).
"""

from __future__ import annotations

import secrets

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from gateway.store.migrate import MIGRATION_LOCK_KEY
from gateway.store.queries import DEPLOYMENT_FACT, INSERT_DEPLOYMENT_FACT, numbered

ID = "id"


async def deployment_id(engine: AsyncEngine) -> str:
    """The deployment's id, made now if this is the first start on the database (which must be migrated)."""
    async with engine.connect() as conn:
        found = await _read(conn)
    if found is not None:  # every start but the first
        return found
    async with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
        else:
            await conn.exec_driver_sql("BEGIN IMMEDIATE")
        found = await _read(conn)  # another process may have made it while this one waited for the lock
        if found is None:
            found = secrets.token_hex(16)
            await conn.exec_driver_sql(_sql(conn, INSERT_DEPLOYMENT_FACT), (ID, found))
        return found


async def _read(conn: AsyncConnection) -> str | None:
    value = (await conn.exec_driver_sql(_sql(conn, DEPLOYMENT_FACT), (ID,))).scalar()
    return None if value is None else str(value)


def _sql(conn: AsyncConnection, sql: str) -> str:
    return numbered(sql) if conn.dialect.name == "postgresql" else sql
