"""Batches, titles and live metadata (issue 34; protocol.md, Shapes and Batches): the task's own fields beside
its history.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06

New columns of ``tasks``, each with a default that describes a task stored before it: no title, no parent,
no metadata (``{}``), revision 0, no children (all counts 0), its children not moving its progress, no
worker or start time known (the history has them, but the task list shows them only from here on). A
parent's children are listed newest first by ``ix_tasks_parent``, a partial index of the tasks that have a
parent (none, for the tasks stored before).

A migration is frozen once released: it spells out its tables and columns with ``sqlalchemy`` and never
imports ``gateway.store.tables``, whose models describe the newest schema only.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | None = None
depends_on: str | None = None

_COUNTS = ("total", "queued", "running", "succeeded", "failed", "expired")


def upgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(sa.Column("title", sa.Text(), nullable=True))
        batch.add_column(sa.Column("parent", sa.String(128), nullable=True))
        batch.add_column(
            sa.Column("progress_from_children", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.add_column(sa.Column("metadata", sa.Text(), nullable=False, server_default="{}"))
        batch.add_column(sa.Column("revision", sa.BigInteger(), nullable=False, server_default="0"))
        for name in _COUNTS:
            batch.add_column(
                sa.Column(f"children_{name}", sa.BigInteger(), nullable=False, server_default="0")
            )
        batch.add_column(sa.Column("worker", sa.Text(), nullable=True))
        batch.add_column(sa.Column("started_at_ms", sa.BigInteger(), nullable=True))
    op.create_index(
        "ix_tasks_parent",
        "tasks",
        ["parent", "created_at_ms", "id"],
        sqlite_where=sa.text("parent IS NOT NULL"),
        postgresql_where=sa.text("parent IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_tasks_parent", table_name="tasks")
    with op.batch_alter_table("tasks") as batch:
        for name in ("started_at_ms", "worker", *(f"children_{n}" for n in reversed(_COUNTS))):
            batch.drop_column(name)
        for name in ("revision", "metadata", "progress_from_children", "parent", "title"):
            batch.drop_column(name)
