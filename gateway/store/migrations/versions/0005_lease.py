"""Heartbeat leases on the tasks: the lease a task asked for at create, and the end of its running
attempt's lease, with the partial index the sweeper finds ended leases by.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01

Tasks already stored have no lease (both columns NULL), as before.

A migration is frozen once released: it spells out its tables and columns with ``sqlalchemy`` and never
imports ``gateway.store.tables``, whose models describe the newest schema only.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None

_LEASED = "state = 'running' AND lease_until_ms IS NOT NULL"


def upgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(sa.Column("heartbeat_ms", sa.BigInteger()))
        batch.add_column(sa.Column("lease_until_ms", sa.BigInteger()))
    op.create_index(
        "ix_tasks_lease_end",
        "tasks",
        ["lease_until_ms"],
        sqlite_where=sa.text(_LEASED),
        postgresql_where=sa.text(_LEASED),
    )


def downgrade() -> None:
    op.drop_index("ix_tasks_lease_end", table_name="tasks")
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("lease_until_ms")
        batch.drop_column("heartbeat_ms")
