"""What the reference's ``AsyncBook`` does, over the store: callback dedup, the notification outbox,
cursor resume and result delivery.

Every change goes through :meth:`Book._record`, in the transaction that read the task under a row lock:
the task row, its history entry, the callback id and the outbox row commit together or not at all. Only
after the commit is a new entry handed to ``on_commit`` (the live hub), so nothing uncommitted is ever
pushed. The write path is a handful of statements in this one module, so that it can move to batched
Core statements or group commit without touching anything else.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, ParamSpec, TypeVar

import anyio
import orjson
from sqlalchemy import Row, insert, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection

from gateway.errors import Conflict, UnknownTask
from gateway.machine import (
    Entry,
    Event,
    Task,
    Transition,
    apply_event,
    create_task,
    event_to_json,
    expire_task,
    fail,
    is_blank,
    resume_mode,
)
from gateway.store import Database
from gateway.store.tables import ACTIVE_STATES, callbacks, deliveries, entries, outbox, tasks

Clock = Callable[[], int]
OnCommit = Callable[[Task, Entry, bytes], None]

# The longest a database operation may take before it is abandoned (answered as 503 unavailable).
DB_DEADLINE_S = 10.0


P = ParamSpec("P")
R = TypeVar("R")


def _shielded(method: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Run a database operation to its end even when its caller is cancelled (a client gone, a shutdown):
    a transaction is not left half-done, and a connection is never torn down mid-query (which hangs
    aiosqlite's worker). Bounded by ``DB_DEADLINE_S``: past it, ``TimeoutError`` (a 503)."""

    @functools.wraps(method)
    async def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with anyio.fail_after(DB_DEADLINE_S, shield=True):
            return await method(*args, **kwargs)

    return run


# How often a transaction that lost a race on a unique key (a callback id, a task id, an idempotency key
# inserted by a concurrent request) is run again; the second run sees the winner's row.
_RACE_RETRIES = 3


@dataclass(frozen=True, slots=True)
class CallbackOutcome:
    transition: Transition
    duplicate_callback: bool


@dataclass(frozen=True, slots=True)
class Resume:
    mode: Literal["caught-up", "delta", "snapshot"]
    reason: str | None
    task: Task
    # (version, the event's JSON as stored) for a delta; empty otherwise.
    entries: Sequence[tuple[int, bytes]]

    def entries_json(self) -> bytes:
        """The entries as a JSON array of ``{"version", "event"}``, the stored events spliced in as stored."""
        return b"[" + b",".join(b'{"version":%d,"event":%b}' % (v, raw) for v, raw in self.entries) + b"]"


@dataclass(frozen=True, slots=True)
class Receipt:
    task_id: str
    result_ref: str
    result_hash: str
    idempotency_key: str
    delivered_at_ms: int


@dataclass(frozen=True, slots=True)
class Delivery:
    ok: bool
    duplicate: bool
    reason: str
    receipt: Receipt


@dataclass(frozen=True, slots=True)
class Notification:
    task_id: str
    state: str
    at_ms: int
    version: int


class Book:
    def __init__(
        self,
        db: Database,
        clock: Clock,
        *,
        retention_versions: int = 8,
        on_commit: OnCommit | None = None,
    ) -> None:
        self.db = db
        self.clock = clock
        self.retention_versions = retention_versions
        self.on_commit = on_commit

    # --- reads ---------------------------------------------------------------------------------------

    @_shielded
    async def get(self, task_id: str) -> Task:
        async with self.db.read() as conn:
            return task_from_row(await _select_task(conn, task_id, task_id))

    @_shielded
    async def resume(self, task_id: str, cursor: int) -> Resume:
        async with self.db.read() as conn:
            task = task_from_row(await _select_task(conn, task_id, task_id))
            mode, reason = resume_mode(task.version, cursor, self.retention_versions)
            found: Sequence[tuple[int, bytes]] = ()
            if mode == "delta":
                # Bounded by the task's version as read, so that a read-committed database cannot hand
                # back entries newer than the task it describes.
                result = await conn.execute(
                    select(entries.c.version, entries.c.event)
                    .where(
                        entries.c.task_id == task_id,
                        entries.c.version > cursor,
                        entries.c.version <= task.version,
                    )
                    .order_by(entries.c.version)
                )
                found = [(r.version, r.event) for r in result]
        return Resume(mode, reason, task, found)

    @_shielded
    async def entries_between(self, task_id: str, after: int, upto: int) -> list[tuple[int, bytes]]:
        """History entries ``after < version <= upto``, in order (to fill a gap in a live stream)."""
        async with self.db.read() as conn:
            result = await conn.execute(
                select(entries.c.version, entries.c.event)
                .where(entries.c.task_id == task_id, entries.c.version > after, entries.c.version <= upto)
                .order_by(entries.c.version)
            )
            return [(r.version, r.event) for r in result]

    # --- writes --------------------------------------------------------------------------------------

    @_shielded
    async def create(self, task_id: str, ttl_ms: int, max_attempts: Any) -> tuple[Task, bool]:
        """Create a queued task; the same id with the same parameters returns it again (``False``)."""
        now = self.clock()
        task = create_task(id=task_id, now_ms=now, ttl_ms=ttl_ms, max_attempts=max_attempts)
        for attempt in range(_RACE_RETRIES):
            try:
                async with self.db.write() as conn:
                    existing = await _select_task(conn, task_id)
                    if existing is not None:
                        if existing.ttl_ms != ttl_ms or existing.max_attempts != task.max_attempts:
                            raise Conflict(
                                "task-exists",
                                f"task {task_id} exists with other parameters "
                                f"(ttlMs {existing.ttl_ms}, maxAttempts {existing.max_attempts})",
                            )
                        return task_from_row(existing), False
                    await conn.execute(
                        insert(tasks).values(**_task_values(task), ttl_ms=ttl_ms, created_at_ms=now)
                    )
                return task, True
            except IntegrityError:
                if attempt == _RACE_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")

    @_shielded
    async def callback(
        self,
        task_id: str,
        make_event: Callable[[int], Event],
        *,
        callback_id: str | None = None,
        digest: str = "",
        attempt: int | None = None,
    ) -> CallbackOutcome:
        """Apply one worker callback, stamped with the gateway's clock once the task is locked.

        Order (protocol.md): the callback id first (global; same body = same callback, another body is a
        conflict), then ``attempt`` fencing, then the state machine. A callback id is remembered even when
        the event changed nothing, never when the event was rejected.
        """
        for retry in range(_RACE_RETRIES):
            try:
                async with self.db.write() as conn:
                    task = task_from_row(await _select_task(conn, task_id, task_id, lock=True))
                    if callback_id is not None:
                        seen = (
                            await conn.execute(
                                select(callbacks.c.digest).where(callbacks.c.callback_id == callback_id)
                            )
                        ).scalar_one_or_none()
                        if seen is not None:
                            if seen != digest:
                                raise Conflict(
                                    "callback-id-reused",
                                    f"callbackId {callback_id!r} was already used with another body",
                                )
                            return CallbackOutcome(
                                Transition(task, False, True, False, "duplicate-callback"), True
                            )
                    if attempt is not None and attempt != task.attempts:
                        raise Conflict(
                            "stale-attempt",
                            f"attempt {attempt} is not the task's current attempt ({task.attempts})",
                        )
                    now = self.clock()
                    transition = apply_event(task, make_event(now))
                    encoded = await _record(conn, transition, notify_at_ms=now)
                    if callback_id is not None:
                        await conn.execute(
                            insert(callbacks).values(
                                callback_id=callback_id, task_id=task_id, at_ms=now, digest=digest
                            )
                        )
                self._published(transition, encoded)
                return CallbackOutcome(transition, False)
            except IntegrityError:
                if retry == _RACE_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")

    @_shielded
    async def expire_due(self, limit: int = 500) -> int:
        """Expire live tasks whose deadline has come (``clock() >= expiresAtMs``); returns how many."""
        now = self.clock()
        async with self.db.read() as conn:
            due = (
                (
                    await conn.execute(
                        select(tasks.c.id)
                        .where(tasks.c.state.in_(ACTIVE_STATES), tasks.c.expires_at_ms <= now)
                        .order_by(tasks.c.expires_at_ms)
                        .limit(limit)
                    )
                )
                .scalars()
                .all()
            )
        expired = 0
        for task_id in due:
            async with self.db.write() as conn:
                row = await _select_task(conn, task_id, lock=True)
                if row is None or row.state not in ACTIVE_STATES or now < row.expires_at_ms:
                    continue
                transition = expire_task(task_from_row(row))
                # The notification, like the entry, is pinned to the deadline (protocol.md).
                encoded = await _record(conn, transition, notify_at_ms=row.expires_at_ms)
            self._published(transition, encoded)
            expired += 1
        return expired

    @_shielded
    async def deliver(self, task_id: str, idempotency_key: str) -> Delivery:
        """``deliverResult``: the same key returns the same receipt; another key delivers again."""
        if is_blank(idempotency_key):
            raise fail("idempotencyKey must not be blank")
        for retry in range(_RACE_RETRIES):
            try:
                async with self.db.write() as conn:
                    seen = (
                        await conn.execute(
                            select(deliveries).where(deliveries.c.idempotency_key == idempotency_key)
                        )
                    ).first()
                    if seen is not None:
                        if seen.task_id != task_id:
                            raise Conflict(
                                "key-reused-for-other-task",
                                f"Idempotency-Key {idempotency_key!r} was used for another task",
                            )
                        return Delivery(True, True, "duplicate-delivery", _receipt(seen))
                    task = task_from_row(await _select_task(conn, task_id, task_id))
                    if task.state != "succeeded" or task.result_ref is None or task.result_hash is None:
                        raise Conflict("not-succeeded", f"task {task_id} has not succeeded ({task.state})")
                    receipt = Receipt(
                        task_id, task.result_ref, task.result_hash, idempotency_key, self.clock()
                    )
                    await conn.execute(
                        insert(deliveries).values(
                            idempotency_key=idempotency_key,
                            task_id=task_id,
                            result_ref=receipt.result_ref,
                            result_hash=receipt.result_hash,
                            delivered_at_ms=receipt.delivered_at_ms,
                        )
                    )
                return Delivery(True, False, "delivered", receipt)
            except IntegrityError:
                if retry == _RACE_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")

    @_shielded
    async def drain(self) -> list[Notification]:
        """``drainNotifications``: take every pending notification once, by task id, then time."""
        async with self.db.write() as conn:
            result = await conn.execute(
                update(outbox)
                .where(outbox.c.drained_at_ms.is_(None))
                .values(drained_at_ms=self.clock())
                .returning(outbox.c.id, outbox.c.task_id, outbox.c.state, outbox.c.at_ms, outbox.c.version)
            )
            rows = list(result.all())
        # JavaScript compares strings by UTF-16 code units; the sort is stable, so ties keep their order.
        rows.sort(key=lambda r: (r.task_id.encode("utf-16-be"), r.at_ms, r.id))
        return [Notification(r.task_id, r.state, r.at_ms, r.version) for r in rows]

    def _published(self, transition: Transition, encoded: bytes | None) -> None:
        if self.on_commit is not None and transition.entry is not None and encoded is not None:
            self.on_commit(transition.task, transition.entry, encoded)


async def _select_task(
    conn: AsyncConnection, task_id: str, missing: str | None = None, *, lock: bool = False
) -> Any:
    if "\x00" in task_id:  # no task has one (create refuses it), and PostgreSQL text cannot hold it
        if missing is not None:
            raise UnknownTask(missing)
        return None
    query = select(tasks).where(tasks.c.id == task_id)
    if lock:
        query = query.with_for_update()
    row = (await conn.execute(query)).first()
    if row is None and missing is not None:
        raise UnknownTask(missing)
    return row


async def _record(conn: AsyncConnection, transition: Transition, *, notify_at_ms: float) -> bytes | None:
    """Write a transition: the task row, its history entry and, when it notifies, the outbox row."""
    entry = transition.entry
    if entry is None:
        return None
    task = transition.task
    result = await conn.execute(
        update(tasks)
        .where(tasks.c.id == task.id, tasks.c.version == task.version - 1)
        .values(**_task_values(task))
    )
    if result.rowcount != 1:  # the row lock makes this impossible; never write over a concurrent change
        raise RuntimeError(f"task {task.id} changed under its lock")
    encoded = orjson.dumps(event_to_json(entry.event))
    await conn.execute(
        insert(entries).values(
            task_id=task.id,
            version=entry.version,
            type=entry.event.type,
            at_ms=entry.event.at_ms,
            event=encoded,
        )
    )
    if transition.notify:
        await conn.execute(
            insert(outbox).values(task_id=task.id, state=task.state, at_ms=notify_at_ms, version=task.version)
        )
    return encoded


def _task_values(task: Task) -> dict[str, Any]:
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
    }


def task_from_row(row: Row[Any]) -> Task:
    """A ``tasks`` row as the machine's task."""
    return Task(
        id=row.id,
        state=row.state,
        expires_at_ms=row.expires_at_ms,
        attempts=row.attempts,
        max_attempts=row.max_attempts,
        progress=row.progress,
        version=row.version,
        result_ref=row.result_ref,
        result_hash=row.result_hash,
        error=row.error,
    )


def _receipt(row: Row[Any]) -> Receipt:
    return Receipt(row.task_id, row.result_ref, row.result_hash, row.idempotency_key, row.delivered_at_ms)
