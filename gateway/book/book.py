"""The book of tasks over the store, as protocol.md states it: callback dedup (Callbacks), the
notification outbox (Notifications), cursor resume (Resuming) and result delivery (Deliveries).

The book holds the rules (the order of dedup, fencing and the machine; what goes to the outbox; when a
receipt is reused); the store (``gateway.store``) holds the statements. Every change runs in one store
transaction that read the task under a row lock: the task row, its history entry, the callback id, the
outbox row and the bus announcement (PostgreSQL's ``NOTIFY``) commit together or not at all. Only after
the commit is the entry published to this process's hub, so nothing uncommitted is ever pushed.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import orjson

from gateway.book.appends import Appends
from gateway.book.batches import adopt, recount
from gateway.book.beside import PLAIN, Beside, same_create
from gateway.book.drain import DEFAULT_LIMIT, Drained, Encode, drain
from gateway.book.listeners import Listeners
from gateway.book.outcomes import CallbackOutcome, CallbackRequest, Delivery
from gateway.bus.base import Bus, News
from gateway.errors import Conflict, GatewayError, UnknownTask
from gateway.frames import event_frame
from gateway.lease import fence, heartbeat, lease_of, renewal, timed_out
from gateway.machine import (
    Event,
    Resume,
    Task,
    Transition,
    apply_event,
    create_task,
    event_to_json,
    expire_task,
    fail,
    is_blank,
    resume_from,
    resume_mode,
)
from gateway.store.base import Notification, ReadTx, Receipt, Store, StoreRace, WriteTx
from gateway.store.db_deadline import DB_DEADLINE_S, shielded
from gateway.streams import MAX_STREAM_BYTES
from gateway.task_times import stamped

__all__ = ["Book", "CallbackOutcome", "CallbackRequest", "Delivery", "Listeners", "Notification", "Receipt"]

Clock = Callable[[], int]

# Due tasks expired per transaction: a backlog is worked through in bounded batches, each committed.
EXPIRY_BATCH = 200

R = TypeVar("R")


# How often a transaction that lost a race on a unique key (a callback id, a task id, an idempotency key
# inserted by a concurrent request) is run again; the second run sees the winner's row.
_RACE_RETRIES = 3


class _SharedResume:
    """The cursors of the resumes of one task that will share one store read."""

    __slots__ = ("cursors", "task")

    def __init__(self, cursor: int) -> None:
        self.cursors = {cursor}
        self.task: asyncio.Task[tuple[Task, Sequence[tuple[int, bytes]]]] | None = None


class _Commit:
    """What one write transaction committed, to publish once it has."""

    __slots__ = ("news", "notified")

    def __init__(self) -> None:
        self.news: list[News] = []
        self.notified = 0


class Book:
    def __init__(
        self,
        store: Store,
        clock: Clock,
        *,
        bus: Bus | None = None,
        retention_versions: int = 8,
        max_history_versions: int = 0,
        listeners: Listeners | None = None,
        deadline_s: float = DB_DEADLINE_S,
        stream_max_bytes: int = MAX_STREAM_BYTES,
    ) -> None:
        self.store = store
        self.stream_max_bytes = stream_max_bytes  # a stream's text at most (GATEWAY_STREAM_MAX_BYTES)
        # The longest one database operation may take (GATEWAY_DB_DEADLINE_MS), then TimeoutError (a 503).
        self.deadline_s = deadline_s
        self.clock = clock
        self.bus = bus
        self.retention_versions = retention_versions
        self.listeners = listeners if listeners is not None else Listeners()
        self._resuming: dict[str, _SharedResume] = {}  # resumes waiting for a read that has not started
        # History entries a task may have (0: no limit); past it only an entry that ends the task is added.
        self.max_history_versions = max_history_versions

    # --- reads ---------------------------------------------------------------------------------------

    @shielded
    async def get(self, task_id: str) -> Task:
        async with self.store.read() as tx:
            return await _task(tx, task_id)

    async def resume(self, task_id: str, cursor: int, epoch: str | None = None) -> Resume:
        """What a subscriber at ``cursor`` (of the history ``epoch``, or a bare version) missed. Resumes of
        one task asked for while none of them has started reading share one store read (a reconnect storm
        costs a read per task, not per socket); each caller registered its subscription before asking, so
        the shared read is new enough for all."""
        read = self._resuming.get(task_id)
        if read is None:
            read = self._resuming[task_id] = _SharedResume(cursor)
            read.task = asyncio.get_running_loop().create_task(self._read_resume(task_id, read))
        else:
            read.cursors.add(cursor)
        assert read.task is not None
        task, found = await asyncio.shield(read.task)  # one caller cancelled does not cancel the others'
        mode, reason = resume_from(task, cursor, self.retention_versions, epoch)
        if mode != "delta":
            return Resume(mode, reason, task, ())
        return Resume(mode, reason, task, [entry for entry in found if entry[0] > cursor])

    @shielded
    async def _read_resume(
        self, task_id: str, read: _SharedResume
    ) -> tuple[Task, Sequence[tuple[int, bytes]]]:
        try:
            async with self.store.read() as tx:
                # From here on, a resume of this task waits for the next read.
                if self._resuming.get(task_id) is read:
                    del self._resuming[task_id]
                task = await _task(tx, task_id)
                deltas = [
                    c
                    for c in read.cursors
                    if resume_mode(task.version, c, self.retention_versions)[0] == "delta"
                ]
                if not deltas:
                    return task, ()
                # Bounded by the task's version as read, so that a read-committed database cannot hand
                # back entries newer than the task it describes.
                return task, await tx.entries(task_id, min(deltas), task.version)
        finally:
            if self._resuming.get(task_id) is read:
                del self._resuming[task_id]

    @shielded
    async def entries_between(self, task_id: str, after: int, upto: int) -> list[tuple[int, bytes]]:
        """History entries ``after < version <= upto``, in order (to fill a gap in a live stream)."""
        async with self.store.read() as tx:
            return await tx.entries(task_id, after, upto)

    @shielded
    async def ahead(self, known: Mapping[str, int]) -> dict[str, int]:
        """Of the tasks in ``known`` (id -> version), those stored at a higher version, with it."""
        async with self.store.read() as tx:
            return await tx.ahead(known)

    @shielded
    async def next_deadline(self) -> int | None:
        """The earliest deadline of the live tasks (``expiresAtMs``), or ``None`` when none is live."""
        async with self.store.read() as tx:
            return await tx.next_deadline()

    @shielded
    async def next_due(self) -> tuple[int | None, int | None]:
        """When the sweeper has work next, of each kind: the earliest deadline of the live tasks and the
        earliest lease end of the running attempts (``gateway.lease``), each ``None`` when there is none."""
        async with self.store.read() as tx:
            return await tx.next_deadline(), await tx.next_lease_end()

    @shielded
    async def list_tasks(self, *, state: str | None, after: str | None, limit: int) -> list[Task]:
        """Up to ``limit`` tasks in id order after ``after``, only those in ``state`` if given."""
        async with self.store.read() as tx:
            return await tx.list_tasks(state=state, after=after, limit=limit)

    # --- writes --------------------------------------------------------------------------------------

    @shielded
    async def create(
        self,
        task_id: str,
        ttl_ms: int,
        max_attempts: Any,
        heartbeat_ms: int | None = None,
        tags: Sequence[str] = (),
        beside: Beside = PLAIN,
    ) -> tuple[Task, bool]:
        """Create a queued task (with a heartbeat lease of ``heartbeat_ms``, if given, ``tags``, kept sorted,
        and the fields ``beside`` its history: a child of a parent is counted under it in the same
        transaction); the same id with the same parameters, tags (in any order), title, parent and
        ``progressFromChildren`` returns it again (``False``), with its metadata as it is now."""
        now = self.clock()
        made_now = create_task(id=task_id, now_ms=now, ttl_ms=ttl_ms, max_attempts=max_attempts)
        # Its epoch, 48 random bits: two tasks made under one id (the first deleted by retention) differ but
        # by a chance of one in 2^48, so that a cursor of the first never counts in the second's history.
        made_now = replace(made_now, tags=tuple(sorted(tags)), created_at_ms=now, epoch=secrets.token_hex(6))
        task = beside.on(made_now)

        async def work(tx: WriteTx, commit: _Commit) -> tuple[Task, bool]:
            existing = await tx.task(task_id)
            if existing is not None:
                same_create(existing, task, ttl_ms, heartbeat_ms)
                return existing.task, False
            news = await adopt(tx, task)  # counted by its parent, if any; news for their subscribers
            await tx.insert_task(task, ttl_ms, now, heartbeat_ms)
            await self._announce(tx, commit, news)
            return task, True

        made, created = await self._write(work)
        if created:
            self.listeners.deadline_set(int(made.expires_at_ms))
        return made, created

    async def callback(
        self,
        task_id: str,
        make_event: Callable[[int], Event],
        *,
        callback_id: str | None = None,
        digest: str = "",
        attempt: int | None = None,
    ) -> CallbackOutcome:
        """Apply one worker callback (a batch of one: see :meth:`callbacks`); raises its error."""
        request = CallbackRequest(task_id, make_event, callback_id, digest, attempt)
        (outcome,) = await self.callbacks([request])
        if isinstance(outcome, GatewayError):
            raise outcome
        return outcome

    @shielded
    async def callbacks(self, requests: Sequence[CallbackRequest]) -> list[CallbackOutcome | GatewayError]:
        """Apply worker callbacks in arrival order, in one transaction and one commit (group commit); each
        gets its own outcome, or the error that refused it (a refused callback writes nothing, so it never
        fails its neighbours). Each is stamped with the gateway's clock once its task is locked.

        Order for each (protocol.md): the callback id first (global; same body = same callback, another
        body is a conflict), then ``attempt`` fencing, then the state machine. A callback id is remembered
        even when the event changed nothing, never when the event was rejected. The tasks are locked and
        the callback ids looked up once for the whole batch; the writes are set-based, the running
        attempts' lease renewals (``gateway.lease``) and the stream appends (``gateway.book.appends``)
        among them.
        """

        async def work(
            tx: WriteTx, commit: _Commit
        ) -> tuple[list[CallbackOutcome | GatewayError], int | None]:
            streamed = [r.task_id for r in requests if r.append is not None]
            # The tasks locked, and the heads of the streams appended to read under those locks.
            stored, heads = await tx.lock_tasks_and_heads([r.task_id for r in requests], streamed)
            tasks = {i: s.task for i, s in stored.items()}
            renewed: dict[str, int] = {}  # the leases the batch renews, by task
            ids = [r.callback_id for r in requests if r.callback_id is not None]
            digests = await tx.callback_digests(ids) if ids else {}
            appends = Appends(tx, heads, self.stream_max_bytes)
            outcomes: list[CallbackOutcome | GatewayError] = []
            transitions: list[tuple[Transition, float, str]] = []
            seen: list[tuple[str, str, int, str]] = []
            for request in requests:
                try:
                    if request.append is None:
                        outcome, at = self._decide(request, tasks, digests)
                    else:
                        outcome, at = await appends.decide(tasks.get(request.task_id), request), self.clock()
                except GatewayError as exc:
                    outcomes.append(exc)
                    continue
                task, held = outcome.transition.task, stored[request.task_id]
                # Every callback of the running attempt renews its lease (gateway.lease), a retry not.
                until = None if outcome.duplicate_callback else renewal(task, held.heartbeat_ms, at)
                if until is not None:
                    renewed[task.id] = until
                until = renewed.get(task.id, held.lease_until_ms)
                outcomes.append(replace(outcome, lease=lease_of(task, held.heartbeat_ms, until)))
                if outcome.duplicate_callback or request.make_event is None:
                    continue
                transitions.append((outcome.transition, at, tasks[request.task_id].state))
                tasks[request.task_id] = task
                if request.callback_id is not None:
                    digests[request.callback_id] = request.digest
                    seen.append((request.callback_id, request.task_id, at, request.digest))
            await self._record_many(tx, commit, transitions)
            await tx.insert_callbacks(seen)
            if streamed:
                await tx.write_streams(appends.writes())
                await self._announce(tx, commit, appends.news())
            await tx.renew_leases(list(renewed.items()))
            return outcomes, min(renewed.values(), default=None)

        done, lease_end = await self._write(work)
        if lease_end is not None:
            self.listeners.deadline_set(lease_end)
        return done

    def _decide(
        self, request: CallbackRequest, tasks: dict[str, Task], digests: dict[str, str]
    ) -> tuple[CallbackOutcome, int]:
        task = tasks.get(request.task_id)
        if task is None:
            raise UnknownTask(request.task_id)
        if request.callback_id is not None:
            seen = digests.get(request.callback_id)
            if seen is not None:
                if seen != request.digest:
                    raise Conflict(
                        "callback-id-reused",
                        f"callbackId {request.callback_id!r} was already used with another body",
                    )
                return CallbackOutcome(Transition(task, False, True, False, "duplicate-callback"), True), 0
        fence(task, request.attempt)
        if request.make_event is None:  # a heartbeat: it changes no entry of the task
            return CallbackOutcome(heartbeat(task), False), self.clock()
        now = self.clock()
        transition = stamped(apply_event(task, request.make_event(now)), now)
        limit = self.max_history_versions
        if limit and transition.changed and not transition.task.terminal and transition.task.version > limit:
            # History is kept whole while a task lives (protocol.md), so it is bounded here instead: a task
            # at its limit takes only the callback that ends it (the sweeper's expiry is never refused).
            raise Conflict(
                "history-full",
                f"task {task.id} has {task.version} history entries, the most a task may have; only a "
                "callback that ends it (succeed, or a fail that is not retried) is taken now",
            )
        return CallbackOutcome(transition, False), now

    @shielded
    async def act(self, task_id: str, decide: Callable[[Task, int], Transition]) -> Transition:
        """Apply one of the gateway's own actions to a task (a cancel: ``gateway.machine.cancel_task``):
        ``decide`` gets the task, locked, and the gateway's time, and its transition is recorded as a
        callback's is (entry, outbox, bus, all in one transaction); no callback id, no fencing."""

        async def work(tx: WriteTx, commit: _Commit) -> Transition:
            stored = (await tx.lock_tasks([task_id])).get(task_id)
            if stored is None:
                raise UnknownTask(task_id)
            now = self.clock()
            transition = stamped(decide(stored.task, now), now)
            await self._record_many(tx, commit, [(transition, now, stored.task.state)])
            return transition

        return await self._write(work)

    @shielded
    async def expire_due(self, limit: int = EXPIRY_BATCH, *, urgent: bool = True) -> int:
        """Expire up to ``limit`` live tasks whose deadline has come (``clock() >= expiresAtMs``), in one
        transaction; returns how many. Tasks another process is expiring are skipped, not waited for.

        An ``urgent`` transaction goes before the callbacks and creations waiting to write. What is due is
        decided once it has its turn, so a task that fell due while it waited is expired with it."""

        async def work(tx: WriteTx, commit: _Commit) -> list[int]:
            due = await tx.claim_due(self.clock(), limit)
            # The notification, like the entry, is pinned to the deadline (protocol.md).
            expired = [(stamped(expire_task(t), t.expires_at_ms), t.expires_at_ms, t.state) for t in due]
            await self._record_many(tx, commit, expired)
            return [int(task.expires_at_ms) for task in due]

        deadlines = await self._write(work, urgent=urgent)
        if deadlines:
            self.listeners.tasks_expired(deadlines)
        return len(deadlines)

    @shielded
    async def end_leases(self, limit: int = EXPIRY_BATCH, *, urgent: bool = True) -> int:
        """End up to ``limit`` leases that ran out (``clock() >= lease end``) with the retryable fail of
        protocol.md's task life at each one's end (``gateway.lease``), in one transaction, as
        :meth:`expire_due` does; returns how many. Leases another process is ending are skipped, not waited
        for."""

        async def work(tx: WriteTx, commit: _Commit) -> list[int]:
            ended = [(s.task, s.lease_until_ms or 0) for s in await tx.claim_leases(self.clock(), limit)]
            # Its entry and a final fail's notification at the lease's end (an expiry's at the deadline).
            timeouts = [timed_out(task, end) for task, end in ended]
            at = [(t, t.entry.event.at_ms) for t in timeouts if t.entry]
            await self._record_many(tx, commit, [(stamped(t, when), when, "running") for t, when in at])
            return [end for _, end in ended]

        ends = await self._write(work, urgent=urgent)
        if ends:
            self.listeners.leases_over(ends)
        return len(ends)

    @shielded
    async def deliver(self, task_id: str, idempotency_key: str) -> Delivery:
        """``deliverResult``: the same key returns the same receipt; another key delivers again."""
        if is_blank(idempotency_key):
            raise fail("idempotencyKey must not be blank")

        async def work(tx: WriteTx, _: _Commit) -> Delivery:
            seen = await tx.receipt(idempotency_key)
            if seen is not None:
                if seen.task_id != task_id:
                    raise Conflict(
                        "key-reused-for-other-task",
                        f"Idempotency-Key {idempotency_key!r} was used for another task",
                    )
                return Delivery(True, True, "duplicate-delivery", seen)
            stored = await tx.lock_task(task_id)  # locked: retention cannot delete it before the receipt
            if stored is None:
                raise UnknownTask(task_id)
            task = stored.task
            if task.state != "succeeded" or task.result_ref is None or task.result_hash is None:
                raise Conflict("not-succeeded", f"task {task_id} has not succeeded ({task.state})")
            receipt = Receipt(task_id, task.result_ref, task.result_hash, idempotency_key, self.clock())
            await tx.insert_receipt(receipt)
            return Delivery(True, False, "delivered", receipt)

        return await self._write(work)

    @shielded
    async def drain(
        self, encode: Encode, *, limit: int = DEFAULT_LIMIT, idempotency_key: str | None = None
    ) -> Drained:
        """``drainNotifications``, a batch of at most ``limit`` at a time; the same ``idempotency_key``
        answers its batch again (``gateway.book.drain``). ``encode`` makes the answer's body."""
        if idempotency_key is not None and is_blank(idempotency_key):
            raise fail("idempotencyKey must not be blank")
        now = self.clock()

        async def work(tx: WriteTx, _: _Commit) -> Drained:
            return await drain(tx, now, limit=limit, key=idempotency_key, encode=encode)

        return await self._write(work)

    # --- the write path --------------------------------------------------------------------------------

    async def _write(self, work: Callable[[WriteTx, _Commit], Awaitable[R]], *, urgent: bool = False) -> R:
        """Run ``work`` in a write transaction, again if it lost a race on a unique key; then publish what
        it committed."""
        for retry in range(_RACE_RETRIES):
            commit = _Commit()
            try:
                result = await self.store.transact(_with(work, commit), urgent=urgent)
            except StoreRace:
                if retry == _RACE_RETRIES - 1:
                    raise
                continue
            if self.bus is not None:
                for news in commit.news:
                    self.bus.publish(news)
            if commit.notified:
                self.listeners.notified()
            return result
        raise AssertionError("unreachable")

    async def _announce(self, tx: WriteTx, commit: _Commit, news: Sequence[News]) -> None:
        """Announce news (an entry, a task created with tags, an append) in its transaction (PostgreSQL's
        NOTIFY), and publish it once that has committed."""
        if self.bus is not None and news:
            await self.bus.announce(tx, news)
            commit.news.extend(news)

    async def _record_many(
        self, tx: WriteTx, commit: _Commit, transitions: Sequence[tuple[Transition, float, str]]
    ) -> None:
        """Write the transitions that have an entry (set-based), and announce each in the same transaction;
        ``str``: each one's task's state before it. The parents of the children they move are counted
        (``gateway.book.batches``) in the same transaction, and their progress moved where asked."""
        items = [(t, orjson.dumps(event_to_json(t.entry.event)), at) for t, at, _ in transitions if t.entry]
        if not items:
            return
        if len(items) == 1:
            await tx.record(*items[0])
        else:
            await tx.record_many(items)
        commit.notified += sum(1 for t, _, _ in items if t.notify)
        await self._announce(tx, commit, [News.of(t.task, event_frame(t.task, e)) for t, e, _ in items])
        moves = [(t, before) for t, _, before in transitions if t.task.parent and t.task.state != before]
        if moves:
            counted, progressed = await recount(tx, moves, self.clock())  # progress: no parent's state moves
            await self._record_many(tx, commit, [(t, self.clock(), t.task.state) for t in progressed])
            await self._announce(
                tx, commit, [News.besides(p) for p in (*counted, *(t.task for t in progressed))]
            )


def _with(
    work: Callable[[WriteTx, _Commit], Awaitable[R]], commit: _Commit
) -> Callable[[WriteTx], Awaitable[R]]:
    return lambda tx: work(tx, commit)


async def _task(tx: ReadTx, task_id: str) -> Task:
    stored = await tx.task(task_id)
    if stored is None:
        raise UnknownTask(task_id)
    return stored.task
