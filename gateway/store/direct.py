"""Write transactions in the database's own SQL on the driver's connection, with no SQLAlchemy between.

Every write of the book goes through a :class:`DirectTx`: on a SQLite file on the writer's own thread
(``gateway.store.sqlite_writer``), on PostgreSQL on an asyncpg connection taken from SQLAlchemy's pool
(``gateway.store.pg_writer``). The statements are written once, here, with ``?`` placeholders; a subclass
runs them (PostgreSQL's numbers them ``$1, $2...``) and says the little that differs:

- how rows are locked: SQLite's write transaction holds the whole file already, PostgreSQL locks each row
  (``FOR UPDATE``) and claims due work with ``SKIP LOCKED`` so that processes sweeping together take
  different rows;
- how a list of ids is passed: SQLite's ``IN (?, ?, ...)`` in chunks, PostgreSQL's ``= ANY(?)`` with one
  array (one statement text, one prepared statement, whatever the batch's size; its locks and dedup
  lookups probe the primary key once per id instead, see ``pg_writer``);
- the writes of a batch: SQLite runs an ``executemany`` per table (each statement costs no round trip on
  the writer's thread), PostgreSQL sends them at once, with the transaction's next statement or its commit.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from gateway.machine import Task, Transition
from gateway.store.base import Notification, Outgoing, Receipt, StoredTask
from gateway.store.tables import ACTIVE_STATES, TASK_COLUMNS, changed_values, task_values

# ``IN (...)`` lists go in chunks of this size (SQLite's default limit is 32,766 parameters).
IN_CHUNK = 500
SELECT_TASK = f"SELECT {', '.join(TASK_COLUMNS)}, ttl_ms FROM tasks"
_ACTIVE = "state IN ({})".format(", ".join(f"'{s}'" for s in ACTIVE_STATES))
_INSERT_TASK = "INSERT INTO tasks ({}) VALUES ({})".format(
    ", ".join((*TASK_COLUMNS, "ttl_ms", "created_at_ms")), ", ".join("?" * (len(TASK_COLUMNS) + 2))
)


def _marks(count: int) -> str:
    return ", ".join("?" * count)


def _task_of(row: Sequence[Any]) -> Task:
    """The task in a row that starts with ``TASK_COLUMNS``."""
    return Task(*row[:10])


def spans(items: Sequence[tuple[Transition, bytes, float]]) -> dict[str, tuple[int, Task]]:
    """The row write of each task the transitions change: from the version before its first transition
    to its last state (several transitions of one task follow each other's versions)."""
    found: dict[str, tuple[int, Task]] = {}
    for transition, _, _ in items:
        task = transition.task
        before = found[task.id][0] if task.id in found else task.version - 1
        found[task.id] = (before, task)
    return found


class KnownRows:
    """Each task row as a write transaction read it (or last wrote it): an update writes only the columns
    that differ from it (a progress callback writes two: progress and version)."""

    __slots__ = ("_read",)

    def __init__(self) -> None:
        self._read: dict[str, Task] = {}

    def _seen(self, task: Task) -> Task:
        self._read[task.id] = task
        return task

    def _changes(self, task: Task) -> dict[str, Any]:
        """The columns of ``task`` that differ from the row as this transaction knows it."""
        before = self._read.get(task.id)
        self._read[task.id] = task
        return changed_values(before, task)


class DirectTx(KnownRows):
    """The store's write transaction, written once in SQL; a subclass runs the statements."""

    __slots__ = ()

    # Appended to a query whose rows the transaction locks / claims (rows another transaction holds are
    # skipped): nothing where the transaction holds the database's one write lock (SQLite).
    LOCK = ""
    CLAIM = ""

    # --- how a subclass runs a statement -----------------------------------------------------------------

    async def fetch(self, sql: str, params: Sequence[Any] = ()) -> Sequence[Sequence[Any]]:
        """The rows of a query."""
        raise NotImplementedError

    async def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        """A statement's count of rows changed."""
        raise NotImplementedError

    async def run_many(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        """A statement once for each row of parameters; the rows changed, all told."""
        raise NotImplementedError

    def in_list(self, column: str, values: Sequence[Any]) -> Iterator[tuple[str, list[Any]]]:
        """Conditions "``column`` is one of ``values``" that cover ``values`` between them, each with its
        parameters; none when ``values`` is empty."""
        for start in range(0, len(values), IN_CHUNK):
            chunk = values[start : start + IN_CHUNK]
            yield f"{column} IN ({_marks(len(chunk))})", list(chunk)

    # --- reads ----------------------------------------------------------------------------------------

    async def task(self, task_id: str) -> StoredTask | None:
        return await self._select_task(task_id, "")

    async def entries(self, task_id: str, after: int, upto: int) -> list[tuple[int, bytes]]:
        rows = await self.fetch(
            "SELECT version, event FROM entries WHERE task_id = ? AND version > ? AND version <= ? "
            "ORDER BY version",
            (task_id, after, upto),
        )
        return [(r[0], r[1]) for r in rows]

    async def versions(self, task_ids: Sequence[str]) -> dict[str, int]:
        found: dict[str, int] = {}
        for condition, params in self.in_list("id", [i for i in task_ids if "\x00" not in i]):
            found.update(
                (r[0], r[1])
                for r in await self.fetch(f"SELECT id, version FROM tasks WHERE {condition}", params)
            )
        return found

    async def relay_pending(self) -> int:
        (row,) = await self.fetch("SELECT count(*) FROM outbox WHERE relayed_at_ms IS NULL")
        return int(row[0])

    async def next_deadline(self) -> int | None:
        (row,) = await self.fetch(f"SELECT min(expires_at_ms) FROM tasks WHERE {_ACTIVE}")
        deadline: int | None = row[0]
        return deadline

    async def list_tasks(self, *, state: str | None, after: str | None, limit: int) -> list[Task]:
        # Keyset pagination over the primary key: each page is one index range, however deep it is.
        where, params = [], []
        if state is not None:
            where.append("state = ?")
            params.append(state)
        if after is not None:
            where.append("id > ?")
            params.append(after)
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        return [
            _task_of(r)
            for r in await self.fetch(f"{SELECT_TASK}{clause} ORDER BY id LIMIT ?", (*params, limit))
        ]

    # --- writes ---------------------------------------------------------------------------------------

    async def lock_task(self, task_id: str) -> StoredTask | None:
        stored = await self._select_task(task_id, self.LOCK)
        if stored is not None:
            self._seen(stored.task)
        return stored

    async def lock_tasks(self, task_ids: Sequence[str]) -> dict[str, StoredTask]:
        found: dict[str, StoredTask] = {}
        # In id order, so that concurrent batches lock in one order and cannot deadlock.
        for condition, params in self.in_list("id", sorted({i for i in task_ids if "\x00" not in i})):
            found.update(
                self._locked(
                    await self.fetch(f"{SELECT_TASK} WHERE {condition} ORDER BY id{self.LOCK}", params)
                )
            )
        return found

    def _locked(self, rows: Sequence[Sequence[Any]]) -> dict[str, StoredTask]:
        """Rows of ``SELECT_TASK`` that this transaction locked, by task id."""
        return {row[0]: StoredTask(self._seen(_task_of(row)), row[10]) for row in rows}

    async def insert_task(self, task: Task, ttl_ms: int, created_at_ms: int) -> None:
        await self.run(_INSERT_TASK, (*task_values(task).values(), ttl_ms, created_at_ms))

    async def record(self, transition: Transition, encoded_event: bytes, notify_at_ms: float) -> None:
        await self.record_many([(transition, encoded_event, notify_at_ms)])

    async def record_many(self, items: Sequence[tuple[Transition, bytes, float]]) -> None:
        # One executemany per set of changed columns (a batch of progress callbacks: one).
        updates: dict[str, list[tuple[Any, ...]]] = {}
        for task_id, (before, task) in spans(items).items():
            changes = self._changes(task)
            query = f"UPDATE tasks SET {', '.join(f'{n} = ?' for n in changes)} WHERE id = ? AND version = ?"
            updates.setdefault(query, []).append((*changes.values(), task_id, before))
        for query, rows in updates.items():
            if await self.run_many(query, rows) != len(rows):
                # The row locks make this impossible; never write over a concurrent change.
                raise RuntimeError("a task changed under its lock")
        await self.run_many(
            "INSERT INTO entries (task_id, version, type, at_ms, event) VALUES (?, ?, ?, ?, ?)",
            [
                (t.task.id, t.entry.version, t.entry.event.type, t.entry.event.at_ms, encoded)
                for t, encoded, _ in items
                if t.entry is not None
            ],
        )
        notified = [(t.task.id, t.task.state, at, t.task.version) for t, _, at in items if t.notify]
        if notified:
            await self.run_many(
                "INSERT INTO outbox (task_id, state, at_ms, version) VALUES (?, ?, ?, ?)", notified
            )

    async def claim_due(self, now_ms: int, limit: int) -> list[Task]:
        # The partial index ix_tasks_live_deadline answers this in O(batch), whatever the table's size.
        query = (
            f"{SELECT_TASK} WHERE {_ACTIVE} AND expires_at_ms <= ? ORDER BY expires_at_ms LIMIT ?{self.CLAIM}"
        )
        return [self._seen(_task_of(r)) for r in await self.fetch(query, (now_ms, limit))]

    async def callback_digest(self, callback_id: str) -> str | None:
        return (await self.callback_digests([callback_id])).get(callback_id)

    async def insert_callback(self, callback_id: str, task_id: str, at_ms: int, digest: str) -> None:
        await self.insert_callbacks([(callback_id, task_id, at_ms, digest)])

    async def callback_digests(self, callback_ids: Sequence[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        for condition, params in self.in_list("callback_id", sorted(set(callback_ids))):
            query = f"SELECT callback_id, digest FROM callbacks WHERE {condition}"
            found.update((r[0], r[1]) for r in await self.fetch(query, params))
        return found

    async def insert_callbacks(self, rows: Sequence[tuple[str, str, int, str]]) -> None:
        if rows:
            await self.run_many(
                "INSERT INTO callbacks (callback_id, task_id, at_ms, digest) VALUES (?, ?, ?, ?)", rows
            )

    async def receipt(self, idempotency_key: str) -> Receipt | None:
        rows = await self.fetch(
            "SELECT task_id, result_ref, result_hash, idempotency_key, delivered_at_ms FROM deliveries "
            "WHERE idempotency_key = ?",
            (idempotency_key,),
        )
        return Receipt(*rows[0]) if rows else None

    async def insert_receipt(self, receipt: Receipt) -> None:
        await self.run(
            "INSERT INTO deliveries (idempotency_key, task_id, result_ref, result_hash, delivered_at_ms) "
            "VALUES (?, ?, ?, ?, ?)",
            (
                receipt.idempotency_key,
                receipt.task_id,
                receipt.result_ref,
                receipt.result_hash,
                receipt.delivered_at_ms,
            ),
        )

    async def drain(self, now_ms: int) -> list[tuple[int, Notification]]:
        rows = await self.fetch(
            "UPDATE outbox SET drained_at_ms = ? WHERE drained_at_ms IS NULL "
            "RETURNING id, task_id, state, at_ms, version",
            (now_ms,),
        )
        return [(r[0], Notification(*r[1:])) for r in rows]

    async def claim_relay(self, now_ms: int, lease_until_ms: int, limit: int) -> list[Outgoing]:
        # The partial index ix_outbox_relay_due answers this in O(batch): relayed rows are not in it.
        rows = await self.fetch(
            "SELECT id, task_id, state, at_ms, version, relay_attempts FROM outbox "
            "WHERE relayed_at_ms IS NULL AND relay_next_at_ms <= ? ORDER BY relay_next_at_ms, id LIMIT ?"
            + self.CLAIM,
            (now_ms, limit),
        )
        for condition, params in self.in_list("id", [r[0] for r in rows]):
            await self.run(
                "UPDATE outbox SET relay_next_at_ms = ?, relay_attempts = relay_attempts + 1 "
                f"WHERE {condition}",
                (lease_until_ms, *params),
            )
        return [Outgoing(r[0], Notification(*r[1:5]), r[5] + 1) for r in rows]

    async def relay_sent(self, outbox_ids: Sequence[int], now_ms: int) -> None:
        for condition, params in self.in_list("id", sorted(set(outbox_ids))):
            await self.run(
                f"UPDATE outbox SET relayed_at_ms = ? WHERE {condition} AND relayed_at_ms IS NULL",
                (now_ms, *params),
            )

    async def relay_later(self, outbox_id: int, next_at_ms: int) -> None:
        await self.run(
            "UPDATE outbox SET relay_next_at_ms = ? WHERE id = ? AND relayed_at_ms IS NULL",
            (next_at_ms, outbox_id),
        )

    async def notify(self, channel: str, payloads: Sequence[str]) -> None:
        raise NotImplementedError(f"{type(self).__name__} has no NOTIFY")

    async def _select_task(self, task_id: str, lock: str) -> StoredTask | None:
        if "\x00" in task_id:  # no task has one (create refuses it), and PostgreSQL text cannot hold it
            return None
        rows = await self.fetch(f"{SELECT_TASK} WHERE id = ?{lock}", (task_id,))
        return StoredTask(_task_of(rows[0]), rows[0][10]) if rows else None
