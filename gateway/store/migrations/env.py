"""Alembic's environment: runs the migrations on the connection that ``gateway.store.migrate`` hands over.

There is no ``alembic.ini`` and no URL here: :func:`gateway.store.migrate.alembic_config` builds the
configuration in code and puts a live connection, already inside the transaction that holds the migration
lock, in ``config.attributes["connection"]`` (Alembic's "sharing a connection" recipe). The migrations run
in that transaction and commit with it.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy.engine import Connection
from sqlmodel import SQLModel

from gateway.store import tables  # noqa: F401  (registers the tables on SQLModel.metadata)

# What ``alembic revision --autogenerate`` compares the database with.
target_metadata = SQLModel.metadata


def run_migrations(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite alters a table by copying it ("batch" mode); the other databases alter it in place.
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def _connection() -> Connection:
    connection = context.config.attributes.get("connection")
    if context.is_offline_mode() or not isinstance(connection, Connection):
        raise RuntimeError(
            "the gateway's migrations run on a live connection: use `gateway migrate` or "
            "gateway.store.migrate.migrate(engine), not the alembic command with an alembic.ini"
        )
    return connection


run_migrations(_connection())
