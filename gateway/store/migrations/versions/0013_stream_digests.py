"""Streams without digests (issue 33, Performance: bytes on disk per chunk): a retried append is told from a
reused ``seq`` by the chunks stored under it, read on the retry path alone, not by a digest kept in every
batch's row and in its stream's.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-07

``stream_batches`` loses ``digest`` and ``streams`` loses ``last_digest``; every row is kept. Both tables are
made again and their rows copied, on both databases: on PostgreSQL, a column dropped in place stays in the
rows stored before and makes every row stored after carry a null bitmap (8 bytes more a row, once aligned);
on SQLite, a table is altered by copying it anyway, and ``streams`` joins ``stream_batches`` in living in
its primary key's tree (WITHOUT ROWID: no second tree holds the key again). The copy takes as long as the
streams the database holds (no more than retention keeps). On PostgreSQL the new tables get the autovacuum
setting of the other tables retention deletes from (revision 0006).

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

SCALE_FACTOR = 0.02
_KEYS = {"streams": ("task_id", "name"), "stream_batches": ("task_id", "stream", "first_offset")}


def _streams(digest: bool) -> list[sa.Column[Any]]:
    return [
        sa.Column("task_id", sa.String(128), nullable=False),
        sa.Column("name", sa.String(32), nullable=False),
        sa.Column("attempt", sa.BigInteger(), nullable=False),
        sa.Column("first_offset", sa.BigInteger(), nullable=False),
        sa.Column("next_offset", sa.BigInteger(), nullable=False),
        sa.Column("text_bytes", sa.BigInteger(), nullable=False),
        sa.Column("next_seq", sa.BigInteger(), nullable=False),
        sa.Column("last_offset", sa.BigInteger(), nullable=False),
        *([sa.Column("last_digest", sa.LargeBinary(), nullable=False)] if digest else []),
    ]


def _stream_batches(digest: bool) -> list[sa.Column[Any]]:
    return [
        sa.Column("task_id", sa.String(128), nullable=False),
        sa.Column("stream", sa.String(32), nullable=False),
        sa.Column("first_offset", sa.BigInteger(), nullable=False, autoincrement=False),
        sa.Column("attempt", sa.BigInteger(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        sa.Column("chunk_bytes", sa.Integer(), nullable=False),
        *([sa.Column("digest", sa.LargeBinary(), nullable=False)] if digest else []),
        sa.Column("chunks", sa.LargeBinary(), nullable=False),
    ]


def _made_again(table: str, columns: list[sa.Column[Any]], *, with_rowid: bool, fill: str) -> None:
    """``table`` made again with ``columns`` under its key, its rows copied (``fill``: the ``SELECT`` list
    of the old table in the order of ``columns``; ``:empty``, an empty blob), the old table dropped."""
    old = f"{table}_0013"
    op.rename_table(table, old)
    if op.get_bind().dialect.name == "postgresql":
        # The key's index keeps its name through the rename: the new table's takes it.
        op.execute(f"ALTER INDEX {table}_pkey RENAME TO {old}_pkey")
    op.create_table(table, *columns, sa.PrimaryKeyConstraint(*_KEYS[table]), sqlite_with_rowid=with_rowid)
    names = ", ".join(column.name for column in columns)
    copy = sa.text(f"INSERT INTO {table} ({names}) SELECT {fill} FROM {old}")
    if ":empty" in fill:
        copy = copy.bindparams(sa.bindparam("empty", b"", type_=sa.LargeBinary()))
    op.execute(copy)
    op.drop_table(old)
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"ALTER TABLE {table} SET (autovacuum_vacuum_scale_factor = {SCALE_FACTOR})")


def upgrade() -> None:
    for table, columns in (("streams", _streams(False)), ("stream_batches", _stream_batches(False))):
        _made_again(table, columns, with_rowid=False, fill=", ".join(column.name for column in columns))


def downgrade() -> None:
    # The digests again (revision 0011's: blake2b of the stored array, 16 bytes), computed here: first as
    # empty values, then set row by row.
    _made_again(
        "streams",
        _streams(True),
        with_rowid=True,
        fill=", ".join(column.name for column in _streams(False)) + ", :empty",
    )
    batches = _stream_batches(True)
    _made_again(
        "stream_batches",
        batches,
        with_rowid=False,
        fill=", ".join(":empty" if column.name == "digest" else column.name for column in batches),
    )
    bind = op.get_bind()
    rows = bind.execute(sa.text("SELECT task_id, stream, first_offset, chunks FROM stream_batches")).all()
    digests = [
        {"t": t, "s": s, "o": o, "d": hashlib.blake2b(bytes(chunks), digest_size=16).digest()}
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
