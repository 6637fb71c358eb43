"""Tags: each task's tags on its row (read back with it), and the table that finds a tag's tasks.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02

``tasks.tags`` holds a task's tags sorted and joined by one space (a tag has no space), ``''`` for none:
every read of a task (a callback's locked read among them) gets its tags from the row it reads anyway.
``task_tags`` holds one row per tag of a task, with the task's ``created_at_ms``: ``ix_task_tags_tag``
answers "this tag's tasks, newest first" (read backwards) and "created since" in one index range, and the
primary key, led by the task id, finds a task's rows when retention deletes it. Tags are fixed at creation:
no update touches either.

Tasks already stored have no tags (``''``, no ``task_tags`` row). On PostgreSQL ``task_tags`` gets the
autovacuum setting of the other tables retention deletes from (revision 0006).

A migration is frozen once released: it spells out its tables and columns with ``sqlalchemy`` and never
imports ``gateway.store.tables``, whose models describe the newest schema only.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None

SCALE_FACTOR = 0.02


def upgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(sa.Column("tags", sa.Text(), nullable=False, server_default=""))
    op.create_table(
        "task_tags",
        sa.Column("task_id", sa.String(128), nullable=False),
        sa.Column("tag", sa.String(128), nullable=False),
        sa.Column("created_at_ms", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("task_id", "tag"),
    )
    op.create_index("ix_task_tags_tag", "task_tags", ["tag", "created_at_ms", "task_id"])
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE task_tags SET (autovacuum_vacuum_scale_factor = {SCALE_FACTOR})")


def downgrade() -> None:
    op.drop_index("ix_task_tags_tag", table_name="task_tags")
    op.drop_table("task_tags")
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("tags")
