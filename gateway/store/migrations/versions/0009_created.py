"""The tasks by creation time, for the task list newest first (``GET /v1/tasks?order=newest``): an index
on ``(created_at_ms, id)``.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02

An index only: no row changes. Every task has had its ``created_at_ms`` since revision 0001.

A migration is frozen once released: it spells out its tables and columns with ``sqlalchemy`` and never
imports ``gateway.store.tables``, whose models describe the newest schema only.
"""

from __future__ import annotations

from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_index("ix_tasks_created", "tasks", ["created_at_ms", "id"])


def downgrade() -> None:
    op.drop_index("ix_tasks_created", table_name="tasks")
