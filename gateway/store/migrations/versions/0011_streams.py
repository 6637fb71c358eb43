"""Streams: a task's output (protocol.md, Streams), one row of running totals per stream and one row per
appended batch.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-20

Two new, empty tables: tasks already stored have no stream. ``stream_batches`` keeps a batch's chunks
together (the JSON array the wire carries) under the key ``(task_id, stream, first_offset)``: on SQLite its
rows live in that key's tree (WITHOUT ROWID). Both lose rows all day (retention; an attempt's first append
drops the earlier attempt's batches): on PostgreSQL they get the autovacuum setting of the other tables
retention deletes from (revision 0006).

A migration is frozen once released: it spells out its tables and columns with ``sqlalchemy`` and never
imports ``gateway.store.tables``, whose models describe the newest schema only.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | None = None
depends_on: str | None = None

SCALE_FACTOR = 0.02


def upgrade() -> None:
    op.create_table(
        "streams",
        sa.Column("task_id", sa.String(128), nullable=False),
        sa.Column("name", sa.String(32), nullable=False),
        sa.Column("attempt", sa.BigInteger(), nullable=False),
        sa.Column("first_offset", sa.BigInteger(), nullable=False),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.Column("text_bytes", sa.BigInteger(), nullable=False),
        sa.Column("next_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_offset", sa.BigInteger(), nullable=False),
        sa.Column("last_digest", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("task_id", "name"),
    )
    op.create_table(
        "stream_batches",
        sa.Column("task_id", sa.String(128), nullable=False),
        sa.Column("stream", sa.String(32), nullable=False),
        sa.Column("first_offset", sa.BigInteger(), nullable=False, autoincrement=False),
        sa.Column("attempt", sa.BigInteger(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("chunk_bytes", sa.Integer(), nullable=False),
        sa.Column("digest", sa.LargeBinary(), nullable=False),
        sa.Column("chunks", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("task_id", "stream", "first_offset"),
        sqlite_with_rowid=False,
    )
    if op.get_bind().dialect.name == "postgresql":
        for table in ("streams", "stream_batches"):
            op.execute(f"ALTER TABLE {table} SET (autovacuum_vacuum_scale_factor = {SCALE_FACTOR})")


def downgrade() -> None:
    op.drop_table("stream_batches")
    op.drop_table("streams")
