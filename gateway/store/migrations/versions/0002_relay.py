"""The webhook relay's columns on the outbox: when a notification was relayed, how often it was tried,
and when it may be tried next.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30

Notifications already in the outbox are not relayed yet: once ``GATEWAY_NOTIFY_URL`` is set, the relay
sends them too (the drain and the relay each take every notification).

A migration is frozen once released: it spells out its tables and columns with ``sqlalchemy`` and never
imports ``gateway.store.tables``, whose models describe the newest schema only.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

_NOT_RELAYED = "relayed_at_ms IS NULL"


def upgrade() -> None:
    with op.batch_alter_table("outbox") as batch:
        batch.add_column(sa.Column("relayed_at_ms", sa.BigInteger()))
        batch.add_column(sa.Column("relay_attempts", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("relay_next_at_ms", sa.BigInteger(), nullable=False, server_default="0"))
    op.create_index(
        "ix_outbox_relay_due",
        "outbox",
        ["relay_next_at_ms", "id"],
        sqlite_where=sa.text(_NOT_RELAYED),
        postgresql_where=sa.text(_NOT_RELAYED),
    )


def downgrade() -> None:
    op.drop_index("ix_outbox_relay_due", table_name="outbox")
    with op.batch_alter_table("outbox") as batch:
        batch.drop_column("relay_next_at_ms")
        batch.drop_column("relay_attempts")
        batch.drop_column("relayed_at_ms")
