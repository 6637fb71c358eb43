"""PostgreSQL: autovacuum vacuums the gateway's churning tables once 2% of their rows are dead (its default
is 20%), so that retention's deletes are reused before new rows go to new pages: the tables stay within
about 1.15x their size under steady churn instead of 1.25x (docs/deploy.md, Retention). SQLite: nothing.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01

A storage parameter of each table (``ALTER TABLE ... SET``), not a server setting: it needs no superuser
and travels with the tables. An operator may set another value afterwards; a later migration does not
undo it.

A migration is frozen once released: it spells out its tables and columns with ``sqlalchemy`` and never
imports ``gateway.store.tables``, whose models describe the newest schema only.
"""

from __future__ import annotations

from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None

# The tables retention deletes from, and the drain's kept batches (deleted after 24 h).
_CHURNING = ("tasks", "entries", "callbacks", "outbox", "deliveries", "drain_batches")
SCALE_FACTOR = 0.02


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in _CHURNING:
        op.execute(f"ALTER TABLE {table} SET (autovacuum_vacuum_scale_factor = {SCALE_FACTOR})")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    for table in _CHURNING:
        op.execute(f"ALTER TABLE {table} RESET (autovacuum_vacuum_scale_factor)")
