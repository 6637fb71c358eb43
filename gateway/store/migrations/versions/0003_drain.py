"""The batches of drains made with an ``Idempotency-Key``: the answer sent, kept 24 hours so that the
same key answers it again.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

A new, empty table: nothing to move. Drains without a key (all a gateway before this revision made)
keep nothing.

A migration is frozen once released: it spells out its tables and columns with ``sqlalchemy`` and never
imports ``gateway.store.tables``, whose models describe the newest schema only.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "drain_batches",
        sa.Column("idempotency_key", sa.String(256), primary_key=True),
        sa.Column("made_at_ms", sa.BigInteger(), nullable=False),
        sa.Column("more", sa.Boolean(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
    )
    op.create_index("ix_drain_batches_made_at", "drain_batches", ["made_at_ms"])


def downgrade() -> None:
    op.drop_index("ix_drain_batches_made_at", table_name="drain_batches")
    op.drop_table("drain_batches")
