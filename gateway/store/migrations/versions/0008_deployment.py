"""The ``deployment`` table: what a deployment knows of itself, by name. Its row ``id`` (a random id, made
by the first gateway that starts on the database, not here) names the deployment's own Redis channel, so
that deployments sharing one Redis never hear each other's entries.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02

The id is made at the first start rather than by this migration, so that a database copied from one that
was migrated but never served (``CREATE DATABASE ... TEMPLATE``) still gets an id of its own.

A migration is frozen once released: it spells out its tables and columns with ``sqlalchemy`` and never
imports ``gateway.store.tables``, whose models describe the newest schema only.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "deployment",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.Text(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("deployment")
