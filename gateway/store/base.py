"""The store interface: the statements the book runs, behind a transaction.

The book (``gateway.book``) holds the rules: dedup order, attempt fencing, the outbox, receipts. A store
holds the statements, inside one transaction at a time: each statement of ``read()`` sees committed data
(on a database each has a snapshot of its own, as under read committed), ``write()`` commits everything
done in it together or nothing. Implementations, side by side:

- :class:`gateway.store.sql.SqlStore`: a SQLite file (the default) and PostgreSQL, every statement written
  once (``gateway.store.queries``) and run on the database's own driver;
- :class:`gateway.store.memory.MemoryStore`: the in-memory twin, for tests of the layers above.

Every implementation passes one conformance suite (``tests/integration/test_store_conformance.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol, TypeVar

from gateway.machine import Task, Transition
from gateway.streams import Batch, Head

R = TypeVar("R")


class StoreRace(Exception):
    """A concurrent transaction inserted the same key first (a callback id, a task id, an idempotency key).

    Nothing of the losing transaction was written; run it again and it sees the winner's row."""


@dataclass(frozen=True, slots=True)
class StoredTask:
    task: Task
    # What the task was created with, so that a repeated create can be told apart from a conflicting one.
    ttl_ms: int
    # Its heartbeat lease (gateway.lease): the length asked for at create (None: no lease), and the end of
    # the running attempt's lease (meaningful only while the task is running).
    heartbeat_ms: int | None = None
    lease_until_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Receipt:
    task_id: str
    result_ref: str
    result_hash: str
    idempotency_key: str
    delivered_at_ms: int


@dataclass(frozen=True, slots=True)
class Notification:
    task_id: str
    state: str
    at_ms: int
    version: int


@dataclass(frozen=True, slots=True)
class DrainBatch:
    """The answer of a drain made with an ``Idempotency-Key``, as it was sent (``gateway.book.drain``)."""

    idempotency_key: str
    made_at_ms: int
    # Notifications were still to drain when it was made.
    more: bool
    body: bytes


@dataclass(frozen=True, slots=True)
class Outgoing:
    """A notification the webhook relay has claimed to send: its outbox row and which try this is."""

    outbox_id: int
    notification: Notification
    # Tries so far, this one included (1 on the first).
    attempt: int


@dataclass(frozen=True, slots=True)
class StreamWrites:
    """The stream appends of one transaction as rows (``gateway.book.appends`` makes them): the heads of the
    streams they made and of those they moved on, by task id; their batches (task id, stream, batch); and,
    for an attempt's first append to a stream an earlier attempt wrote, where the batches it drops end
    (task id, stream, the new attempt's first offset: the stored batches before it go)."""

    made: Sequence[tuple[str, Head]] = ()
    moved: Sequence[tuple[str, Head]] = ()
    batches: Sequence[tuple[str, str, Batch]] = ()
    dropped: Sequence[tuple[str, str, int]] = ()


class ReadTx(Protocol):
    async def task(self, task_id: str) -> StoredTask | None:
        """The task, or ``None``."""

    async def entries(self, task_id: str, after: int, upto: int) -> list[tuple[int, bytes]]:
        """History entries ``after < version <= upto`` as ``(version, event JSON as stored)``, in order."""

    async def ahead(self, known: Mapping[str, int]) -> dict[str, int]:
        """Of the tasks in ``known`` (task id -> a version), those whose stored version is above it, with
        their version: the comparison made by the database, which sends back only those."""

    async def revisions_ahead(self, known: Mapping[str, int]) -> dict[str, int]:
        """As :meth:`ahead`, of revisions (the changes beside the history: metadata, children counts)."""

    async def relay_pending(self) -> int:
        """How many notifications the webhook relay has not sent yet."""

    async def next_deadline(self) -> int | None:
        """The earliest ``expiresAtMs`` of the live tasks, or ``None`` when none is live."""

    async def next_lease_end(self) -> int | None:
        """The earliest lease end of the running tasks that hold a lease, or ``None``."""

    async def list_tasks(self, *, state: str | None, after: str | None, limit: int) -> list[Task]:
        """One page of the operators' task list: up to ``limit`` tasks in id order, only those whose id
        comes after ``after`` when it is given, only those in ``state`` when it is given.

        Id order is the database's: code point order on SQLite, in memory and on a PostgreSQL database
        with the ``C`` collation; another collation orders differently but pages the same way (each task
        once), since the comparison and the order use one collation."""

    async def newest_tasks(
        self,
        *,
        state: str | None,
        before: tuple[int, str] | None,
        limit: int,
        parent: str | None = None,
        title: str | None = None,
    ) -> list[Task]:
        """One page of the operators' task list newest first: up to ``limit`` tasks, ``created_at_ms``
        descending, then id descending, only those that come after ``before`` (a ``(created_at_ms, id)``)
        in that order when it is given, only those in ``state`` when it is given, only the children of
        ``parent`` when it is given, only those whose title contains ``title`` (letters' case aside; on
        SQLite, ASCII letters') when it is given and not empty."""

    async def finished_held(self, cutoff_ms: int, *, relay: bool) -> int:
        """How many tasks that finished at or before ``cutoff_ms`` nobody has taken the notification of:
        not drained, nor relayed when ``relay`` (a relay sends notifications, and a relayed one counts as
        taken). Retention keeps them."""

    async def tagged(self, tag: str, limit: int) -> list[str]:
        """The ids of the tasks carrying ``tag``, newest first (``created_at_ms`` descending, then id
        descending), at most ``limit``: one range of the tag index, read backwards."""

    async def tagged_tasks(
        self,
        tags: Sequence[str],
        *,
        state: str | None,
        before: tuple[int, str] | None,
        limit: int,
        parent: str | None = None,
        title: str | None = None,
    ) -> list[Task]:
        """One page of the task list by tags: up to ``limit`` tasks carrying every one of ``tags`` (at least
        one), newest first (``created_at_ms`` descending, then id descending), only those that come after
        ``before`` (a ``(created_at_ms, id)``) in that order when it is given, only those in ``state``, of
        ``parent`` and whose title contains ``title`` (as :meth:`newest_tasks`) when they are given. The
        first tag's index range drives it; the others are probed by task."""

    async def tagged_since(self, tags: Sequence[str], since_ms: int) -> list[tuple[str, str, str]]:
        """``(tag, task id, epoch)`` of the tasks carrying any of ``tags`` created at or after ``since_ms``,
        by tag, then ``created_at_ms`` and id ascending; one statement per chunk of tags."""

    async def children_since(self, parents: Sequence[str], since_ms: int) -> list[tuple[str, str, str]]:
        """``(parent, task id, epoch)`` of the children of any of ``parents`` created at or after
        ``since_ms``, by parent, then ``created_at_ms`` and id ascending (ranges of ix_tasks_parent)."""

    async def resume_rows(
        self, cursors: Mapping[str, int], retention_versions: int
    ) -> dict[str, tuple[Task, list[tuple[int, bytes]]]]:
        """For each task among ``cursors``' keys that exists: the task and, in version order, its history
        entries ``cursor < version <= task.version``; none at all when the cursor is more than
        ``retention_versions`` behind the task or ahead of it (those resume with a snapshot:
        ``gateway.machine.resume_mode``). One statement for the whole map, whatever its size (PostgreSQL:
        two arrays; SQLite: one JSON object), not one per task."""

    async def stream_heads(self, task_ids: Sequence[str]) -> dict[str, list[Head]]:
        """The streams of each of these tasks that has one, by name (their running totals)."""

    async def stream_batches(self, task_id: str, name: str, start: int, limit: int) -> list[Batch]:
        """Up to ``limit`` batches of a stream in offset order, from the one that holds ``start`` (or, when
        none does, the first): one range of its key, however long the stream."""

    async def stream_batch(self, task_id: str, name: str, attempt: int, seq: int) -> Batch | None:
        """The stored batch ``seq`` of the stream's attempt ``attempt``, or ``None``: the ``seq``-th of the
        stream's batches in offset order (a stream keeps its attempt's batches alone, every one of them, and
        no row keeps its seq: ``gateway.streams``), if it is of that attempt."""


class WriteTx(ReadTx, Protocol):
    async def lock_task(self, task_id: str) -> StoredTask | None:
        """The task, locked against concurrent writers until the transaction ends."""

    async def lock_tasks(self, task_ids: Sequence[str]) -> dict[str, StoredTask]:
        """The tasks that exist among these, each locked until the transaction ends, in id order (so that
        concurrent batches lock in one order and cannot deadlock)."""

    async def lock_tasks_and_heads(
        self, task_ids: Sequence[str], streamed: Sequence[str]
    ) -> tuple[dict[str, StoredTask], dict[str, list[Head]]]:
        """:meth:`lock_tasks` of ``task_ids`` and :meth:`stream_heads` of ``streamed`` (some of them), read
        under those locks: in one statement where the store can (a group commit of appends reads both)."""

    async def insert_task(
        self, task: Task, ttl_ms: int, created_at_ms: int, heartbeat_ms: int | None = None
    ) -> None:
        """A new task (with a heartbeat lease when ``heartbeat_ms`` is given); :class:`StoreRace` (at the
        latest on commit) when the id exists."""

    async def record(self, transition: Transition, encoded_event: bytes, notify_at_ms: float) -> None:
        """A transition with an entry: the task row (checked at the version before), its history entry and,
        when it notifies, its outbox row."""

    async def record_many(self, items: Sequence[tuple[Transition, bytes, float]]) -> None:
        """Several ``record`` calls (transition, encoded event, notification time), in order, as set-based
        statements: one task row write per task (from its version before the first to its last state),
        every entry, every notification. Several transitions of one task follow each other's versions."""

    async def write_tasks(self, tasks: Sequence[Task]) -> None:
        """Task rows changed beside their history (their metadata, their children counts, their revision),
        each locked by this transaction and at the version it read: no entry, no notification. The columns
        written at insert never change."""

    async def write_streams(self, writes: StreamWrites) -> None:
        """Store a transaction's stream appends (their tasks locked by it): drop the batches of earlier
        attempts, insert the new batches, insert the heads made and update those moved."""

    async def claim_due(self, now_ms: int, limit: int) -> list[Task]:
        """Up to ``limit`` live tasks past their deadline, earliest first, locked; rows another transaction
        holds are skipped, so that processes sweeping together take different tasks. A running task whose
        lease ended before its deadline is not among them: :meth:`claim_leases` takes it first, so that its
        history has the lease's end before the deadline, whichever sweeper comes first."""

    async def renew_leases(self, leases: Sequence[tuple[str, int]]) -> None:
        """Set the lease end of each of these tasks (task id, lease end), which this transaction locked."""

    async def claim_leases(self, now_ms: int, limit: int) -> list[StoredTask]:
        """Up to ``limit`` running tasks whose lease ended at or before ``now_ms``, earliest first, locked;
        rows another transaction holds are skipped, as :meth:`claim_due` does."""

    async def callback_digest(self, callback_id: str) -> str | None:
        """The body digest a callback id was first seen with, or ``None``."""

    async def insert_callback(self, callback_id: str, task_id: str, at_ms: int, digest: str) -> None: ...

    async def callback_digests(self, callback_ids: Sequence[str]) -> dict[str, str]:
        """``callback_digest`` for many ids in one query: the ones seen, with their digests."""

    async def insert_callbacks(self, rows: Sequence[tuple[str, str, int, str]]) -> None:
        """Many ``insert_callback`` rows (callback id, task id, at, digest) at once."""

    async def receipt(self, idempotency_key: str) -> Receipt | None: ...

    async def insert_receipt(self, receipt: Receipt) -> None: ...

    async def drain(self, now_ms: int, limit: int) -> list[tuple[int, Notification]]:
        """Mark the oldest pending notifications drained (insertion order), at most ``limit``; returns them
        with their insertion order. Rows another transaction holds are skipped (drains running together
        take different notifications)."""

    async def drain_pending(self) -> bool:
        """Whether any notification is still to drain."""

    async def drain_batch(self, idempotency_key: str) -> DrainBatch | None: ...

    async def insert_drain_batch(self, batch: DrainBatch) -> None:
        """A drain's answer under its key; :class:`StoreRace` (at the latest on commit) when the key is
        taken."""

    async def forget_drain_batch(self, idempotency_key: str) -> None: ...

    async def forget_drain_batches(self, made_before_ms: int, limit: int) -> int:
        """Delete the oldest batches made before ``made_before_ms``, at most ``limit`` (rows another
        transaction holds are skipped); returns how many."""

    async def claim_relay(self, now_ms: int, lease_until_ms: int, limit: int) -> list[Outgoing]:
        """Up to ``limit`` notifications not relayed yet whose ``relay_next_at_ms`` has come, oldest due
        first; each is leased (``relay_next_at_ms = lease_until_ms``) and its attempts counted, so that no
        other claim takes it before the lease ends. Rows another transaction holds are skipped (processes
        relaying together take different notifications). Independent of the drain."""

    async def relay_sent(self, outbox_ids: Sequence[int], now_ms: int) -> None:
        """Mark these notifications relayed: no claim takes them again."""

    async def relay_later(self, outbox_id: int, next_at_ms: int) -> None:
        """Move a notification not relayed yet to ``next_at_ms`` (a retry's backoff, or a lease given back
        early); one already relayed stays so."""

    async def claim_finished(
        self, cutoff_ms: int, after: tuple[int, str] | None, limit: int, *, relay: bool
    ) -> list[tuple[int, str]]:
        """Up to ``limit`` tasks that finished at or before ``cutoff_ms``, whose notification was taken
        (drained; or relayed, when ``relay``) and whose parent, if any, is gone (a child never goes first), as
        ``(finished at, id)`` in that order, only those after ``after`` in it when given (a keyset: a pass
        goes on from its last batch's last task, past the tasks it keeps); locked, rows another transaction
        holds skipped, so that processes retaining together take different tasks."""

    async def forget(self, task_ids: Sequence[str]) -> int:
        """Delete these tasks and everything they own (``queries.TASK_OWNED``: history, streams, callback
        ids, receipts, notifications); how many tasks there were."""

    async def notify(self, channel: str, payloads: Sequence[str]) -> None:
        """Messages delivered to the channel's listeners, in order, when (and only if) this transaction
        commits.

        Only PostgreSQL has this (``pg_notify``); elsewhere it raises ``NotImplementedError``."""


class Store(Protocol):
    async def open(self) -> None:
        """Make the store ready (migrate the schema, take any process lock)."""

    async def close(self) -> None: ...

    async def ping(self, deadline_s: float = 3.0) -> None:
        """Answer within ``deadline_s`` or raise (``TimeoutError``, a driver error)."""

    def read(self) -> AbstractAsyncContextManager[ReadTx]: ...

    def write(self, *, urgent: bool = False) -> AbstractAsyncContextManager[WriteTx]:
        """A transaction that commits when the block ends without an exception; a lost race on a unique
        key raises :class:`StoreRace` with nothing written. An ``urgent`` one (expiry) goes before the
        ordinary ones waiting where writes take turns (SQLite, the in-memory store)."""

    async def transact(self, work: Callable[[WriteTx], Awaitable[R]], *, urgent: bool = False) -> R:
        """``work`` in a ``write()`` transaction, its result once committed. ``work`` awaits nothing but the
        transaction's own methods: a store may run it whole where its statements run (SQLite: on the
        writer's thread, in one hop)."""
