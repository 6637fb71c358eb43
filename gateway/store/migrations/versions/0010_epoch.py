"""Epochs: which history of its id each task is, so that a cursor of a deleted task never resumes into a
task made again under its id (protocol.md, Resuming).

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-06

``tasks.epoch`` is made at random when a task is created (12 hex digits) and never changed. Tasks already
stored get one of their own here, the same kind: each is a history that a later task of the same id must be
told apart from. The column's default ``''`` (no epoch) is only for a row written without one.

A migration is frozen once released: it spells out its tables and columns with ``sqlalchemy`` and never
imports ``gateway.store.tables``, whose models describe the newest schema only.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | None = None
depends_on: str | None = None

# 48 random bits as 12 hex digits, as the gateway makes them (``secrets.token_hex(6)``).
_RANDOM_EPOCH = {
    "sqlite": "lower(hex(randomblob(6)))",
    "postgresql": "substr(md5(random()::text || clock_timestamp()::text || id), 1, 12)",
}


def upgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(sa.Column("epoch", sa.String(32), nullable=False, server_default=""))
    op.execute(f"UPDATE tasks SET epoch = {_RANDOM_EPOCH[op.get_bind().dialect.name]}")


def downgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("epoch")
