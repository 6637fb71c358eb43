"""The schema of 0.1.0: tasks, their history, callback ids, the outbox and delivery receipts.

Revision ID: 0001
Revises:
Create Date: 2026-11-30

A database that 0.1.0 made (with ``create_all``, before Alembic) has exactly these tables and no
``alembic_version``; ``gateway.store.migrate`` stamps it at this revision instead of running it.

A migration is frozen once released: it spells out its tables and columns with ``sqlalchemy`` and never
imports ``gateway.store.tables``, whose models describe the newest schema only.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

_LIVE = "state IN ('queued', 'running')"
_PENDING = "drained_at_ms IS NULL"


def upgrade() -> None:
    op.create_table(
        "tasks",
        sa.Column("id", sa.String(128), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("expires_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("attempts", sa.BigInteger(), nullable=False),
        sa.Column("max_attempts", sa.BigInteger(), nullable=False),
        sa.Column("progress", sa.Integer(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("result_ref", sa.Text()),
        sa.Column("result_hash", sa.Text()),
        sa.Column("error", sa.Text()),
        sa.Column("ttl_ms", sa.BigInteger(), nullable=False),
        sa.Column("created_at_ms", sa.BigInteger(), nullable=False),
    )
    # The sweeper's question: which live tasks are past their deadline?
    op.create_index(
        "ix_tasks_live_deadline",
        "tasks",
        ["expires_at_ms"],
        sqlite_where=sa.text(_LIVE),
        postgresql_where=sa.text(_LIVE),
    )
    op.create_table(
        "entries",
        sa.Column("task_id", sa.String(128), primary_key=True),
        sa.Column("version", sa.BigInteger(), primary_key=True, autoincrement=False),
        sa.Column("type", sa.String(16), nullable=False),
        sa.Column("at_ms", sa.BigInteger(), nullable=False),
        sa.Column("event", sa.LargeBinary(), nullable=False),
    )
    op.create_table(
        "callbacks",
        sa.Column("callback_id", sa.String(256), primary_key=True),
        sa.Column("task_id", sa.String(128), nullable=False),
        sa.Column("at_ms", sa.BigInteger(), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
    )
    op.create_table(
        "outbox",
        # BIGSERIAL on PostgreSQL; on SQLite an INTEGER PRIMARY KEY, the rowid that numbers itself.
        sa.Column(
            "id",
            sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
            primary_key=True,
            autoincrement=True,
        ),
        sa.Column("task_id", sa.String(128), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("at_ms", sa.BigInteger(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("drained_at_ms", sa.BigInteger()),
    )
    op.create_index("ux_outbox_key", "outbox", ["task_id", "state", "version"], unique=True)
    op.create_index(
        "ix_outbox_pending",
        "outbox",
        ["id"],
        sqlite_where=sa.text(_PENDING),
        postgresql_where=sa.text(_PENDING),
    )
    op.create_table(
        "deliveries",
        sa.Column("idempotency_key", sa.String(256), primary_key=True),
        sa.Column("task_id", sa.String(128), nullable=False),
        sa.Column("result_ref", sa.Text(), nullable=False),
        sa.Column("result_hash", sa.Text(), nullable=False),
        sa.Column("delivered_at_ms", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("deliveries")
    op.drop_index("ix_outbox_pending", table_name="outbox")
    op.drop_index("ux_outbox_key", table_name="outbox")
    op.drop_table("outbox")
    op.drop_table("callbacks")
    op.drop_table("entries")
    op.drop_index("ix_tasks_live_deadline", table_name="tasks")
    op.drop_table("tasks")
