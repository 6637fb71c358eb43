"""The store's in-memory twin: the same interface and answers as the SQL store, nothing on disk.

Transactions run one at a time under one lock (serialisable by construction); a write transaction keeps
an undo list and rolls back every change when its block raises. It is for tests of the layers above the
store; it keeps nothing across restarts.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

from gateway.machine import Task, Transition
from gateway.store.base import (
    DrainBatch,
    Notification,
    Outgoing,
    Receipt,
    StoredTask,
    StoreRace,
    StreamWrites,
    WriteTx,
)
from gateway.store.memory_data import Data, insert_only_kept, narrowed
from gateway.store.priority_lock import PriorityLock
from gateway.store.tables import ACTIVE_STATES
from gateway.streams import Batch, Head

R = TypeVar("R")


class MemoryStore:
    def __init__(self) -> None:
        self._data = Data()
        self._lock = PriorityLock()

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def ping(self, deadline_s: float = 3.0) -> None:
        pass

    @asynccontextmanager
    async def read(self) -> AsyncIterator[MemoryTx]:
        async with self._lock.hold():
            yield MemoryTx(self._data, [])

    @asynccontextmanager
    async def write(self, *, urgent: bool = False) -> AsyncIterator[MemoryTx]:
        async with self._lock.hold(urgent=urgent):
            tx = MemoryTx(self._data, [])
            try:
                yield tx
            except BaseException:
                for undo in reversed(tx.undo):
                    undo()
                raise

    async def transact(self, work: Callable[[WriteTx], Awaitable[R]], *, urgent: bool = False) -> R:
        async with self.write(urgent=urgent) as tx:
            return await work(tx)


class MemoryTx:
    def __init__(self, data: Data, undo: list[Callable[[], Any]]) -> None:
        self.data = data
        self.undo = undo

    async def task(self, task_id: str) -> StoredTask | None:
        return self.data.tasks.get(task_id)

    async def entries(self, task_id: str, after: int, upto: int) -> list[tuple[int, bytes]]:
        found = self.data.entries.get(task_id, [])
        return [(v, raw) for v, raw in found if after < v <= upto]

    async def ahead(self, known: Mapping[str, int]) -> dict[str, int]:
        stored = self.data.tasks
        versions = {i: stored[i].task.version for i in known if i in stored}
        return {i: version for i, version in versions.items() if version > known[i]}

    async def revisions_ahead(self, known: Mapping[str, int]) -> dict[str, int]:
        stored = self.data.tasks
        revisions = {i: stored[i].task.revision for i in known if i in stored}
        return {i: revision for i, revision in revisions.items() if revision > known[i]}

    async def next_deadline(self) -> int | None:
        live = [s.task.expires_at_ms for s in self.data.tasks.values() if s.task.state in ACTIVE_STATES]
        return int(min(live)) if live else None

    async def next_lease_end(self) -> int | None:
        return min((until for _, until in self._leased()), default=None)

    def _leased(self) -> list[tuple[StoredTask, int]]:
        """The running tasks that hold a lease, with its end."""
        return [
            (s, s.lease_until_ms)
            for s in self.data.tasks.values()
            if s.task.state == "running" and s.lease_until_ms is not None
        ]

    async def list_tasks(self, *, state: str | None, after: str | None, limit: int) -> list[Task]:
        found = sorted(
            (s.task for s in self.data.tasks.values()),
            key=lambda t: t.id,
        )
        return [t for t in found if (state is None or t.state == state) and (after is None or t.id > after)][
            :limit
        ]

    async def newest_tasks(
        self,
        *,
        state: str | None,
        before: tuple[int, str] | None,
        limit: int,
        parent: str | None = None,
        title: str | None = None,
    ) -> list[Task]:
        return narrowed(self.tagged_page((), state, before, None), parent, title)[:limit]

    def _tagged(self, tags: Sequence[str]) -> list[tuple[str, int, str]]:
        """(tag, created at, task id) of the tasks carrying any of ``tags``: the rows of ``task_tags``."""
        wanted = set(tags)
        return sorted(
            (tag, s.task.created_at_ms, s.task.id)
            for s in self.data.tasks.values()
            for tag in s.task.tags
            if tag in wanted
        )

    async def tagged(self, tag: str, limit: int) -> list[str]:
        return [task_id for _, _, task_id in reversed(self._tagged([tag]))][:limit]

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
        return narrowed(self.tagged_page(tags, state, before, None), parent, title)[:limit]

    def tagged_page(
        self, tags: Sequence[str], state: str | None, before: tuple[int, str] | None, limit: int | None
    ) -> list[Task]:
        """A page newest first of the tasks carrying every one of ``tags`` (every task: none)."""
        found = sorted(
            (s.task for s in self.data.tasks.values() if set(tags) <= set(s.task.tags)),
            key=lambda t: (t.created_at_ms, t.id),
            reverse=True,
        )
        return [
            t
            for t in found
            if (state is None or t.state == state) and (before is None or (t.created_at_ms, t.id) < before)
        ][:limit]

    async def tagged_since(self, tags: Sequence[str], since_ms: int) -> list[tuple[str, str, str]]:
        tasks = self.data.tasks
        rows = self._tagged(tags)
        return [(tag, task_id, tasks[task_id].task.epoch) for tag, at, task_id in rows if at >= since_ms]

    async def children_since(self, parents: Sequence[str], since_ms: int) -> list[tuple[str, str, str]]:
        found = [s.task for s in self.data.tasks.values() if s.task.parent in set(parents)]
        found.sort(key=lambda t: (t.parent or "", t.created_at_ms, t.id))
        return [(t.parent or "", t.id, t.epoch) for t in found if t.created_at_ms >= since_ms]

    async def resume_rows(
        self, cursors: Mapping[str, int], retention_versions: int
    ) -> dict[str, tuple[Task, list[tuple[int, bytes]]]]:
        found: dict[str, tuple[Task, list[tuple[int, bytes]]]] = {}
        for task_id in sorted(cursors):
            stored = self.data.tasks.get(task_id)
            if stored is None:
                continue
            task, cursor = stored.task, cursors[task_id]
            within = task.version - retention_versions <= cursor <= task.version
            missed = [(v, raw) for v, raw in self.data.entries[task_id] if cursor < v <= task.version]
            found[task_id] = (task, missed if within else [])
        return found

    async def stream_heads(self, task_ids: Sequence[str]) -> dict[str, list[Head]]:
        found = {i: self.data.streams.get(i, {}) for i in set(task_ids)}
        return {i: [found[i][name][0] for name in sorted(found[i])] for i in sorted(found) if found[i]}

    async def stream_batches(self, task_id: str, name: str, start: int, limit: int) -> list[Batch]:
        batches = self.data.streams.get(task_id, {}).get(name, (None, []))[1]
        holding = [i for i, batch in enumerate(batches) if batch.offset <= start]
        first = holding[-1] if holding else 0
        return batches[first : first + limit]

    async def stream_batch(self, task_id: str, name: str, attempt: int, seq: int) -> Batch | None:
        batches = self.data.streams.get(task_id, {}).get(name, (None, []))[1]
        found = batches[seq] if seq < len(batches) else None  # the seq-th: gateway.streams, Batch
        return found if found is not None and found.attempt == attempt else None

    async def write_streams(self, writes: StreamWrites) -> None:
        saved = {task_id: dict(found) for task_id, found in self.data.streams.items()}
        self.undo.append(lambda: setattr(self.data, "streams", saved))
        streams = self.data.streams
        for task_id, name, before in writes.dropped:
            head, batches = streams[task_id][name]
            streams[task_id][name] = (head, [b for b in batches if b.offset >= before])
        for task_id, head in (*writes.made, *writes.moved):
            held = streams.setdefault(task_id, {}).get(head.name)
            streams[task_id][head.name] = (head, held[1] if held is not None else [])
        for task_id, name, batch in writes.batches:
            head, batches = streams[task_id][name]
            streams[task_id][name] = (head, [*batches, batch])

    async def lock_task(self, task_id: str) -> StoredTask | None:
        return self.data.tasks.get(task_id)

    async def lock_tasks(self, task_ids: Sequence[str]) -> dict[str, StoredTask]:
        stored = self.data.tasks
        return {i: stored[i] for i in sorted(set(task_ids)) if i in stored}

    async def lock_tasks_and_heads(
        self, task_ids: Sequence[str], streamed: Sequence[str]
    ) -> tuple[dict[str, StoredTask], dict[str, list[Head]]]:
        return await self.lock_tasks(task_ids), await self.stream_heads(streamed)

    async def insert_task(
        self, task: Task, ttl_ms: int, created_at_ms: int, heartbeat_ms: int | None = None
    ) -> None:
        if task.id in self.data.tasks:
            raise StoreRace(f"task {task.id} exists")
        # Its creation time is the row's column, written from ``created_at_ms`` (as in SQL).
        self.data.tasks[task.id] = StoredTask(
            replace(task, created_at_ms=created_at_ms), ttl_ms, heartbeat_ms
        )
        self.data.entries[task.id] = []
        self.undo.append(lambda: (self.data.tasks.pop(task.id), self.data.entries.pop(task.id)))

    async def record(self, transition: Transition, encoded_event: bytes, notify_at_ms: float) -> None:
        entry = transition.entry
        assert entry is not None
        task = transition.task
        before = self.data.tasks[task.id]
        if before.task.version != task.version - 1:
            raise RuntimeError(f"task {task.id} changed under its lock")
        key = (task.id, task.state, task.version)
        if transition.notify and key in self.data.outbox_keys:
            raise StoreRace(f"notification {key} exists")
        task = insert_only_kept(before.task, task)
        if transition.notify:  # its row's finished_at_ms (as in SQL, which writes it with the notification)
            task = replace(task, ended_at_ms=int(notify_at_ms))
        self.data.tasks[task.id] = replace(before, task=task)
        history = self.data.entries[task.id]
        history.append((entry.version, encoded_event))

        def undo() -> None:
            self.data.tasks[task.id] = before
            history.pop()

        self.undo.append(undo)
        if transition.notify:
            notification = Notification(task.id, task.state, int(notify_at_ms), task.version)
            self.data.outbox_ids += 1
            outbox_id = self.data.outbox_ids
            self.data.outbox.append((outbox_id, notification, False))
            self.data.outbox_keys.add(key)
            self.data.relay[outbox_id] = (None, 0, 0)
            self.data.finished[task.id] = int(notify_at_ms)

            def forget() -> None:
                self.data.outbox.pop()
                self.data.outbox_keys.discard(key)
                self.data.relay.pop(outbox_id)
                self.data.finished.pop(task.id)

            self.undo.append(forget)

    async def record_many(self, items: Sequence[tuple[Transition, bytes, float]]) -> None:
        for transition, encoded_event, notify_at_ms in items:
            await self.record(transition, encoded_event, notify_at_ms)

    async def write_tasks(self, tasks: Sequence[Task]) -> None:
        for task in tasks:
            before = self.data.tasks[task.id]
            if before.task.version != task.version:
                raise RuntimeError(f"task {task.id} changed under its lock")
            self.data.tasks[task.id] = replace(before, task=insert_only_kept(before.task, task))
            self.undo.append(functools.partial(self.data.tasks.__setitem__, task.id, before))

    async def claim_due(self, now_ms: int, limit: int) -> list[Task]:
        lease_first = {s.task.id for s, until in self._leased() if until < s.task.expires_at_ms}
        due = [
            s.task
            for s in self.data.tasks.values()
            if s.task.state in ACTIVE_STATES
            and s.task.expires_at_ms <= now_ms
            and s.task.id not in lease_first
        ]
        due.sort(key=lambda t: t.expires_at_ms)
        return due[:limit]

    async def renew_leases(self, leases: Sequence[tuple[str, int]]) -> None:
        for task_id, until_ms in leases:
            before = self.data.tasks[task_id]
            self.data.tasks[task_id] = replace(before, lease_until_ms=until_ms)
            self.undo.append(functools.partial(self.data.tasks.__setitem__, task_id, before))

    async def claim_leases(self, now_ms: int, limit: int) -> list[StoredTask]:
        ended = sorted((until, s.task.id, s) for s, until in self._leased() if until <= now_ms)
        return [s for _, _, s in ended[:limit]]

    async def callback_digest(self, callback_id: str) -> str | None:
        seen = self.data.callbacks.get(callback_id)
        return None if seen is None else seen[0]

    async def insert_callback(self, callback_id: str, task_id: str, at_ms: int, digest: str) -> None:
        if callback_id in self.data.callbacks:
            raise StoreRace(f"callback {callback_id} exists")
        self.data.callbacks[callback_id] = (digest, task_id)
        self.undo.append(lambda: self.data.callbacks.pop(callback_id))

    async def callback_digests(self, callback_ids: Sequence[str]) -> dict[str, str]:
        seen = self.data.callbacks
        return {i: seen[i][0] for i in callback_ids if i in seen}

    async def insert_callbacks(self, rows: Sequence[tuple[str, str, int, str]]) -> None:
        for callback_id, task_id, at_ms, digest in rows:
            await self.insert_callback(callback_id, task_id, at_ms, digest)

    async def receipt(self, idempotency_key: str) -> Receipt | None:
        return self.data.receipts.get(idempotency_key)

    async def insert_receipt(self, receipt: Receipt) -> None:
        key = receipt.idempotency_key
        if key in self.data.receipts:
            raise StoreRace(f"receipt {key} exists")
        self.data.receipts[key] = receipt
        self.undo.append(lambda: self.data.receipts.pop(key))

    async def drain(self, now_ms: int, limit: int) -> list[tuple[int, Notification]]:
        before = list(self.data.outbox)
        taken = [(i, n) for i, n, drained in before if not drained][:limit]
        ids = {i for i, _ in taken}
        self.data.outbox[:] = [(i, n, drained or i in ids) for i, n, drained in before]
        self.undo.append(lambda: self.data.outbox.__setitem__(slice(None), before))
        return taken

    async def drain_pending(self) -> bool:
        return any(not drained for _, _, drained in self.data.outbox)

    async def drain_batch(self, idempotency_key: str) -> DrainBatch | None:
        return self.data.drain_batches.get(idempotency_key)

    async def insert_drain_batch(self, batch: DrainBatch) -> None:
        key = batch.idempotency_key
        if key in self.data.drain_batches:
            raise StoreRace(f"drain batch {key} exists")
        self.data.drain_batches[key] = batch
        self.undo.append(lambda: self.data.drain_batches.pop(key))

    async def forget_drain_batch(self, idempotency_key: str) -> None:
        batch = self.data.drain_batches.pop(idempotency_key, None)
        if batch is not None:
            self.undo.append(lambda: self.data.drain_batches.__setitem__(idempotency_key, batch))

    async def forget_drain_batches(self, made_before_ms: int, limit: int) -> int:
        old = sorted(
            (b for b in self.data.drain_batches.values() if b.made_at_ms < made_before_ms),
            key=lambda b: b.made_at_ms,
        )[:limit]
        for batch in old:
            await self.forget_drain_batch(batch.idempotency_key)
        return len(old)

    async def relay_pending(self) -> int:
        return sum(1 for relayed, _, _ in self.data.relay.values() if relayed is None)

    async def claim_relay(self, now_ms: int, lease_until_ms: int, limit: int) -> list[Outgoing]:
        notifications = {i: n for i, n, _ in self.data.outbox}
        due = sorted(
            (next_at, i)
            for i, (relayed, _, next_at) in self.data.relay.items()
            if relayed is None and next_at <= now_ms
        )[:limit]
        claimed = []
        for _, i in due:
            _, attempts, _ = self._set_relay(i, lambda r: (None, r[1] + 1, lease_until_ms))
            claimed.append(Outgoing(i, notifications[i], attempts))
        return claimed

    async def relay_sent(self, outbox_ids: Sequence[int], now_ms: int) -> None:
        for i in set(outbox_ids):
            if i in self.data.relay and self.data.relay[i][0] is None:
                self._set_relay(i, lambda r: (now_ms, r[1], r[2]))

    async def relay_later(self, outbox_id: int, next_at_ms: int) -> None:
        if outbox_id in self.data.relay and self.data.relay[outbox_id][0] is None:
            self._set_relay(outbox_id, lambda r: (None, r[1], next_at_ms))

    def _set_relay(
        self, outbox_id: int, change: Callable[[tuple[int | None, int, int]], tuple[int | None, int, int]]
    ) -> tuple[int | None, int, int]:
        before = self.data.relay[outbox_id]
        after = self.data.relay[outbox_id] = change(before)
        self.undo.append(lambda: self.data.relay.__setitem__(outbox_id, before))
        return after

    async def finished_held(self, cutoff_ms: int, *, relay: bool) -> int:
        untaken = self.data.untaken(relay=relay)
        return sum(1 for task_id, at in self.data.finished.items() if at <= cutoff_ms and task_id in untaken)

    async def claim_finished(
        self, cutoff_ms: int, after: tuple[int, str] | None, limit: int, *, relay: bool
    ) -> list[tuple[int, str]]:
        untaken = self.data.untaken(relay=relay)
        due = sorted(
            (at, task_id)
            for task_id, at in self.data.finished.items()
            if at <= cutoff_ms
            and (after is None or (at, task_id) > after)
            and task_id not in untaken
            and self.data.tasks[task_id].task.parent not in self.data.tasks  # a child outlives its parent
        )
        return due[:limit]

    async def forget(self, task_ids: Sequence[str]) -> int:
        ids = set(task_ids)
        gone = sum(1 for i in ids if i in self.data.tasks)
        self.undo.append(self.data.forget(ids))
        return gone

    async def notify(self, channel: str, payloads: Sequence[str]) -> None:
        raise NotImplementedError("the in-memory store has no NOTIFY")
