"""Retention: when each task finished, and the indexes that find a task's rows to delete them with it.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-14

``tasks.finished_at_ms`` is written with the transition that makes a task terminal. Tasks that finished
before this revision get the time of their terminal notification (the same time the gateway writes now),
or of their last history entry where the notification is gone: retention applies to them too, from the
first pass after the upgrade (an upgrade of a large database deletes its old finished tasks batch by batch,
see docs/deploy.md).

A migration is frozen once released: it spells out its tables and columns with ``sqlalchemy`` and never
imports ``gateway.store.tables``, whose models describe the newest schema only.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None

_FINISHED = "finished_at_ms IS NOT NULL"


def upgrade() -> None:
    op.add_column("tasks", sa.Column("finished_at_ms", sa.BigInteger()))
    op.execute(
        "UPDATE tasks SET finished_at_ms = COALESCE("
        "(SELECT max(at_ms) FROM outbox WHERE outbox.task_id = tasks.id), "
        "(SELECT max(at_ms) FROM entries WHERE entries.task_id = tasks.id), "
        "created_at_ms) "
        "WHERE state IN ('succeeded', 'failed', 'expired')"
    )
    op.create_index(
        "ix_tasks_finished",
        "tasks",
        ["finished_at_ms", "id"],
        sqlite_where=sa.text(_FINISHED),
        postgresql_where=sa.text(_FINISHED),
    )
    op.create_index("ix_callbacks_task", "callbacks", ["task_id"])
    op.create_index("ix_deliveries_task", "deliveries", ["task_id"])
    if op.get_bind().dialect.name == "sqlite":
        # Notifications are deleted now, and SQLite gives a deleted greatest rowid to the next row: a relay
        # still sending the deleted one would mark the new one sent. AUTOINCREMENT never reuses an id
        # (PostgreSQL's sequence never does). The table is rebuilt with its rows and indexes.
        with op.batch_alter_table("outbox", recreate="always", table_kwargs={"sqlite_autoincrement": True}):
            pass


def downgrade() -> None:
    op.drop_index("ix_deliveries_task", table_name="deliveries")
    op.drop_index("ix_callbacks_task", table_name="callbacks")
    op.drop_index("ix_tasks_finished", table_name="tasks")
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("finished_at_ms")
