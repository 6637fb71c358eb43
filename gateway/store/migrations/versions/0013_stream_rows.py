"""Smaller stream rows (issue 33, Performance: bytes on disk per chunk): no digest, no seq in a batch's row.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07

A retried append is told from a reused ``seq`` by the chunks stored under it, read on the retry path alone,
not by a digest kept in every batch's row and in its stream's: ``stream_batches`` loses ``digest`` and
``streams`` loses ``last_digest``. A stream keeps its attempt's batches alone, every one of them, so a
batch's seq is its place among them: ``stream_batches`` loses ``seq`` too. Every row is kept. The columns
dropped came with revisions 0011 and 0012, after 0.1.0: no release reads or writes them, so a release's
processes still serve beside the next one's during a rolling restart (docs/deploy.md, Upgrades).

Both tables are made again and their rows copied, on both databases: on PostgreSQL, a column dropped in
place stays in the rows stored before and makes every row stored after carry a null bitmap (8 bytes more a
row, once aligned); on SQLite, a table is altered by copying it anyway, and ``streams`` joins
``stream_batches`` in living in its primary key's tree (WITHOUT ROWID: no second tree holds the key again).
The copy takes as long as the streams the database holds (no more than retention keeps). On PostgreSQL the
new tables get the old ones' storage settings (revision 0011's autovacuum setting, or the operator's:
docs/deploy.md, Retention).

A migration is frozen once released: it spells out its tables and columns with ``sqlalchemy`` and never
imports ``gateway.store.tables``, whose models describe the newest schema only.
"""

from __future__ import annotations

import hashlib
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | None = None
depends_on: str | None = None

_KEYS = {"streams": ("task_id", "name"), "stream_batches": ("task_id", "stream", "first_offset")}
# Revision 0011's digest: blake2b of the stored array, 16 bytes (a downgrade makes them again).
_DIGEST_BYTES = 16


def _streams(before: bool) -> list[sa.Column[Any]]:
    """The columns of ``streams`` from this revision on (``before``: revisions 0011 and 0012's)."""
    return [
        sa.Column("task_id", sa.String(128), nullable=False),
        sa.Column("name", sa.String(32), nullable=False),
        sa.Column("attempt", sa.BigInteger(), nullable=False),
        sa.Column("first_offset", sa.BigInteger(), nullable=False),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.Column("text_bytes", sa.BigInteger(), nullable=False),
        sa.Column("next_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_offset", sa.BigInteger(), nullable=False),
        *([sa.Column("last_digest", sa.LargeBinary(), nullable=False)] if before else []),
    ]


def _stream_batches(before: bool) -> list[sa.Column[Any]]:
    """The columns of ``stream_batches`` from this revision on (``before``: revisions 0011 and 0012's)."""
    return [
        sa.Column("task_id", sa.String(128), nullable=False),
        sa.Column("stream", sa.String(32), nullable=False),
        sa.Column("first_offset", sa.BigInteger(), nullable=False, autoincrement=False),
        sa.Column("attempt", sa.BigInteger(), nullable=False),
        *([sa.Column("seq", sa.BigInteger(), nullable=False)] if before else []),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("chunk_bytes", sa.Integer(), nullable=False),
        *([sa.Column("digest", sa.LargeBinary(), nullable=False)] if before else []),
        sa.Column("chunks", sa.LargeBinary(), nullable=False),
    ]


def _made_again(table: str, columns: list[sa.Column[Any]], *, with_rowid: bool, fill: dict[str, str]) -> None:
    """``table`` made again with ``columns`` under its key, its rows copied (each column from the old
    table's of its name, or from the expression ``fill`` gives it; ``:empty`` is an empty blob), the old
    table dropped."""
    old = f"{table}_0013"
    bind = op.get_bind()
    postgresql = bind.dialect.name == "postgresql"
    options: list[str] = []
    if postgresql:  # its storage settings, as ["autovacuum_vacuum_scale_factor=0.02"]
        found = bind.execute(
            sa.text("SELECT reloptions FROM pg_class WHERE oid = CAST(CAST(:t AS text) AS regclass)"),
            {"t": table},
        )
        options = list(found.scalar() or [])
    op.rename_table(table, old)
    if postgresql:
        # The key's index keeps its name through the rename: the new table's takes it.
        op.execute(f"ALTER INDEX {table}_pkey RENAME TO {old}_pkey")
    op.create_table(table, *columns, sa.PrimaryKeyConstraint(*_KEYS[table]), sqlite_with_rowid=with_rowid)
    names = [column.name for column in columns]
    selected = ", ".join(fill.get(name, name) for name in names)
    copy = sa.text(f"INSERT INTO {table} ({', '.join(names)}) SELECT {selected} FROM {old}")
    if ":empty" in selected:
        copy = copy.bindparams(sa.bindparam("empty", b"", type_=sa.LargeBinary()))
    op.execute(copy)
    op.drop_table(old)
    if options:
        op.execute(f"ALTER TABLE {table} SET ({', '.join(options)})")


def upgrade() -> None:
    _made_again("streams", _streams(False), with_rowid=False, fill={})
    _made_again("stream_batches", _stream_batches(False), with_rowid=False, fill={})


def downgrade() -> None:
    # A batch's seq is its place among its stream's batches; the digests are made again below, row by row.
    _made_again("streams", _streams(True), with_rowid=True, fill={"last_digest": ":empty"})
    seq = "ROW_NUMBER() OVER (PARTITION BY task_id, stream ORDER BY first_offset) - 1"
    _made_again(
        "stream_batches", _stream_batches(True), with_rowid=False, fill={"seq": seq, "digest": ":empty"}
    )
    bind = op.get_bind()
    rows = bind.execute(sa.text("SELECT task_id, stream, first_offset, chunks FROM stream_batches")).all()
    digests = [
        {"t": t, "s": s, "o": o, "d": hashlib.blake2b(bytes(chunks), digest_size=_DIGEST_BYTES).digest()}
        for t, s, o, chunks in rows
    ]
    if digests:
        bind.execute(
            sa.text(
                "UPDATE stream_batches SET digest = :d "
                "WHERE task_id = :t AND stream = :s AND first_offset = :o"
            ),
            digests,
        )
        bind.execute(
            sa.text(
                "UPDATE streams SET last_digest = :d WHERE task_id = :t AND name = :s AND last_offset = :o"
            ),
            digests,
        )
