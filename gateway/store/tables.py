"""The database tables: how tasks, their history and the bookkeeping around them are stored.

These are table rows, not wire shapes (those live in ``gateway.web.wire`` and ``gateway.machine``).
History rows keep the event as the JSON text the wire carries, so an entry is encoded once, when it is
written, and can be sent as it was stored.
"""

from collections.abc import Sequence
from typing import Any

from sqlalchemy import BigInteger, Boolean, Column, Index, Integer, LargeBinary, String, Text, false, text
from sqlmodel import Field, SQLModel

from gateway.machine import CHILDREN_FIELDS, Task

NO_CHILDREN = (0, 0, 0, 0, 0, 0)

ACTIVE_STATES = ("queued", "running")
# The rows of running attempts that hold a lease: the predicate of the partial index ix_tasks_lease_end.
LEASED = "state = 'running' AND lease_until_ms IS NOT NULL"
# A task's children counts, one column each, in ``Task.children``'s order.
CHILDREN_COLUMNS = tuple(f"children_{name}" for name in CHILDREN_FIELDS)
# The columns of a ``tasks`` row that hold the machine's task, in the order ``task_from_row`` reads them (by
# position, which costs less than by name on every driver's rows). Those a task's life changes first (what
# an update may set: ``UPDATED_COLUMNS``), then those written once, at insert, and never updated
# (``INSERT_ONLY``): its tags (sorted, joined by one space, ``''`` for none; a tag has no whitespace), its
# creation time, its epoch, its title, its parent and whether its children move its progress. The task's
# ``ended_at_ms`` is the row's ``finished_at_ms``, which retention counts from.
UPDATED_COLUMNS = (
    "id",
    "state",
    "expires_at_ms",
    "attempts",
    "max_attempts",
    "progress",
    "version",
    "result_ref",
    "result_hash",
    "error",
    "metadata",
    "revision",
    *CHILDREN_COLUMNS,
    "worker",
    "started_at_ms",
    "finished_at_ms",
)
INSERT_ONLY = ("tags", "created_at_ms", "epoch", "title", "parent", "progress_from_children")
TASK_COLUMNS = (*UPDATED_COLUMNS, *INSERT_ONLY)
_END = len(TASK_COLUMNS)


def task_from_row(row: Sequence[Any]) -> Task:
    """The task in a row that starts with ``TASK_COLUMNS``: the one way a row becomes a task."""
    (
        task_id, state, expires, attempts, max_attempts, progress, version, result_ref, result_hash, error,
        metadata, revision, total, queued, running, succeeded, failed, expired, worker, started, ended,
        tags, created, epoch, title, parent, from_children,
    ) = row[:_END]  # fmt: skip
    return Task(
        task_id,
        state,
        expires,
        attempts,
        max_attempts,
        progress,
        version,
        result_ref,
        result_hash,
        error,
        tuple(tags.split(" ")) if tags else (),
        created,
        epoch,
        title,
        parent,
        bool(from_children),
        metadata,
        (total, queued, running, succeeded, failed, expired) if total else None,
        revision,
        worker,
        started,
        ended,
    )


def tags_text(tags: Sequence[str]) -> str:
    """A task's tags as its row's ``tags`` column holds them."""
    return " ".join(tags)


def task_values(task: Task) -> dict[str, Any]:
    """The machine's task as the values of its ``tasks`` row that its life changes, by column
    (``UPDATED_COLUMNS`` order)."""
    children = task.children or NO_CHILDREN
    return {
        "id": task.id,
        "state": task.state,
        "expires_at_ms": task.expires_at_ms,
        "attempts": task.attempts,
        "max_attempts": task.max_attempts,
        "progress": task.progress,
        "version": task.version,
        "result_ref": task.result_ref,
        "result_hash": task.result_hash,
        "error": task.error,
        "metadata": task.metadata,
        "revision": task.revision,
        **dict(zip(CHILDREN_COLUMNS, children, strict=True)),
        "worker": task.worker,
        "started_at_ms": task.started_at_ms,
        "finished_at_ms": task.ended_at_ms,
    }


def insert_only_values(task: Task) -> tuple[Any, ...]:
    """The values of ``INSERT_ONLY`` but the creation time, which the insert is given apart: its tags,
    epoch, title, parent and whether its children move its progress."""
    return (tags_text(task.tags), task.epoch, task.title, task.parent, task.progress_from_children)


def changed_values(before: Task | None, task: Task) -> dict[str, Any]:
    """The columns of ``task``'s row that differ from ``before`` (all but the id when the row was not read):
    what an update writes. A progress callback changes two, progress and version; none ever changes the
    columns written at insert."""
    values = task_values(task)
    del values["id"]
    if before is None:
        return values
    old = task_values(before)
    return {name: value for name, value in values.items() if old[name] != value}


class TaskRow(SQLModel, table=True):
    __tablename__ = "tasks"
    __table_args__ = (
        # The sweeper's question: which live tasks are past their deadline?
        Index(
            "ix_tasks_live_deadline",
            "expires_at_ms",
            sqlite_where=text("state IN ('queued', 'running')"),
            postgresql_where=text("state IN ('queued', 'running')"),
        ),
        # Retention's question: which tasks finished before the cutoff? (queries.FINISHED_DUE)
        Index(
            "ix_tasks_finished",
            "finished_at_ms",
            "id",
            sqlite_where=text("finished_at_ms IS NOT NULL"),
            postgresql_where=text("finished_at_ms IS NOT NULL"),
        ),
        # The task list newest first (queries.newest_tasks): one range, read backwards.
        Index("ix_tasks_created", "created_at_ms", "id"),
        # A parent's children newest first (queries.newest_tasks with a parent): one range, read backwards.
        Index(
            "ix_tasks_parent",
            "parent",
            "created_at_ms",
            "id",
            sqlite_where=text("parent IS NOT NULL"),
            postgresql_where=text("parent IS NOT NULL"),
        ),
        # The sweeper's other question: which running attempts' leases have ended?
        Index(
            "ix_tasks_lease_end",
            "lease_until_ms",
            sqlite_where=text(LEASED),
            postgresql_where=text(LEASED),
        ),
    )

    id: str = Field(sa_column=Column(String(128), primary_key=True))
    state: str = Field(sa_column=Column(String(16), nullable=False))
    expires_at_ms: int = Field(sa_column=Column(BigInteger, nullable=False))
    attempts: int = Field(sa_column=Column(BigInteger, nullable=False))
    max_attempts: int = Field(sa_column=Column(BigInteger, nullable=False))
    progress: int = Field(sa_column=Column(Integer, nullable=False))
    version: int = Field(sa_column=Column(BigInteger, nullable=False))
    result_ref: str | None = Field(default=None, sa_column=Column(Text))
    result_hash: str | None = Field(default=None, sa_column=Column(Text))
    error: str | None = Field(default=None, sa_column=Column(Text))
    # Fixed at creation (``INSERT_ONLY``): its tags, sorted, joined by one space (``''``: none), each also a
    # row of ``task_tags``; when it was created, by the gateway's clock; and its epoch (below).
    tags: str = Field(default="", sa_column=Column(Text, nullable=False, server_default=""))
    created_at_ms: int = Field(sa_column=Column(BigInteger, nullable=False))
    # Which history of the id this task is (``Task.epoch``): made at random at its creation, so that a task
    # made again under the id of a deleted one is told apart from it by the cursors of the old one.
    epoch: str = Field(default="", sa_column=Column(String(32), nullable=False, server_default=""))
    # What the task was created with, so that a repeated create can be told apart from a conflicting one.
    ttl_ms: int = Field(sa_column=Column(BigInteger, nullable=False))
    # When the task became terminal, by the gateway's clock (its terminal entry's time, the notification's
    # atMs), written with that transition; NULL while it lives. Retention counts from it.
    finished_at_ms: int | None = Field(default=None, sa_column=Column(BigInteger))
    # The heartbeat lease (gateway.lease): its length, asked for at create (NULL: none), and the end of the
    # running attempt's lease, renewed by its callbacks and heartbeats. The end is meaningful only while the
    # task is running: a start renews it, so a value left by an earlier attempt is never read.
    heartbeat_ms: int | None = Field(default=None, sa_column=Column(BigInteger))
    lease_until_ms: int | None = Field(default=None, sa_column=Column(BigInteger))
    # Beside the history (issue 34; protocol.md, Shapes). Fixed at creation: a title, the parent task's id
    # (``ix_tasks_parent`` lists a parent's children), whether the children move its progress.
    title: str | None = Field(default=None, sa_column=Column(Text))
    parent: str | None = Field(default=None, sa_column=Column(String(128)))
    progress_from_children: bool = Field(
        default=False, sa_column=Column(Boolean, nullable=False, server_default=false())
    )
    # Live: the metadata as compact JSON text, the revision counting its changes and the children's, and
    # the children counts by state, written in the transaction of each child's creation and change.
    metadata_: str = Field(
        default="{}", sa_column=Column("metadata", Text, nullable=False, server_default="{}")
    )
    revision: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, server_default="0"))
    children_total: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, server_default="0"))
    children_queued: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, server_default="0"))
    children_running: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, server_default="0"))
    children_succeeded: int = Field(
        default=0, sa_column=Column(BigInteger, nullable=False, server_default="0")
    )
    children_failed: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, server_default="0"))
    children_expired: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, server_default="0"))
    # The last start's worker and time (the task list's worker and duration, with finished_at_ms).
    worker: str | None = Field(default=None, sa_column=Column(Text))
    started_at_ms: int | None = Field(default=None, sa_column=Column(BigInteger))


class EntryRow(SQLModel, table=True):
    """One history entry, appended in the same transaction as the task change it records."""

    __tablename__ = "entries"

    task_id: str = Field(sa_column=Column(String(128), primary_key=True))
    version: int = Field(sa_column=Column(BigInteger, primary_key=True, autoincrement=False))
    type: str = Field(sa_column=Column(String(16), nullable=False))
    at_ms: int = Field(sa_column=Column(BigInteger, nullable=False))
    event: bytes = Field(sa_column=Column(LargeBinary, nullable=False))


class TaskTagRow(SQLModel, table=True):
    """One tag of a task, with the task's creation time: a tag's tasks are one range of ``ix_task_tags_tag``,
    newest first when read backwards. Written with the task, deleted with it (retention), never updated."""

    __tablename__ = "task_tags"
    # The primary key, led by the task id, finds a task's rows when retention deletes it.
    __table_args__ = (Index("ix_task_tags_tag", "tag", "created_at_ms", "task_id"),)

    task_id: str = Field(sa_column=Column(String(128), primary_key=True))
    tag: str = Field(sa_column=Column(String(128), primary_key=True))
    created_at_ms: int = Field(sa_column=Column(BigInteger, nullable=False))


class CallbackRow(SQLModel, table=True):
    """A callback id seen once. Ids are global (protocol.md, Callbacks); the digest is of the canonical
    body."""

    __tablename__ = "callbacks"
    # Retention deletes a task's callback ids with it.
    __table_args__ = (Index("ix_callbacks_task", "task_id"),)

    callback_id: str = Field(sa_column=Column(String(256), primary_key=True))
    task_id: str = Field(sa_column=Column(String(128), nullable=False))
    at_ms: int = Field(sa_column=Column(BigInteger, nullable=False))
    digest: str = Field(sa_column=Column(String(64), nullable=False))


class OutboxRow(SQLModel, table=True):
    """A notification of a terminal transition. Two consumers take it, each once and independently of the
    other: the drain route (``drained_at_ms``) and the webhook relay (``relayed_at_ms``, with its attempts
    and ``relay_next_at_ms``, the time before which no process may send it: a retry's backoff, or the lease
    of the process that is sending it now)."""

    __tablename__ = "outbox"
    __table_args__ = (
        Index("ux_outbox_key", "task_id", "state", "version", unique=True),
        Index(
            "ix_outbox_pending",
            "id",
            sqlite_where=text("drained_at_ms IS NULL"),
            postgresql_where=text("drained_at_ms IS NULL"),
        ),
        # The relay's question: which notifications not relayed yet are due now?
        Index(
            "ix_outbox_relay_due",
            "relay_next_at_ms",
            "id",
            sqlite_where=text("relayed_at_ms IS NULL"),
            postgresql_where=text("relayed_at_ms IS NULL"),
        ),
        # An id is never given again once its row is deleted (retention), which SQLite does only with
        # AUTOINCREMENT: the relay marks what it sent by id.
        {"sqlite_autoincrement": True},
    )

    id: int | None = Field(
        default=None,
        sa_column=Column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    )
    task_id: str = Field(sa_column=Column(String(128), nullable=False))
    state: str = Field(sa_column=Column(String(16), nullable=False))
    at_ms: int = Field(sa_column=Column(BigInteger, nullable=False))
    version: int = Field(sa_column=Column(BigInteger, nullable=False))
    drained_at_ms: int | None = Field(default=None, sa_column=Column(BigInteger))
    relayed_at_ms: int | None = Field(default=None, sa_column=Column(BigInteger))
    relay_attempts: int = Field(
        default=0, sa_column=Column(BigInteger, nullable=False, default=0, server_default="0")
    )
    relay_next_at_ms: int = Field(
        default=0, sa_column=Column(BigInteger, nullable=False, default=0, server_default="0")
    )


class DeliveryRow(SQLModel, table=True):
    """A delivery receipt, keyed by the caller's Idempotency-Key."""

    __tablename__ = "deliveries"
    # Retention deletes a task's receipts with it.
    __table_args__ = (Index("ix_deliveries_task", "task_id"),)

    idempotency_key: str = Field(sa_column=Column(String(256), primary_key=True))
    task_id: str = Field(sa_column=Column(String(128), nullable=False))
    result_ref: str = Field(sa_column=Column(Text, nullable=False))
    result_hash: str = Field(sa_column=Column(Text, nullable=False))
    delivered_at_ms: int = Field(sa_column=Column(BigInteger, nullable=False))


class DrainBatchRow(SQLModel, table=True):
    """The answer of a drain made with an ``Idempotency-Key``, kept so that the same key answers it again
    (``gateway.book.drain``). The answer itself is kept, as the bytes that were sent, not the outbox rows it
    listed: those may be deleted meanwhile (retention), and the answer must not change."""

    __tablename__ = "drain_batches"
    __table_args__ = (
        # The question of the drain that deletes batches past their keeping time: the oldest first.
        Index("ix_drain_batches_made_at", "made_at_ms"),
    )

    idempotency_key: str = Field(sa_column=Column(String(256), primary_key=True))
    made_at_ms: int = Field(sa_column=Column(BigInteger, nullable=False))
    # Notifications were still to drain when the batch was made (the answer's ``Drain-More`` header).
    more: bool = Field(sa_column=Column(Boolean, nullable=False))
    body: bytes = Field(sa_column=Column(LargeBinary, nullable=False))


class StreamRow(SQLModel, table=True):
    """A task's stream (protocol.md, Streams): its running totals (``gateway.streams.Head``), written by each
    append in the transaction that stores its batch, so that neither an append nor a read scans its
    batches. Made by the stream's first append, deleted with its task (retention); its ``closed`` is its
    task's being terminal, which the transaction that ends the task writes. On SQLite the rows live in their
    primary key's tree (WITHOUT ROWID): no second tree holds the key again."""

    __tablename__ = "streams"
    __table_args__ = ({"sqlite_with_rowid": False},)

    task_id: str = Field(sa_column=Column(String(128), primary_key=True))
    name: str = Field(sa_column=Column(String(32), primary_key=True))
    # The attempt of its last append (its text is that attempt's chunks); the offsets of that attempt's
    # first chunk and of the one after its last; the text's size in UTF-8; the batches the attempt
    # appended (its next seq); and its last batch's first offset (a retry of it reads that batch alone).
    attempt: int = Field(sa_column=Column(BigInteger, nullable=False))
    first_offset: int = Field(sa_column=Column(BigInteger, nullable=False))
    next_offset: int = Field(sa_column=Column(BigInteger, nullable=False))
    text_bytes: int = Field(sa_column=Column(BigInteger, nullable=False))
    next_seq: int = Field(sa_column=Column(BigInteger, nullable=False))
    last_offset: int = Field(sa_column=Column(BigInteger, nullable=False))


class StreamBatchRow(SQLModel, table=True):
    """One appended batch of a stream: its chunks together, as the JSON array the wire carries (never a
    row per chunk), at offsets ``first_offset`` on. Only the stream's attempt's are kept, every one of them
    (an attempt's first append deletes the earlier attempt's): a batch's seq is its place among them, kept in
    no column. On SQLite the rows live in their primary key's tree (WITHOUT ROWID): a read by offset is one
    range of it, and no second tree holds the key again."""

    __tablename__ = "stream_batches"
    __table_args__ = ({"sqlite_with_rowid": False},)

    task_id: str = Field(sa_column=Column(String(128), primary_key=True))
    stream: str = Field(sa_column=Column(String(32), primary_key=True))
    first_offset: int = Field(sa_column=Column(BigInteger, primary_key=True, autoincrement=False))
    attempt: int = Field(sa_column=Column(BigInteger, nullable=False))
    count: int = Field(sa_column=Column(Integer, nullable=False))
    # The chunks' size in UTF-8. A retried seq is told from a reused one by ``chunks`` itself, the canonical
    # array (``gateway.streams.Chunks``), read on the retry path alone: no digest in every row.
    chunk_bytes: int = Field(sa_column=Column(Integer, nullable=False))
    chunks: bytes = Field(sa_column=Column(LargeBinary, nullable=False))


class DeploymentRow(SQLModel, table=True):
    """What a deployment knows of itself, by name (``gateway.store.deployment``): ``id``, a random id made by
    the first gateway that started on this database, which names the deployment's Redis channel."""

    __tablename__ = "deployment"

    name: str = Field(sa_column=Column(String(64), primary_key=True))
    value: str = Field(sa_column=Column(Text, nullable=False))


tasks = TaskRow.__table__  # type: ignore[attr-defined]
entries = EntryRow.__table__  # type: ignore[attr-defined]
task_tags = TaskTagRow.__table__  # type: ignore[attr-defined]
callbacks = CallbackRow.__table__  # type: ignore[attr-defined]
outbox = OutboxRow.__table__  # type: ignore[attr-defined]
deliveries = DeliveryRow.__table__  # type: ignore[attr-defined]
drain_batches = DrainBatchRow.__table__  # type: ignore[attr-defined]
streams = StreamRow.__table__  # type: ignore[attr-defined]
stream_batches = StreamBatchRow.__table__  # type: ignore[attr-defined]
