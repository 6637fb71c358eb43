"""One conformance suite for every store: the in-memory twin, SQLite and PostgreSQL.

Each test drives the store interface (``gateway.store.base``) directly, or the book over it where the
property is the book's (expiry by concurrent passes), and checks what a user of the gateway would see if
the store got it wrong: a lost or doubled entry, a callback applied twice, a notification drained twice, a
rolled-back change left behind.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import asyncpg  # type: ignore[import-untyped]
import orjson
import pytest
import sqlalchemy

from gateway.book.beside import Beside
from gateway.book.book import EXPIRY_BATCH, Book, CallbackRequest
from gateway.book.drain import KEEP_MS, Drained
from gateway.book.stream_reads import StreamReads, Text
from gateway.book.tag_reads import TagReads
from gateway.errors import Conflict, GatewayError, UnknownTask
from gateway.jobs.retention import Retention
from gateway.jobs.sweeper import sweep_once
from gateway.machine import (
    Fail,
    Progress,
    Start,
    Succeed,
    apply_event,
    cancel_task,
    create_task,
    event_to_json,
    expire_task,
)
from gateway.store import Database
from gateway.store.base import DrainBatch, Receipt, Store, StoreRace, StreamWrites, WriteTx
from gateway.store.memory import MemoryStore
from gateway.store.sql import SqlStore
from gateway.store.transaction import SqlTx
from gateway.streams import Append, Batch, Chunks, Head
from gateway.task_times import stamped
from gateway.web.render import notifications_body
from tests.support import FakeClock, opened, postgres_database

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["memory", "sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "memory":
        yield "memory"
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
    else:
        with postgres_database() as url:
            yield url


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[Store]:
    async with opened(MemoryStore() if store_url == "memory" else SqlStore(Database(store_url))) as made:
        yield made


def queued(task_id: str, *, now: int = 1_000, ttl_ms: int = 60_000, tags: tuple[str, ...] = ()) -> tuple:  # type: ignore[type-arg]
    task = create_task(id=task_id, now_ms=now, ttl_ms=ttl_ms, max_attempts=3)
    return replace(task, tags=tags, created_at_ms=now, epoch=f"epoch-{task_id}"[:32]), ttl_ms, now


async def add(store: Store, task_id: str, *, tags: tuple[str, ...] = (), **kwargs: int) -> None:
    task, ttl_ms, now = queued(task_id, tags=tags, **kwargs)
    async with store.write() as tx:
        await tx.insert_task(task, ttl_ms, now)


async def test_a_task_reads_back_as_written_and_an_id_is_taken_once(store: Store) -> None:
    await add(store, "t1", ttl_ms=5_000)
    async with store.read() as tx:
        stored = await tx.task("t1")
        assert stored is not None and stored.ttl_ms == 5_000
        assert stored.task == queued("t1", ttl_ms=5_000)[0]
        assert await tx.task("nope") is None
        assert await tx.task("nul\x00id") is None  # no task has one; PostgreSQL text cannot hold it
    with pytest.raises(StoreRace):
        await add(store, "t1")
    async with store.read() as tx:
        assert await tx.ahead({"t1": -1, "nope": -1}) == {"t1": 0}
        assert await tx.ahead({"t1": 0}) == {}
        assert await tx.ahead({}) == {}


TAGS = ("owner:u42", "project:7")


async def test_a_tasks_tags_and_creation_time_read_back_through_every_read_and_outlive_its_changes(
    store: Store,
) -> None:
    """Fixed at creation: every read of the task has them, and its epoch (a callback's locked read among
    them), and no transition, a deadline's or a lease's included, changes them."""
    await add(store, "tagged", tags=TAGS, now=1_234, ttl_ms=10)
    await add(store, "plain", now=1_500)
    async with store.read() as tx:
        tagged, plain = await tx.task("tagged"), await tx.task("plain")
        listed = await tx.list_tasks(state=None, after=None, limit=10)
    assert tagged is not None and (tagged.task.tags, tagged.task.created_at_ms) == (TAGS, 1_234)
    assert plain is not None and (plain.task.tags, plain.task.created_at_ms) == ((), 1_500)
    assert (tagged.task.epoch, plain.task.epoch) == ("epoch-tagged", "epoch-plain")
    assert listed == [plain.task, tagged.task]
    async with store.write() as tx:
        locked = await tx.lock_task("tagged")
        assert locked == tagged
        assert (await tx.lock_tasks(["tagged", "plain"])) == {"tagged": tagged, "plain": plain}
        start = apply_event(tagged.task, Start(1_240, "w1"))
        await tx.record(start, orjson.dumps(event_to_json(start.entry.event)), 1_240)  # type: ignore[union-attr]
    async with store.write() as tx:
        (due,) = await tx.claim_due(2_000, 10)
        assert (due.tags, due.created_at_ms, due.epoch, due.state) == (TAGS, 1_234, "epoch-tagged", "running")
        expired = expire_task(due)
        await tx.record(expired, orjson.dumps(event_to_json(expired.entry.event)), due.expires_at_ms)  # type: ignore[union-attr]
    async with store.read() as tx:
        after = await tx.task("tagged")
    # Its end is its notification's time, which the store keeps (finished_at_ms).
    ended = int(due.expires_at_ms)
    assert after is not None and after.task == replace(
        expired.task, tags=TAGS, created_at_ms=1_234, ended_at_ms=ended
    )
    assert after.task.epoch == "epoch-tagged"
    assert after.task.state == "expired"


async def test_a_transaction_that_raises_leaves_nothing_behind(store: Store) -> None:
    await add(store, "t1")
    start = apply_event(queued("t1")[0], Start(2_000, "w1"))
    with pytest.raises(RuntimeError, match="boom"):
        async with store.write() as tx:
            locked = await tx.lock_task("t1")
            assert locked is not None
            await tx.record(start, orjson.dumps(event_to_json(start.entry.event)), 2_000)  # type: ignore[union-attr]
            await tx.insert_callback("cb-1", "t1", 2_000, "digest")
            await tx.insert_task(queued("t2")[0], 60_000, 1_000)
            raise RuntimeError("boom")
    async with store.read() as tx:
        assert (await tx.task("t1")).task.version == 0  # type: ignore[union-attr]
        assert await tx.entries("t1", 0, 100) == []
        assert await tx.task("t2") is None
    async with store.write() as tx:
        assert await tx.callback_digest("cb-1") is None


async def test_entries_append_in_order_with_the_task_and_the_outbox(store: Store) -> None:
    await add(store, "t1")
    task = queued("t1")[0]
    encoded: list[bytes] = []
    for event in (Start(2_000, "w1"), Progress(2_100, 50, "c"), Progress(2_200, 70, "d")):
        transition = apply_event(task, event)
        raw = orjson.dumps(event_to_json(event))
        async with store.write() as tx:
            await tx.lock_task("t1")
            await tx.record(transition, raw, event.at_ms)
        task = transition.task
        encoded.append(raw)
    expired = expire_task(task)
    async with store.write() as tx:
        await tx.record(expired, orjson.dumps(event_to_json(expired.entry.event)), 9_999)  # type: ignore[union-attr]
    async with store.read() as tx:
        # Its end is its notification's time, kept with it (retention counts from it).
        assert (await tx.task("t1")).task == replace(expired.task, ended_at_ms=9_999)  # type: ignore[union-attr]
        assert [v for v, _ in await tx.entries("t1", 0, 100)] == [1, 2, 3, 4]
        assert await tx.entries("t1", 1, 3) == [(2, encoded[1]), (3, encoded[2])]
    async with store.write() as tx:
        drained = await tx.drain(10_000, 1_000)
    assert [(n.task_id, n.state, n.at_ms, n.version) for _, n in drained] == [("t1", "expired", 9_999, 4)]
    # A stale transition (written against an old version) is refused, never written over a newer row.
    with pytest.raises(RuntimeError, match="changed under its lock"):
        async with store.write() as tx:
            await tx.record(apply_event(queued("t1")[0], Start(3_000, "w2")), b"{}", 3_000)


async def test_callback_ids_and_receipts_are_kept_once(store: Store) -> None:
    await add(store, "t1")
    async with store.write() as tx:
        await tx.insert_callback("cb-1", "t1", 2_000, "d1")
        receipt = Receipt("t1", "s3://r", "sha256:1", "key-1", 3_000)
        await tx.insert_receipt(receipt)
    async with store.write() as tx:
        assert await tx.callback_digest("cb-1") == "d1"
        assert await tx.callback_digest("cb-2") is None
        assert await tx.receipt("key-1") == receipt
        assert await tx.receipt("key-2") is None
    with pytest.raises(StoreRace):
        async with store.write() as tx:
            await tx.insert_callback("cb-1", "t1", 2_001, "d2")
    with pytest.raises(StoreRace):
        async with store.write() as tx:
            await tx.insert_receipt(Receipt("t1", "x", "y", "key-1", 4_000))


async def test_a_drain_takes_each_notification_once_and_a_failed_drain_gives_them_back(store: Store) -> None:
    for task_id in ("a", "b"):
        await add(store, task_id, ttl_ms=10)
        async with store.write() as tx:
            (task,) = await tx.claim_due(2_000, 10)
            transition = expire_task(task)
            await tx.record(transition, b'{"type":"expire","atMs":1010}', task.expires_at_ms)
    with pytest.raises(RuntimeError):
        async with store.write() as tx:
            assert len(await tx.drain(5_000, 1_000)) == 2
            raise RuntimeError("the answer never left")
    async with store.write() as tx:
        first = await tx.drain(6_000, 1_000)
    async with store.write() as tx:
        second = await tx.drain(7_000, 1_000)
    assert sorted(n.task_id for _, n in first) == ["a", "b"]
    assert second == []


async def test_claim_due_takes_live_overdue_tasks_earliest_first(store: Store) -> None:
    for i, ttl in enumerate([30, 10, 20, 10_000]):
        await add(store, f"t{i}", ttl_ms=ttl)
    async with store.write() as tx:
        due = await tx.claim_due(1_000 + 25, 10)
        assert [t.id for t in due] == ["t1", "t2"]
        assert [t.id for t in await tx.claim_due(1_000 + 100, 2)] == ["t1", "t2"]


async def test_next_deadline_is_the_earliest_of_the_live_tasks(store: Store) -> None:
    async with store.read() as tx:
        assert await tx.next_deadline() is None
    for i, ttl in enumerate([30, 10, 20]):
        await add(store, f"t{i}", ttl_ms=ttl)
    async with store.read() as tx:
        assert await tx.next_deadline() == 1_010
    async with store.write() as tx:
        (task,) = await tx.claim_due(1_010, 1)
        await tx.record(expire_task(task), b'{"type":"expire","atMs":1010}', task.expires_at_ms)
    async with store.read() as tx:
        assert await tx.next_deadline() == 1_020  # an expired task's deadline is behind it


@pytest.fixture(params=["memory", "sqlite"])
async def turn_taking_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """The stores whose writes take turns (PostgreSQL has none: rows are locked, expiry skips locked ones)."""
    made: Store = (
        MemoryStore() if request.param == "memory" else SqlStore(Database(f"sqlite:///{tmp_path / 's.db'}"))
    )
    async with opened(made):
        yield made


async def test_expiry_goes_before_the_writes_waiting_for_their_turn(turn_taking_store: Store) -> None:
    """Where writes take turns (SQLite, the in-memory twin), an expiry pass queued behind many writes
    (callback batches, creations) is the next to write, not the last: a stream of callbacks never starves
    expiry. Each kind keeps its own arrival order."""
    store = turn_taking_store
    clock = FakeClock(1_000)
    book = Book(store, clock)
    await add(store, "due", ttl_ms=10)
    clock.advance(100)
    order: list[str] = []
    holding = anyio.Event()
    release = anyio.Event()

    async def hold() -> None:
        async with store.write():
            holding.set()
            await release.wait()
        order.append("held")

    async def create(i: int) -> None:
        await book.create(f"new-{i}", 60_000, 1)
        order.append(f"create-{i}")

    async def expire() -> None:
        assert await book.expire_due() == 1
        order.append("expire")

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            await holding.wait()
            for i in range(5):
                tg.start_soon(create, i)
                await anyio.wait_all_tasks_blocked()
            tg.start_soon(expire)
            await anyio.wait_all_tasks_blocked()
            release.set()
    assert order == ["held", "expire", *(f"create-{i}" for i in range(5))]


class _CountingTx:
    """A write transaction that counts the calls made on it (the statements a transaction's work asks for)."""

    def __init__(self, tx: WriteTx, calls: list[str]) -> None:
        self._tx = tx
        self._calls = calls

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._tx, name)

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self._calls.append(name)
            return await real(*args, **kwargs)

        return counted


async def test_due_tasks_expire_in_set_based_batches_not_a_write_per_task(store: Store) -> None:
    """Issue 9: the sweeper wrote one transaction per task, queued behind callbacks, and left due tasks
    unexpired for seconds. A pass expires what is due a batch per transaction (EXPIRY_BATCH tasks), each
    with a few set-based calls on the store whatever the batch's size."""
    clock = FakeClock(1_000)
    book = Book(store, clock)
    due = 2 * EXPIRY_BATCH + 50
    async with store.write() as tx:
        for i in range(due):
            await tx.insert_task(
                create_task(id=f"due-{i:04d}", now_ms=1_000, ttl_ms=10, max_attempts=1), 10, 1_000
            )
    clock.advance(100)
    transactions: list[list[str]] = []
    real_transact = store.transact

    async def transact(work: Any, *, urgent: bool = False) -> Any:
        calls: list[str] = []
        transactions.append(calls)
        return await real_transact(lambda tx: work(_CountingTx(tx, calls)), urgent=urgent)

    store.transact = transact  # type: ignore[method-assign]
    try:
        assert await sweep_once(book) == due
    finally:
        del store.transact  # the class's method again
    assert len(transactions) == 3, [len(calls) for calls in transactions]  # 200, 200, then the last 50
    for calls in transactions:
        assert len(calls) <= 5, calls  # claim_due, record_many, (a bus's announce): not one per task
    async with store.read() as reading:
        stored = [await reading.task(f"due-{i:04d}") for i in (0, due // 2, due - 1)]
    assert all(s is not None and s.task.state == "expired" for s in stored)


async def test_concurrent_expiry_passes_expire_each_task_once(store: Store) -> None:
    """Several passes at once (processes sweeping together): every due task expired exactly once, with
    one notification each, and the passes' counts add up."""
    clock = FakeClock(1_000)
    book = Book(store, clock)
    for i in range(60):
        task_id = f"due-{i:02d}"
        async with store.write() as tx:
            await tx.insert_task(create_task(id=task_id, now_ms=1_000, ttl_ms=10, max_attempts=1), 10, 1_000)
    clock.advance(100)
    counts: list[int] = []

    async def sweep() -> None:
        total = 0
        while (n := await book.expire_due(7)) > 0:
            total += n
        counts.append(total)

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(sweep)
    assert sum(counts) == 60
    async with store.read() as reading:
        for i in range(60):
            entries = await reading.entries(f"due-{i:02d}", 0, 100)
            assert [orjson.loads(raw)["type"] for _, raw in entries] == ["expire"]
    notifications = (await book.drain(notifications_body)).taken
    assert sorted(n.task_id for n in notifications) == [f"due-{i:02d}" for i in range(60)]


async def test_notify_reaches_listeners_on_commit_only(store: Store, store_url: str) -> None:
    if not store_url.startswith("postgresql"):
        async with store.write() as tx:
            with pytest.raises(NotImplementedError):
                await tx.notify("task_gateway_test", ["x"])
        return
    heard: list[str] = []
    got = anyio.Event()
    listener = await asyncpg.connect(store_url, timeout=5)
    try:

        def hear(*args: object) -> None:
            heard.append(str(args[-1]))
            if len(heard) == 6:
                got.set()

        await listener.add_listener("task_gateway_test", hear)
        with pytest.raises(RuntimeError):
            async with store.write() as tx:
                await tx.notify("task_gateway_test", ["rolled back"])
                raise RuntimeError("roll back")
        async with store.write() as tx:
            await tx.notify("task_gateway_test", ["committed"])
            await tx.notify("task_gateway_test", [f"batch-{i}" for i in range(5)])
            assert heard == []  # not before the commit
        with anyio.fail_after(5):
            await got.wait()
        assert heard == ["committed"] + [f"batch-{i}" for i in range(5)]
    finally:
        await listener.close()


async def test_batch_reads_and_writes_match_the_single_ones(store: Store) -> None:
    """The set-based statements of group commit: locks and dedup lookups for many ids at once, several
    transitions of one task in one batch (their versions follow each other), many callback ids at once."""
    for task_id in ("b", "a", "c"):
        await add(store, task_id)
    async with store.write() as tx:
        locked = await tx.lock_tasks(["c", "a", "nope", "a"])
        assert sorted(locked) == ["a", "c"] and locked["a"].task == queued("a")[0]
        first = apply_event(locked["a"].task, Start(2_000, "w1"))
        second = apply_event(first.task, Progress(2_100, 30, "x"))
        third = apply_event(second.task, Progress(2_200, 60, "y"))
        other = apply_event(locked["c"].task, Start(2_050, "w2"))
        items = [(t, orjson.dumps(event_to_json(t.entry.event)), 0) for t in (first, other, second, third)]  # type: ignore[union-attr]
        await tx.record_many(items)
        await tx.insert_callbacks([("cb-1", "a", 2_000, "d1"), ("cb-2", "c", 2_050, "d2")])
    async with store.write() as tx:
        assert await tx.callback_digests(["cb-2", "cb-1", "cb-3"]) == {"cb-1": "d1", "cb-2": "d2"}
        assert (await tx.task("a")).task == third.task  # type: ignore[union-attr]
        assert (await tx.task("c")).task == other.task  # type: ignore[union-attr]
        assert [v for v, _ in await tx.entries("a", 0, 10)] == [1, 2, 3]
        assert [v for v, _ in await tx.entries("c", 0, 10)] == [1]
    with pytest.raises(StoreRace):
        async with store.write() as tx:
            await tx.insert_callbacks([("cb-4", "a", 3_000, "d4"), ("cb-1", "a", 3_000, "d1")])
    async with store.write() as tx:
        assert await tx.callback_digests(["cb-4"]) == {}  # the whole batch rolled back


async def test_a_group_commit_gives_each_callback_its_own_outcome(store: Store) -> None:
    book = Book(store, FakeClock())
    await book.create("a", 600_000, 3)
    outcomes = await book.callbacks(
        [
            CallbackRequest("a", lambda now: Start(now, "w1"), "s", "d1"),
            CallbackRequest("a", lambda now: Progress(now, 101, "c"), "bad", "d2", attempt=1),
            CallbackRequest("a", lambda now: Start(now, "w1"), "s", "d1"),
            CallbackRequest("a", lambda now: Progress(now, 40, "c"), "p", "d3", attempt=1),
            CallbackRequest("zz", lambda now: Start(now, "w1"), "u", "d4"),
        ]
    )
    reasons = [o.code if isinstance(o, GatewayError) else o.transition.reason for o in outcomes]
    assert reasons == ["started", "invalid-request", "duplicate-callback", "progress", "unknown-task"]
    async with store.read() as tx:
        assert [v for v, _ in await tx.entries("a", 0, 10)] == [1, 2]
    async with store.write() as tx:
        assert sorted(await tx.callback_digests(["s", "bad", "p", "u"])) == ["p", "s"]


# --- the webhook relay's claims on the outbox -----------------------------------------------------------


async def notified(store: Store, *task_ids: str) -> None:
    """A terminal notification for each of these tasks (each created and expired)."""
    for task_id in task_ids:
        await add(store, task_id, ttl_ms=10)
        async with store.write() as tx:
            (task,) = [t for t in await tx.claim_due(2_000, 100) if t.id == task_id]
            await tx.record(expire_task(task), b'{"type":"expire","atMs":1010}', task.expires_at_ms)


async def test_the_relay_and_the_drain_each_take_every_notification(store: Store) -> None:
    """Two consumers of one outbox: what the drain took is still to relay, and what the relay sent is
    still to drain. A claim leases what it takes (attempts counted); a lease that ran out, or a retry that
    fell due, is claimed again; a sent notification never."""
    await notified(store, "a", "b")
    async with store.write() as tx:
        assert [n.task_id for _, n in await tx.drain(3_000, 1_000)] == ["a", "b"]
    async with store.read() as tx:
        assert await tx.relay_pending() == 2
    async with store.write() as tx:
        claimed = await tx.claim_relay(10_000, 20_000, 10)
    assert [(c.notification.task_id, c.notification.state, c.attempt) for c in claimed] == [
        ("a", "expired", 1),
        ("b", "expired", 1),
    ]
    assert claimed[0].notification.at_ms == 1_010 and claimed[0].notification.version == 1
    async with store.write() as tx:
        assert await tx.claim_relay(19_999, 40_000, 10) == []  # leased until 20,000
        await tx.relay_sent([claimed[0].outbox_id], 15_000)
        await tx.relay_later(claimed[1].outbox_id, 30_000)  # b failed: tried again at 30,000
    async with store.read() as tx:
        assert await tx.relay_pending() == 1
    async with store.write() as tx:
        assert await tx.claim_relay(29_999, 40_000, 10) == []
        (again,) = await tx.claim_relay(30_000, 40_000, 10)
    assert (again.outbox_id, again.notification.task_id, again.attempt) == (claimed[1].outbox_id, "b", 2)
    async with store.write() as tx:
        await tx.relay_sent([again.outbox_id, again.outbox_id], 41_000)
        await tx.relay_later(again.outbox_id, 0)  # too late: a sent notification stays sent
    async with store.write() as tx:
        assert await tx.claim_relay(10**12, 10**12, 10) == []
    async with store.read() as tx:
        assert await tx.relay_pending() == 0
    await notified(store, "c")  # the drain still takes what the relay sent, and only that is new to it
    async with store.write() as tx:
        assert [n.task_id for _, n in await tx.drain(50_000, 1_000)] == ["c"]


async def test_a_rolled_back_claim_leaves_the_notification_unclaimed(store: Store) -> None:
    await notified(store, "a")
    with pytest.raises(RuntimeError):
        async with store.write() as tx:
            assert len(await tx.claim_relay(10_000, 20_000, 10)) == 1
            raise RuntimeError("the claim never committed")
    async with store.write() as tx:
        (claimed,) = await tx.claim_relay(10_000, 20_000, 10)
    assert claimed.attempt == 1


async def test_concurrent_relay_claims_take_each_notification_once(store: Store) -> None:
    """Relays claiming together (several processes on PostgreSQL: SKIP LOCKED and the lease written in the
    claiming transaction): every notification is claimed by exactly one of them."""
    task_ids = [f"n-{i:02d}" for i in range(40)]
    await notified(store, *task_ids)
    taken: list[int] = []

    async def claimer() -> None:
        while True:
            async with store.write() as tx:
                claimed = await tx.claim_relay(10_000, 10**12, 3)
            if not claimed:
                return
            taken.extend(c.outbox_id for c in claimed)
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(claimer)
    assert len(taken) == len(set(taken)) == 40


# --- drains: a batch at a time, and the answer of a keyed drain kept ---------------------------------------


async def test_a_drain_takes_the_oldest_pending_notifications_at_most_its_limit(store: Store) -> None:
    await notified(store, "e", "d", "c", "b", "a")  # queued in this order
    async with store.write() as tx:
        first = await tx.drain(3_000, 2)
        assert await tx.drain_pending()
    async with store.write() as tx:
        rest = await tx.drain(3_000, 10)
        assert not await tx.drain_pending()
    assert [n.task_id for _, n in sorted(first)] == ["e", "d"]
    assert [n.task_id for _, n in sorted(rest)] == ["c", "b", "a"]


async def test_drain_batches_are_kept_once_per_key_and_forgotten_oldest_first(store: Store) -> None:
    # Bodies as sent: any bytes, kept exactly (a megabyte, UTF-8 beyond ASCII).
    bodies = [
        orjson.dumps([{"taskId": f"caf\u00e9-{i}" * 100_000 if i == 2 else f"t-{i}"}]) for i in range(5)
    ]
    batches = [DrainBatch(f"k-{i}", 1_000 + i, i % 2 == 0, body) for i, body in enumerate(bodies)]
    async with store.write() as tx:
        for batch in batches:
            await tx.insert_drain_batch(batch)
    with pytest.raises(StoreRace):
        async with store.write() as tx:
            await tx.insert_drain_batch(DrainBatch("k-0", 9_000, False, b"[]"))
    async with store.write() as tx:
        assert [await tx.drain_batch(b.idempotency_key) for b in batches] == batches
        assert await tx.drain_batch("k-9") is None
        assert await tx.forget_drain_batches(1_003, 2) == 2  # of k-0, k-1, k-2: the two oldest
        await tx.forget_drain_batch("k-3")
        await tx.forget_drain_batch("k-9")  # none: nothing happens
    with pytest.raises(RuntimeError):
        async with store.write() as tx:
            assert await tx.forget_drain_batches(10_000, 10) == 2
            raise RuntimeError("rolled back")
    async with store.write() as tx:
        kept = [await tx.drain_batch(b.idempotency_key) for b in batches]
    assert kept == [None, None, batches[2], None, batches[4]]


async def forget_drained_notifications(store: Store) -> None:
    """Delete the outbox rows drained so far, as retention does once a task is old enough."""
    if isinstance(store, MemoryStore):
        store._data.outbox[:] = [row for row in store._data.outbox if not row[2]]
        return
    async with store.write() as tx:
        assert isinstance(tx, SqlTx)
        await tx.run("DELETE FROM outbox WHERE drained_at_ms IS NOT NULL")


async def test_a_keyed_drain_answers_its_batch_again_byte_for_byte_for_a_day(store: Store) -> None:
    clock = FakeClock(10_000)
    book = Book(store, clock)
    await notified(store, "a", "b")
    first = await book.drain(notifications_body, limit=1, idempotency_key="k1")
    assert (first.more, first.replayed, [n.task_id for n in first.taken]) == (True, False, ["a"])
    await notified(store, "c")
    other = await book.drain(notifications_body, idempotency_key="k2")
    assert (other.more, [n.task_id for n in other.taken]) == (False, ["b", "c"])
    # Whatever was drained since, and with the notifications' rows gone: what k1 answered, as it was.
    await forget_drained_notifications(store)
    clock.advance(KEEP_MS - 1)
    again = await book.drain(notifications_body, limit=50, idempotency_key="k1")
    assert (again.body, again.more, again.taken, again.replayed) == (first.body, True, (), True)
    assert orjson.loads(again.body) == [{"taskId": "a", "state": "expired", "atMs": 1_010, "version": 1}]
    # A day after it was made, the key takes what is new; that drain deleted the other old batches.
    clock.advance(1)
    await notified(store, "d")
    later = await book.drain(notifications_body, idempotency_key="k1")
    assert (later.replayed, [n.task_id for n in later.taken]) == (False, ["d"])
    async with store.write() as tx:
        assert await tx.drain_batch("k2") is None
        kept = await tx.drain_batch("k1")
    assert kept is not None and (kept.made_at_ms, kept.body) == (clock.now, later.body)


async def test_drains_with_one_new_key_answer_one_batch_and_with_other_keys_take_others(store: Store) -> None:
    """Drains at once (several processes on PostgreSQL): with the same new key, one takes a batch and the
    others answer it (a lost race on the key, run again); with different keys, no notification twice."""
    book = Book(store, FakeClock(10_000))
    task_ids = [f"n-{i:02d}" for i in range(30)]
    await notified(store, *task_ids)
    shared: list[Drained] = []

    async def drain_shared() -> None:
        shared.append(await book.drain(notifications_body, limit=5, idempotency_key="shared"))

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(drain_shared)
    assert len({d.body for d in shared}) == 1
    assert sorted(d.replayed for d in shared) == [False, True, True, True]
    taken = [n.task_id for d in shared for n in d.taken]
    assert len(taken) == 5

    async def drainer(name: str) -> None:
        for n in range(100):
            drained = await book.drain(notifications_body, limit=3, idempotency_key=f"{name}-{n}")
            assert not drained.replayed
            taken.extend(n.task_id for n in drained.taken)
            if not drained.taken and not drained.more:
                return
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        for name in "wxyz":
            tg.start_soon(drainer, name)
    assert sorted(taken) == task_ids


async def test_the_task_list_pages_through_every_task_once_in_id_order(store: Store) -> None:
    ids = [f"task-{n:02d}" for n in range(12)]
    for task_id in reversed(ids):  # inserted out of order: the order is the ids', not the insertions'
        await add(store, task_id)
    start = apply_event(queued("task-03")[0], Start(2_000, "w1"))
    async with store.write() as tx:
        await tx.record(start, orjson.dumps(event_to_json(start.entry.event)), 2_000)  # type: ignore[union-attr]

    seen: list[str] = []
    after: str | None = None
    while True:
        async with store.read() as tx:
            page = await tx.list_tasks(state=None, after=after, limit=5)
        seen += [t.id for t in page]
        if len(page) < 5:
            break
        after = page[-1].id
    assert seen == ids
    async with store.read() as tx:
        assert [t.id for t in await tx.list_tasks(state="running", after=None, limit=5)] == ["task-03"]
        running = (await tx.list_tasks(state="running", after=None, limit=5))[0]
        assert running == start.task  # the whole task, as stored
        queued_ids = [t.id for t in await tx.list_tasks(state="queued", after="task-09", limit=5)]
        assert queued_ids == ["task-10", "task-11"]
        assert await tx.list_tasks(state="succeeded", after=None, limit=5) == []
        assert await tx.list_tasks(state=None, after="task-11", limit=5) == []


async def test_the_task_list_newest_first_pages_by_creation_time_then_id(store: Store) -> None:
    for task_id, now in (("m", 1_000), ("a", 3_000), ("z", 2_000), ("b", 2_000), ("c", 4_000)):
        await add(store, task_id, now=now)
    start = apply_event(queued("z", now=2_000)[0], Start(2_500, "w1"))
    async with store.write() as tx:
        await tx.record(start, orjson.dumps(event_to_json(start.entry.event)), 2_500)  # type: ignore[union-attr]

    async def page(**kwargs: Any) -> list[str]:
        async with store.read() as reading:
            query = {"state": None, "before": None, "limit": 10, **kwargs}
            return [t.id for t in await reading.newest_tasks(**query)]

    assert await page() == ["c", "a", "z", "b", "m"]  # not the ids' order: the creation times'
    assert await page(limit=2) == ["c", "a"]
    assert await page(before=(3_000, "a"), limit=2) == ["z", "b"]  # two at one time: the greater id first
    assert await page(before=(2_000, "z")) == ["b", "m"]
    assert await page(before=(-1, "")) == []
    assert await page(state="running") == ["z"]
    assert await page(state="queued", before=(2_000, "z")) == ["b", "m"]
    async with store.read() as reading:
        (whole,) = await reading.newest_tasks(state="running", before=None, limit=10)
    assert whole == start.task  # the whole task, as stored


@pytest.fixture
async def sql_store(database_url: str) -> AsyncIterator[SqlStore]:
    async with opened(SqlStore(Database(database_url))) as made:
        yield made


async def test_an_update_writes_only_the_columns_that_changed(sql_store: SqlStore) -> None:
    """A batch of progress callbacks sets progress and version, not the seven columns that stayed (nor the
    tags and creation time, which no update sets)."""
    for task_id in ("a", "b"):
        await add(sql_store, task_id, tags=TAGS)
    async with sql_store.write() as tx:
        locked = await tx.lock_tasks(["a", "b"])
        started = {i: apply_event(locked[i].task, Start(2_000, "w1")) for i in ("a", "b")}
        await tx.record_many([(t, b'{"type":"start"}', 0) for t in started.values()])
    updates: list[str] = []

    def traced(statement: str) -> None:
        if "UPDATE tasks" in statement:
            updates.append(statement)

    def logged(query: Any) -> None:
        traced(query.query)

    def checked_out(dbapi_connection: Any, *args: object) -> None:
        dbapi_connection.driver_connection.add_query_logger(logged)

    def checked_in(dbapi_connection: Any, *args: object) -> None:
        dbapi_connection.driver_connection.remove_query_logger(logged)

    writer = sql_store.db.writer
    engine = sql_store.db.engine.sync_engine
    if writer is not None:  # a SQLite file's writes go through the writer's own connection
        writer.trace(traced)
    else:  # PostgreSQL's go on asyncpg's connections of the pool
        sqlalchemy.event.listen(engine, "checkout", checked_out)
        sqlalchemy.event.listen(engine, "checkin", checked_in)
    try:
        async with sql_store.write() as tx:
            locked = await tx.lock_tasks(["a", "b"])
            moved = [apply_event(locked[i].task, Progress(2_100, 40, "x")) for i in ("a", "b")]
            await tx.record_many([(t, b'{"type":"progress"}', 0) for t in moved])
        async with sql_store.write() as tx:
            locked = await tx.lock_tasks(["a"])
            await tx.record(
                apply_event(locked["a"].task, Progress(2_200, 70, "y")), b'{"type":"progress"}', 0
            )
    finally:
        if writer is not None:
            writer.trace(None)
        else:
            sqlalchemy.event.remove(engine, "checkout", checked_out)
            sqlalchemy.event.remove(engine, "checkin", checked_in)
    # One statement per set of changed columns (the writer's trace shows each row of it apart).
    assert len(updates) == (3 if writer is not None else 2)
    for statement in updates:
        assigned = statement.split(" SET ", 1)[1].split(" WHERE ", 1)[0].split(" FROM ", 1)[0]
        assert sorted(part.split("=")[0].strip() for part in assigned.split(",")) == ["progress", "version"]
    async with sql_store.read() as reading:
        a, b = await reading.task("a"), await reading.task("b")
    assert a is not None and (a.task.progress, a.task.version, a.task.state) == (70, 3, "running")
    assert b is not None and (b.task.progress, b.task.version, b.task.attempts) == (40, 2, 1)
    assert (a.task.tags, a.task.created_at_ms) == (TAGS, 1_000)


async def tag_rows(store: SqlStore) -> list[tuple[str, str, int]]:
    """The rows of ``task_tags``: (tag, task id, created at)."""
    async with store.db.read() as conn:
        rows = await conn.execute(sqlalchemy.text("SELECT tag, task_id, created_at_ms FROM task_tags"))
        return sorted((r[0], r[1], r[2]) for r in rows)


async def test_a_tasks_tags_are_rows_of_task_tags_written_once_and_deleted_with_it(
    sql_store: SqlStore,
) -> None:
    """One row per tag, with the task's creation time; a task without tags has none; retention's delete
    takes a task's rows with it and nobody else's."""
    await add(sql_store, "a", tags=TAGS, now=1_100)
    await add(sql_store, "b", tags=("owner:u42",), now=1_200)
    await add(sql_store, "c", now=1_300)
    with pytest.raises(StoreRace):  # the id is taken: neither its row nor its tags' rows are written
        await add(sql_store, "a", tags=("other",), now=1_400)
    assert await tag_rows(sql_store) == [
        ("owner:u42", "a", 1_100),
        ("owner:u42", "b", 1_200),
        ("project:7", "a", 1_100),
    ]
    async with sql_store.write() as tx:
        assert await tx.forget(["a", "c"]) == 2
    assert await tag_rows(sql_store) == [("owner:u42", "b", 1_200)]


# --- retention: finished tasks deleted with everything they own ----------------------------------------


async def finished(store: Store, task_id: str, *, at: int, key: str | None = None) -> None:
    """A task started (with a callback id) and succeeded at ``at`` (its notification's time), with a
    receipt under ``key``."""
    await add(store, task_id)
    async with store.write() as tx:
        stored = await tx.lock_task(task_id)
        assert stored is not None
        start = apply_event(stored.task, Start(at - 10, "w1"))
        done = apply_event(start.task, Succeed(at, "s3://r", "sha256:1"))
        await tx.record_many([(t, orjson.dumps(event_to_json(t.entry.event)), at) for t in (start, done)])  # type: ignore[union-attr]
        await tx.insert_callbacks(
            [(f"{task_id}-start", task_id, at - 10, "d1"), (f"{task_id}-done", task_id, at, "d2")]
        )
        if key is not None:
            await tx.insert_receipt(Receipt(task_id, "s3://r", "sha256:1", key, at + 1))


async def test_a_finished_task_is_forgotten_with_everything_it_owns_once_its_notification_was_taken(
    store: Store,
) -> None:
    """Retention's statements: a task is claimable from the time of its terminal entry, only once its
    notification was drained (or relayed, where a relay counts); forgetting it deletes its history,
    callback ids, receipts and notification, and nothing of any other task."""
    await finished(store, "gone", at=5_000, key="k-gone")
    await add(store, "live")
    async with store.write() as tx:
        assert await tx.claim_finished(10_000, None, 10, relay=False) == []  # not drained yet
        assert [n.task_id for _, n in await tx.drain(6_000, 1_000)] == ["gone"]
    await finished(store, "kept", at=5_000, key="k-kept")  # its notification is still to take
    async with store.read() as tx:
        assert await tx.finished_held(10_000, relay=False) == 1
        assert await tx.finished_held(4_999, relay=False) == 0
    async with store.write() as tx:
        assert await tx.claim_finished(4_999, None, 10, relay=False) == []  # finished after the cutoff
        assert await tx.claim_finished(5_000, None, 10, relay=False) == [(5_000, "gone")]
        assert await tx.forget(["gone", "never-was"]) == 1
    async with store.read() as tx:
        assert await tx.task("gone") is None
        assert await tx.entries("gone", 0, 100) == []
        assert await tx.ahead({"gone": -1, "kept": 1, "live": 0}) == {"kept": 2}
        assert [t.id for t in await tx.list_tasks(state=None, after=None, limit=10)] == ["kept", "live"]
        assert await tx.relay_pending() == 1  # kept's notification only
        assert await tx.finished_held(10_000, relay=False) == 1
    async with store.write() as tx:
        assert await tx.callback_digests(["gone-start", "gone-done", "kept-done"]) == {"kept-done": "d2"}
        assert await tx.receipt("k-gone") is None
        assert await tx.receipt("k-kept") is not None
        assert await tx.claim_finished(10_000, None, 10, relay=False) == []
        # The id is free again: a new task of that name starts a history of its own.
        await tx.insert_task(queued("gone")[0], 60_000, 1_000)
    # A relayed notification counts as taken where a relay sends them, not where the drain is the only way.
    async with store.write() as tx:
        (claimed,) = await tx.claim_relay(10_000, 20_000, 10)
        await tx.relay_sent([claimed.outbox_id], 11_000)
    async with store.write() as tx:
        assert await tx.claim_finished(10_000, None, 10, relay=False) == []
        assert await tx.claim_finished(10_000, None, 10, relay=True) == [(5_000, "kept")]
    async with store.read() as tx:
        assert await tx.finished_held(10_000, relay=True) == 0


async def test_a_task_finishes_when_its_terminal_entry_is_written_whatever_ends_it(store: Store) -> None:
    """Expiry (at the deadline), a group commit that ends several tasks, and a single record: each task's
    finishing time is its notification's; a task that did not end is never claimed."""
    await add(store, "expires", ttl_ms=10)  # deadline 1,010
    for task_id in ("a", "b", "runs"):
        await add(store, task_id)
    async with store.write() as tx:
        (due,) = await tx.claim_due(2_000, 10)
        await tx.record(expire_task(due), b'{"type":"expire"}', due.expires_at_ms)
        locked = await tx.lock_tasks(["a", "b", "runs"])
        started = {i: apply_event(s.task, Start(3_000, "w")) for i, s in locked.items()}
        ended = [
            apply_event(started["a"].task, Succeed(3_100, "r", "h")),
            apply_event(started["b"].task, Fail(3_200, "boom", False)),
        ]
        items = [
            (t, b"{}", at)
            for t, at in [*((s, 3_000) for s in started.values()), (ended[0], 3_100), (ended[1], 3_200)]
        ]
        await tx.record_many(items)
        await tx.drain(4_000, 1_000)
    async with store.write() as tx:
        assert await tx.claim_finished(10**6, None, 10, relay=False) == [
            (1_010, "expires"),
            (3_100, "a"),
            (3_200, "b"),
        ]
        # A batch goes on after the last one's last task.
        assert await tx.claim_finished(10**6, (1_010, "expires"), 1, relay=False) == [(3_100, "a")]
        assert await tx.claim_finished(3_150, (1_010, "expires"), 10, relay=False) == [(3_100, "a")]


async def test_a_rolled_back_forget_leaves_the_task_whole(store: Store) -> None:
    await finished(store, "t1", at=5_000, key="k1")
    async with store.write() as tx:
        await tx.drain(6_000, 1_000)
    with pytest.raises(RuntimeError):
        async with store.write() as tx:
            assert await tx.forget(["t1"]) == 1
            raise RuntimeError("never committed")
    async with store.read() as tx:
        assert (await tx.task("t1")) is not None
        assert [v for v, _ in await tx.entries("t1", 0, 10)] == [1, 2]
    async with store.write() as tx:
        assert await tx.callback_digests(["t1-done"]) == {"t1-done": "d2"}
        assert await tx.receipt("k1") is not None
        assert await tx.claim_finished(10_000, None, 10, relay=False) == [(5_000, "t1")]


async def test_a_deleted_notification_id_is_never_given_again(store: Store) -> None:
    """The relay marks what it sent by outbox id: a relay still sending a notification that retention
    deleted (drained, so taken) must not mark a newer one sent. SQLite would give the greatest rowid again
    once its row is gone, unless the table is AUTOINCREMENT."""
    await notified(store, "a")
    async with store.write() as tx:
        (sending,) = await tx.claim_relay(10_000, 20_000, 10)
        await tx.drain(10_000, 1_000)
        assert await tx.forget(["a"]) == 1
    await notified(store, "b")
    async with store.write() as tx:
        await tx.relay_sent([sending.outbox_id], 12_000)  # the POST of a's notification ended
    async with store.read() as tx:
        assert await tx.relay_pending() == 1  # b's is still to send
    async with store.write() as tx:
        (claimed,) = await tx.claim_relay(30_000, 40_000, 10)
    assert claimed.notification.task_id == "b" and claimed.outbox_id != sending.outbox_id


async def test_concurrent_retention_passes_delete_each_task_once(store: Store) -> None:
    """Passes at once (processes retaining together: SKIP LOCKED on PostgreSQL), in small batches: every
    task past retention whose notification was taken is deleted once, the others kept and counted."""
    for i in range(40):
        await finished(store, f"t-{i:02d}", at=5_000 + i)
    async with store.write() as tx:
        await tx.drain(6_000, 1_000)
    for i in range(5):
        await finished(store, f"u-{i}", at=5_000)  # not drained
    passes = [Retention(store, FakeClock(20_000), 10, relay=False, batch=3) for _ in range(3)]
    counts: list[int] = []

    async def sweep(retention: Retention) -> None:
        counts.append(await retention.sweep())

    async with anyio.create_task_group() as tg:
        for retention in passes:
            tg.start_soon(sweep, retention)
    assert sum(counts) == 40
    assert [r.held for r in passes] == [5, 5, 5]
    async with store.read() as reading:
        left = await reading.list_tasks(state=None, after=None, limit=100)
    assert [t.id for t in left] == [f"u-{i}" for i in range(5)]


# --- heartbeat leases (gateway.lease) -----------------------------------------------------------------------


async def started(
    store: Store, task_id: str, *, heartbeat_ms: int | None = 2_000, lease_until: int, ttl_ms: int = 60_000
) -> None:
    """A task created with ``heartbeat_ms`` at 1,000, started at 2,000, its lease ending at lease_until."""
    task, ttl_ms, now = queued(task_id, ttl_ms=ttl_ms)
    async with store.write() as tx:
        await tx.insert_task(task, ttl_ms, now, heartbeat_ms)
    start = apply_event(task, Start(2_000, "w1"))
    async with store.write() as tx:
        await tx.lock_task(task_id)
        await tx.record(start, orjson.dumps(event_to_json(start.entry.event)), 2_000)  # type: ignore[union-attr]
        await tx.renew_leases([(task_id, lease_until)])


async def test_a_lease_reads_back_with_its_task_and_a_rolled_back_renewal_leaves_it_as_it_was(
    store: Store,
) -> None:
    await started(store, "t1", lease_until=4_000)
    await add(store, "plain")
    async with store.read() as tx:
        stored = await tx.task("t1")
        plain = await tx.task("plain")
    assert stored is not None and (stored.heartbeat_ms, stored.lease_until_ms) == (2_000, 4_000)
    assert stored.task.state == "running" and stored.ttl_ms == 60_000
    assert plain is not None and (plain.heartbeat_ms, plain.lease_until_ms) == (None, None)
    with pytest.raises(RuntimeError):
        async with store.write() as tx:
            await tx.lock_tasks(["t1"])
            await tx.renew_leases([("t1", 9_000)])
            raise RuntimeError("the renewal never committed")
    async with store.write() as tx:
        locked = await tx.lock_tasks(["t1"])
        assert locked["t1"].lease_until_ms == 4_000
        # A transition keeps the lease beside the task (it is the row's, not the machine's).
        progress = apply_event(locked["t1"].task, Progress(3_000, 10, "c"))
        await tx.record(progress, orjson.dumps(event_to_json(progress.entry.event)), 3_000)  # type: ignore[union-attr]
        await tx.renew_leases([("t1", 5_000)])
    async with store.read() as tx:
        after = await tx.task("t1")
    assert after is not None and after.task == progress.task
    assert (after.heartbeat_ms, after.lease_until_ms) == (2_000, 5_000)


async def test_claim_leases_takes_running_attempts_whose_lease_ended_earliest_first(store: Store) -> None:
    async with store.read() as tx:
        assert await tx.next_lease_end() is None
    for task_id, until in (("late", 9_000), ("b", 5_000), ("a", 4_000), ("c", 5_500)):
        await started(store, task_id, lease_until=until)
    await add(store, "queued")  # no lease
    async with store.read() as tx:
        assert await tx.next_lease_end() == 4_000
    async with store.write() as tx:
        assert [s.task.id for s in await tx.claim_leases(5_000, 10)] == ["a", "b"]
        assert [s.task.id for s in await tx.claim_leases(6_000, 2)] == ["a", "b"]
        (first,) = await tx.claim_leases(6_000, 1)
        assert (first.task.state, first.lease_until_ms, first.heartbeat_ms) == ("running", 4_000, 2_000)
        # A task that is no longer running holds no lease, whatever its row says.
        requeued = apply_event(first.task, Fail(6_000, "oops", True))
        await tx.record(requeued, orjson.dumps(event_to_json(requeued.entry.event)), 6_000)  # type: ignore[union-attr]
    async with store.write() as tx:
        assert [s.task.id for s in await tx.claim_leases(6_000, 10)] == ["b", "c"]
    async with store.read() as tx:
        assert await tx.next_lease_end() == 5_000


async def test_claim_due_leaves_a_task_whose_lease_ended_before_its_deadline_to_the_lease_claim(
    store: Store,
) -> None:
    """An expiry claim (another process's, an overlapping pass's) never takes a running task whose lease ran
    out before its deadline: expired, it would lose the heartbeat-timeout fail from its history, and a last
    attempt would read expired instead of failed. The lease claim takes it, and the deadline then finds it
    requeued (or ended). A lease that ends at or after the deadline leaves the task to either claim: the
    deadline comes first."""
    await add(store, "queued", ttl_ms=4_000)  # deadline 5,000
    await started(store, "lease-first", lease_until=4_000, ttl_ms=5_000)  # deadline 6,000
    await started(store, "deadline-first", lease_until=7_000, ttl_ms=5_500)  # deadline 6,500
    async with store.write() as tx:
        assert [t.id for t in await tx.claim_due(10_000, 10)] == ["queued", "deadline-first"]
        assert [s.task.id for s in await tx.claim_leases(10_000, 10)] == ["lease-first", "deadline-first"]
        (ended,) = await tx.claim_leases(10_000, 1)
        requeued = apply_event(ended.task, Fail(4_000, "heartbeat-timeout", True))
        await tx.record(requeued, orjson.dumps(event_to_json(requeued.entry.event)), 4_000)  # type: ignore[union-attr]
    async with store.write() as tx:  # requeued: the deadline's now
        assert [t.id for t in await tx.claim_due(10_000, 10)] == ["queued", "lease-first", "deadline-first"]


async def test_concurrent_lease_claims_end_each_lease_once(store: Store) -> None:
    """Sweepers ending leases together (several processes: SKIP LOCKED): each lease ended exactly once,
    with one heartbeat-timeout fail each."""
    clock = FakeClock(1_000)
    book = Book(store, clock)
    for i in range(40):
        await started(store, f"l-{i:02d}", lease_until=3_000 + i)
    clock.advance(10_000)
    counts: list[int] = []

    async def sweep() -> None:
        total = 0
        while (n := await book.end_leases(7)) > 0:
            total += n
        counts.append(total)

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(sweep)
    assert sum(counts) == 40
    async with store.read() as reading:
        for i in range(40):
            history = [orjson.loads(raw) for _, raw in await reading.entries(f"l-{i:02d}", 0, 100)]
            assert [e["type"] for e in history] == ["start", "fail"]
            assert history[-1] == {
                "type": "fail",
                "atMs": 3_000 + i,
                "error": "heartbeat-timeout",
                "retryable": True,
            }


# --- tags: a tag's tasks, those created since a time, many resumes at once ---------------------------------


async def test_a_tags_tasks_are_listed_newest_first_and_since_a_time(store: Store) -> None:
    await add(store, "a", tags=TAGS, now=1_000)
    await add(store, "b", tags=("owner:u42",), now=2_000)
    await add(store, "c", tags=("owner:u42",), now=2_000)  # created with b: the greater id first
    await add(store, "d", tags=("project:7",), now=3_000)
    await add(store, "e", now=4_000)
    await add(store, "f", tags=("owner:u420",), now=5_000)  # another tag, however alike
    async with store.read() as tx:
        assert await tx.tagged("owner:u42", 10) == ["c", "b", "a"]
        assert await tx.tagged("owner:u42", 2) == ["c", "b"]
        assert await tx.tagged("project:7", 10) == ["d", "a"]
        assert await tx.tagged("nobody", 10) == []
        assert await tx.tagged("nul\x00tag", 10) == []
        assert await tx.tagged_since(["project:7", "owner:u42", "nobody"], 2_000) == [
            ("owner:u42", "b", "epoch-b"),
            ("owner:u42", "c", "epoch-c"),
            ("project:7", "d", "epoch-d"),
        ]
        assert await tx.tagged_since(["owner:u42"], 0) == [("owner:u42", t, f"epoch-{t}") for t in "abc"]
        assert await tx.tagged_since(["owner:u42"], 2_001) == []
        assert await tx.tagged_since([], 0) == []
    async with store.write() as tx:
        assert await tx.forget(["a", "c"]) == 2
    async with store.read() as tx:
        assert await tx.tagged("owner:u42", 10) == ["b"]
        assert await tx.tagged_since(["project:7", "owner:u42"], 0) == [
            ("owner:u42", "b", "epoch-b"),
            ("project:7", "d", "epoch-d"),
        ]


async def progressed(store: Store, task_id: str, entries: int, *, tags: tuple[str, ...] = ()) -> None:
    """A task started and moved on ``entries`` - 1 times: at version ``entries``."""
    await add(store, task_id, tags=tags)
    for n in range(entries):
        async with store.write() as tx:
            stored = await tx.lock_task(task_id)
            assert stored is not None
            event = Start(2_000, "w1") if n == 0 else Progress(2_000 + n, n, f"c{n}")
            moved = apply_event(stored.task, event)
            await tx.record(moved, orjson.dumps(event_to_json(event)), 2_000 + n)


async def test_resume_rows_give_each_task_the_entries_its_cursor_missed(store: Store) -> None:
    """Within the retention: the entries after the cursor; level with the task, more than a retention
    behind, or ahead: none (those are caught-up or snapshots); a task that does not exist: left out."""
    for task_id in ("behind", "level", "far", "ahead", "edge"):
        await progressed(store, task_id, 5)
    await add(store, "fresh")
    cursors = {"behind": 4, "edge": 2, "far": 1, "level": 5, "ahead": 9, "fresh": 0, "gone": 0, "nul\x00": 0}
    async with store.read() as tx:
        rows = await tx.resume_rows(cursors, 3)
        whole = {task_id: await tx.entries(task_id, 0, 5) for task_id in ("behind", "edge")}
        tasks = {task_id: await tx.task(task_id) for task_id in cursors}
        assert await tx.resume_rows({}, 3) == {}
    assert sorted(rows) == ["ahead", "behind", "edge", "far", "fresh", "level"]
    for task_id, (task, _) in rows.items():
        assert task == tasks[task_id].task  # type: ignore[union-attr]
    assert {task_id: [v for v, _ in found] for task_id, (_, found) in rows.items()} == {
        "behind": [5],
        "edge": [3, 4, 5],  # 5 - 2 = 3: just within a retention of 3
        "far": [],  # 5 - 1 = 4: more than a retention behind
        "level": [],
        "ahead": [],
        "fresh": [],
    }
    assert rows["behind"][1] == whole["behind"][4:]
    assert rows["edge"][1] == whole["edge"][2:]


async def test_many_resumes_answer_as_the_books_resume_of_each_task(store: Store) -> None:
    """``TagReads.resume_many``: for every cursor, the mode, reason, task and entries ``Book.resume``
    gives, in one read."""
    for task_id, entries in (("a", 0), ("b", 1), ("c", 6)):
        await progressed(store, task_id, entries)
    book = Book(store, FakeClock(10_000), retention_versions=3)
    reads = TagReads(store, 3)
    for cursor in range(9):
        cursors = {"a": cursor, "b": cursor, "c": cursor, "gone": cursor}
        many = await reads.resume_many(cursors)
        assert sorted(many) == ["a", "b", "c"]
        for task_id, resume in many.items():
            assert resume == await book.resume(task_id, cursor), (task_id, cursor)
    assert await reads.resume_many({}) == {}
    assert await reads.list("owner:u42", 5) == ([], False)


async def test_a_tags_list_says_whether_more_carry_it(store: Store) -> None:
    for n in range(5):
        await add(store, f"t{n}", tags=("owner:u42",), now=1_000 + n)
    reads = TagReads(store, 8)
    assert await reads.list("owner:u42", 3) == (["t4", "t3", "t2"], True)
    assert await reads.list("owner:u42", 5) == (["t4", "t3", "t2", "t1", "t0"], False)
    assert await reads.tagged_since(["owner:u42"], 1_003) == [
        ("owner:u42", "t3", "epoch-t3"),
        ("owner:u42", "t4", "epoch-t4"),
    ]


async def test_resuming_many_tasks_is_one_statement_not_one_per_task(
    sql_store: SqlStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tag subscription over 200 tasks reads the tag's list in one statement and all 200 resumes in one
    more, not one per task."""
    async with sql_store.write() as tx:
        for n in range(1, 200):
            task, ttl_ms, now = queued(f"t{n:03d}", tags=("owner:u42",))
            await tx.insert_task(task, ttl_ms, now)
    await progressed(sql_store, "t000", 3, tags=("owner:u42",))
    statements: list[str] = []
    async with sql_store.read() as reading:
        assert isinstance(reading, SqlTx)
        real = type(reading).fetch

        async def fetch(self: SqlTx, sql: str, params: Any = ()) -> Any:
            statements.append(sql)
            return await real(self, sql, params)

        monkeypatch.setattr(type(reading), "fetch", fetch)
        ids = await reading.tagged("owner:u42", 1_000)
        rows = await reading.resume_rows(dict.fromkeys(ids, 1), 8)
    assert len(ids) == 200 and sorted(rows) == sorted(ids)
    assert [v for v, _ in rows["t000"][1]] == [2, 3]
    assert len(statements) == 2, statements  # the list, then every resume at once


async def test_a_page_by_tags_is_newest_first_after_its_place_every_tag_matching(store: Store) -> None:
    await add(store, "a", tags=TAGS, now=1_000)
    await add(store, "b", tags=("owner:u42",), now=2_000)
    await add(store, "c", tags=TAGS, now=2_000)
    await add(store, "d", tags=TAGS, now=3_000)
    await add(store, "e", tags=("project:7",), now=4_000)
    start = apply_event(queued("c", now=2_000, tags=TAGS)[0], Start(2_500, "w1"))
    async with store.write() as tx:
        await tx.record(start, orjson.dumps(event_to_json(start.entry.event)), 2_500)  # type: ignore[union-attr]

    async def page(tags: tuple[str, ...], **kwargs: Any) -> list[str]:
        async with store.read() as reading:
            query = {"state": None, "before": None, "limit": 10, **kwargs}
            return [t.id for t in await reading.tagged_tasks(tags, **query)]

    assert await page(("owner:u42",)) == ["d", "c", "b", "a"]
    assert await page(("owner:u42",), limit=2) == ["d", "c"]
    assert await page(("owner:u42",), before=(2_000, "c")) == ["b", "a"]  # after c: b, at its time, then a
    assert await page(("owner:u42",), before=(2_000, "b")) == ["a"]
    assert await page(("owner:u42",), before=(-1, "")) == []
    assert await page(("owner:u42", "project:7")) == ["d", "c", "a"]
    assert await page(("project:7", "owner:u42"), before=(3_000, "d"), limit=1) == ["c"]
    assert await page(("owner:u42",), state="running") == ["c"]
    assert await page(("owner:u42", "project:7"), state="queued", before=(2_000, "c")) == ["a"]
    assert await page(("owner:u42", "nobody")) == []
    assert await page(("nul\x00",)) == []
    async with store.read() as reading:
        (whole,) = await reading.tagged_tasks(("project:7",), state="running", before=None, limit=10)
    assert whole == start.task  # the whole task, as stored


# --- streams ------------------------------------------------------------------------------------------------


def stream_batch(offset: int, *chunks: str, attempt: int = 1) -> Batch:
    made = Chunks.of(list(chunks))
    return Batch(offset, made.count, attempt, made.size, made.encoded)


def head_after(name: str, first: int, batches: list[Batch]) -> Head:
    """The head of a stream of these batches, all of its attempt (seq 0 on)."""
    last = batches[-1]
    size = sum(b.size for b in batches)
    return Head(name, last.attempt, first, last.offset + last.count, size, len(batches), last.offset)


async def test_a_streams_batches_and_totals_read_back_as_written(store: Store) -> None:
    """A stream's totals and batches, by task; batches from the one that holds an offset, a few at a time;
    a batch by its attempt and seq (its place among the stream's batches, all of its attempt); an attempt's
    first append dropping the earlier attempt's batches."""
    await add(store, "t")
    await add(store, "u")
    out = [stream_batch(0, "a", "b"), stream_batch(2, "c"), stream_batch(3, "d", "e", "f")]
    log = [stream_batch(0, "x")]
    async with store.write() as tx:
        await tx.write_streams(
            StreamWrites(
                made=[("t", head_after("output", 0, out)), ("t", head_after("log", 0, log))],
                batches=[*(("t", "output", b) for b in out), ("t", "log", log[0])],
            )
        )
    async with store.read() as tx:
        assert await tx.stream_heads(["t", "u", "nope"]) == {
            "t": [head_after("log", 0, log), head_after("output", 0, out)]
        }
        assert await tx.stream_batches("t", "output", 0, 10) == out
        assert await tx.stream_batches("t", "output", 1, 10) == out  # the batch holding 1 starts at 0
        assert await tx.stream_batches("t", "output", 2, 10) == out[1:]
        assert await tx.stream_batches("t", "output", 4, 1) == out[2:]
        assert await tx.stream_batches("t", "output", 6, 10) == out[2:]  # the end: the last batch
        assert await tx.stream_batches("t", "steps", 0, 10) == []
        assert [await tx.stream_batch("t", "output", 1, seq) for seq in range(4)] == [*out, None]
        assert await tx.stream_batch("t", "output", 2, 1) is None
        assert await tx.stream_batch("t", "log", 1, 0) == log[0]
    # Attempt 2 appends: attempt 1's batches go, its own start at the next offset.
    retry = [stream_batch(6, "Y", attempt=2)]
    async with store.write() as tx:
        await tx.write_streams(
            StreamWrites(
                moved=[("t", head_after("output", 6, retry))],
                batches=[("t", "output", retry[0])],
                dropped=[("t", "output", 6)],
            )
        )
    async with store.read() as tx:
        assert (await tx.stream_heads(["t"]))["t"][1] == head_after("output", 6, retry)
        assert await tx.stream_batches("t", "output", 0, 10) == retry  # none holds 0: from the first
        assert await tx.stream_batch("t", "output", 2, 0) == retry[0]
        assert await tx.stream_batch("t", "output", 1, 0) is None
        assert await tx.stream_batches("t", "log", 0, 10) == log


async def test_a_rolled_back_append_leaves_the_stream_as_it_was(store: Store) -> None:
    await add(store, "t")
    first = [stream_batch(0, "a")]
    async with store.write() as tx:
        await tx.write_streams(
            StreamWrites(made=[("t", head_after("output", 0, first))], batches=[("t", "output", first[0])])
        )
    more = stream_batch(1, "b")
    with pytest.raises(RuntimeError):
        async with store.write() as tx:
            await tx.write_streams(
                StreamWrites(
                    made=[("t", head_after("log", 0, [stream_batch(0, "x")]))],
                    moved=[("t", head_after("output", 0, [*first, more]))],
                    batches=[("t", "output", more), ("t", "log", stream_batch(0, "x"))],
                    dropped=[("t", "output", 1)],
                )
            )
            raise RuntimeError("never committed")
    async with store.read() as tx:
        assert await tx.stream_heads(["t"]) == {"t": [head_after("output", 0, first)]}
        assert await tx.stream_batches("t", "output", 0, 10) == first


async def test_a_tasks_streams_are_forgotten_with_it(store: Store) -> None:
    await finished(store, "gone", at=5_000)
    await add(store, "kept")
    for task_id in ("gone", "kept"):
        async with store.write() as tx:
            batch = stream_batch(0, "a")
            await tx.write_streams(
                StreamWrites(
                    made=[(task_id, head_after("output", 0, [batch]))], batches=[(task_id, "output", batch)]
                )
            )
    async with store.write() as tx:
        await tx.drain(6_000, 1_000)
        assert await tx.forget(["gone"]) == 1
    async with store.read() as tx:
        assert list(await tx.stream_heads(["gone", "kept"])) == ["kept"]
        assert await tx.stream_batches("gone", "output", 0, 10) == []
        assert len(await tx.stream_batches("kept", "output", 0, 10)) == 1


def appending(task_id: str, attempt: int, seq: int, *chunks: str, stream: str = "output") -> CallbackRequest:
    return CallbackRequest(task_id, None, append=Append(stream, attempt, seq, Chunks.of(list(chunks))))


def answers(outcomes: list[Any]) -> list[Any]:
    """Each outcome as what a worker is told: an error's code, an append's (offset, next offset,
    duplicate), a callback's reason."""
    found: list[Any] = []
    for outcome in outcomes:
        if isinstance(outcome, GatewayError):
            found.append(outcome.code)
        elif outcome.appended is not None:
            found.append((outcome.appended.offset, outcome.appended.next_offset, outcome.appended.duplicate))
        else:
            found.append(outcome.transition.reason)
    return found


async def test_a_group_commit_of_appends_renews_the_leases_of_the_tasks_it_updates_and_of_those_it_does_not(
    store: Store,
) -> None:
    """PostgreSQL sends the appends and the renewals of tasks whose rows the batch does not update with its
    other writes, and those of updated rows after them: every store ends with the same rows."""
    clock = FakeClock()
    book = Book(store, clock)
    for task_id in ("a", "b"):
        await book.create(task_id, 600_000, 1, heartbeat_ms=10_000)
        await book.callbacks([CallbackRequest(task_id, lambda now: Start(now, "w"))])
    clock.advance(1_000)
    outcomes = await book.callbacks(
        [
            appending("a", 1, 0, "a0"),
            CallbackRequest("b", lambda now: Progress(now, 50, "half")),
            appending("b", 1, 0, "b0", "b1"),
            appending("a", 1, 1, "a1"),
        ]
    )
    assert answers(outcomes) == [(0, 1, False), "progress", (0, 2, False), (1, 2, False)]
    reads = StreamReads(store)
    for task_id, text, version in (("a", "a0a1", 1), ("b", "b0b1", 2)):
        assert (await reads.text(task_id, "output"))[1] == Text(1, 2, text)
        async with store.read() as tx:
            stored = await tx.task(task_id)
        assert stored is not None and stored.task.version == version
        assert stored.lease_until_ms == clock() + 10_000


async def test_appends_are_decided_with_the_callbacks_of_their_group_commit_in_arrival_order(
    store: Store,
) -> None:
    """One transaction: appends and callbacks of one task, each answered as it arrived among them: the
    attempt's batches, a retry of one, a gap, a requeue between them, the next attempt replacing the first's
    text in that same transaction (the first's batches are never written), an append after the end."""
    book = Book(store, FakeClock())
    await book.create("t", 600_000, 3)
    outcomes = await book.callbacks(
        [
            appending("t", 0, 0, "early"),
            CallbackRequest("t", lambda now: Start(now, "w1")),
            appending("t", 1, 0, "a", "b"),
            appending("t", 1, 1, "c"),
            appending("t", 1, 0, "a", "b"),
            appending("t", 1, 0, "A", "b"),
            appending("t", 1, 3, "e"),
            CallbackRequest("t", lambda now: Fail(now, "boom", True), attempt=1),
            appending("t", 1, 2, "d"),
            CallbackRequest("t", lambda now: Start(now, "w2")),
            appending("t", 1, 2, "d"),
            appending("t", 2, 0, "X"),
            appending("t", 2, 1, "Y", "Z"),
            appending("t", 2, 1, "Y", "Z"),
            appending("zz", 1, 0, "a"),
        ]
    )
    assert answers(outcomes) == [
        "not-running",
        "started",
        (0, 2, False),
        (2, 3, False),
        (0, 2, True),
        "seq-reused",
        "seq-gap",
        "requeued",
        "not-running",
        "started",
        "stale-attempt",
        (3, 4, False),
        (4, 6, False),
        (4, 6, True),
        "unknown-task",
    ]
    reads = StreamReads(store)
    task, heads = await reads.heads("t")
    assert (task.version, task.attempts) == (3, 2)  # appends add no entry
    assert [(h.name, h.attempt, h.first_offset, h.next_offset, h.size, h.next_seq) for h in heads] == [
        ("output", 2, 3, 6, 3, 2)
    ]
    assert (await reads.text("t", "output"))[1] == Text(2, 6, "XYZ")
    async with store.read() as tx:
        assert [b.attempt for b in await tx.stream_batches("t", "output", 0, 10)] == [2, 2]


async def test_a_retry_of_an_earlier_batch_is_found_in_the_store_and_a_later_attempt_drops_the_stored(
    store: Store,
) -> None:
    book = Book(store, FakeClock(), stream_max_bytes=5)
    await book.create("t", 600_000, 2)
    await book.callbacks([CallbackRequest("t", lambda now: Start(now, "w1"))])
    for seq, chunk in enumerate(("ab", "c", "d")):
        await book.callbacks([appending("t", 1, seq, chunk)])
    outcomes = await book.callbacks(
        [
            appending("t", 1, 0, "ab"),
            appending("t", 1, 1, "x"),
            appending("t", 1, 3, "xy"),
            appending("t", 1, 3, "x"),
            appending("t", 1, 0, "a", stream="log"),
        ]
    )
    assert answers(outcomes) == [(0, 1, True), "seq-reused", "stream-full", (3, 4, False), (0, 1, False)]
    await book.callbacks([CallbackRequest("t", lambda now: Fail(now, "boom", True), attempt=1)])
    await book.callbacks([CallbackRequest("t", lambda now: Start(now, "w2"))])
    # The text starts over: the limit counts the new attempt's alone.
    assert answers(await book.callbacks([appending("t", 2, 0, "12345")])) == [(4, 5, False)]
    reads = StreamReads(store)
    assert (await reads.text("t", "output"))[1] == Text(2, 5, "12345")
    assert (await reads.text("t", "log"))[1] == Text(1, 1, "a")  # attempt 2 has not written to it
    async with store.read() as tx:
        assert [b.offset for b in await tx.stream_batches("t", "output", 0, 10)] == [4]


async def test_a_retry_of_a_stored_batch_the_last_or_an_earlier_is_told_by_the_chunks_stored(
    store: Store,
) -> None:
    """A batch sent again after its answer was lost, every batch committed before in a transaction of its
    own: read back from the store, the same chunks are a duplicate answered as the first time and other
    chunks (another text, or the same text cut otherwise) are seq-reused, for the stream's last batch and for
    an earlier one; nothing of a retry is appended. Chunks the JSON array escapes read back as written."""
    book = Book(store, FakeClock())
    await book.create("t", 600_000, 1)
    await book.callbacks([CallbackRequest("t", lambda now: Start(now, "w1"))])
    sent = [('é "q"\\', "\n\x00\u2028"), ("ab",), ("c", "d\U0001f642")]
    for seq, chunks in enumerate(sent):
        await book.callbacks([appending("t", 1, seq, *chunks)])
    retried = [(2, sent[2], (3, 5, True)), (0, sent[0], (0, 2, True)), (1, sent[1], (2, 3, True))]
    reused = [(2, ("c", "d")), (2, ("cd\U0001f642",)), (0, ('é "q"\\',)), (1, ("a", "b")), (0, ("ab",))]
    for seq, chunks, answer in retried:
        assert answers(await book.callbacks([appending("t", 1, seq, *chunks)])) == [answer], seq
    for seq, chunks in reused:
        assert answers(await book.callbacks([appending("t", 1, seq, *chunks)])) == ["seq-reused"], chunks
    # Nothing of them was appended: the next batch goes on where the third ended.
    assert answers(await book.callbacks([appending("t", 1, 3, "e")])) == [(5, 6, False)]
    # Retries among a batch taken in the same transaction: of it, and of stored ones (the last before it).
    outcomes = await book.callbacks(
        [
            appending("t", 1, 4, "f"),
            appending("t", 1, 3, "e"),
            appending("t", 1, 2, *sent[2]),
            appending("t", 1, 1, "b"),
            appending("t", 1, 4, "f"),
            appending("t", 1, 4, "F"),
        ]
    )
    assert answers(outcomes) == [
        (6, 7, False),
        (5, 6, True),
        (3, 5, True),
        "seq-reused",
        (6, 7, True),
        "seq-reused",
    ]
    text = 'é "q"\\\n\x00\u2028abcd\U0001f642ef'
    assert (await StreamReads(store).text("t", "output"))[1] == Text(1, 7, text)


async def test_a_page_is_read_a_few_batches_at_a_time_from_where_the_read_starts(store: Store) -> None:
    book = Book(store, FakeClock())
    task, _ = await book.create("t", 600_000, 1)
    await book.callbacks([CallbackRequest("t", lambda now: Start(now, "w1"))])
    for seq in range(30):
        await book.callbacks([appending("t", 1, seq, f"{seq}a", f"{seq}b")])
    reads = StreamReads(store)
    _, page = await reads.page("t", "output", 0, None, 45)
    assert (page.offset, page.next_offset, page.more) == (0, 45, True)
    assert page.chunks[:3] == ["0a", "0b", "1a"] and page.chunks[-1] == "22a"
    _, page = await reads.page("t", "output", 45, task.epoch, 1000)
    assert (page.attempt, page.offset, page.more) == (1, 45, False)
    assert page.chunks == [f"{i // 2}{'ab'[i % 2]}" for i in range(45, 60)]

    async def shown(offset: int, epoch: str | None, limit: int, name: str = "output") -> tuple[object, ...]:
        found = (await reads.page("t", name, offset, epoch, limit))[1]
        return found.attempt, found.offset, found.chunks, found.more

    assert await shown(60, None, 10) == (1, 60, [], False)
    # Past the end, or of another history of the id: from the first chunk.
    assert await shown(61, None, 2) == (1, 0, ["0a", "0b"], True)
    assert await shown(7, "another", 2) == (1, 0, ["0a", "0b"], True)
    assert await shown(7, None, 2, "log") == (0, 0, [], False)
    with pytest.raises(GatewayError, match="unknown task nope"):
        await reads.page("nope", "output", 0, None, 10)


# --- beside the history (issue 34): titles, metadata, batches, what the gateway records of runs -----------


async def test_a_tasks_fields_beside_its_history_read_back_through_every_read_and_change_apart(
    store: Store,
) -> None:
    """Its title, parent and progressFromChildren are written once; its metadata, revision and children
    counts change apart from its history (``write_tasks``: no entry, version unchanged), and a transition
    carries them; a rolled-back change of them leaves them as they were."""
    task, ttl_ms, now = queued("child", tags=TAGS)
    task = replace(task, title="Monthly export", parent="p", progress_from_children=True, metadata='{"a":1}')
    async with store.write() as tx:
        await tx.insert_task(task, ttl_ms, now)
    async with store.read() as tx:
        stored = await tx.task("child")
        assert stored is not None and stored.task == task
        assert await tx.list_tasks(state=None, after=None, limit=5) == [task]
        assert await tx.newest_tasks(state=None, before=None, limit=5) == [task]
        assert await tx.tagged_tasks(TAGS, state=None, before=None, limit=5) == [task]
        assert (await tx.resume_rows({"child": 0}, 8))["child"][0] == task
    counted = replace(task, metadata='{"a":2,"message":"page 3"}', revision=4, children=(3, 1, 1, 1, 0, 0))
    with pytest.raises(RuntimeError):
        async with store.write() as tx:
            await tx.lock_tasks(["child"])
            await tx.write_tasks([counted])
            raise RuntimeError("rolled back")
    async with store.read() as tx:
        assert (await tx.task("child")).task == task  # type: ignore[union-attr]
    async with store.write() as tx:
        await tx.lock_tasks(["child"])
        # The fields written at insert are not changed by a write, whatever the task says.
        await tx.write_tasks([replace(counted, title="other", parent=None, progress_from_children=False)])
    async with store.write() as tx:
        locked = (await tx.lock_tasks(["child"]))["child"].task
        assert locked == counted
        started = stamped(apply_event(locked, Start(2_000, "w7")), 2_000)
        await tx.record(started, orjson.dumps(event_to_json(started.entry.event)), 2_000)  # type: ignore[union-attr]
    async with store.write() as tx:
        locked = (await tx.lock_tasks(["child"]))["child"].task
        assert locked == replace(
            counted, state="running", attempts=1, version=1, worker="w7", started_at_ms=2_000
        )
        ended = apply_event(locked, Fail(2_500, "boom", False))
        await tx.record(ended, orjson.dumps(event_to_json(ended.entry.event)), 2_600)  # type: ignore[union-attr]
    async with store.read() as tx:
        after = (await tx.task("child")).task  # type: ignore[union-attr]
    # Its end is its notification's time, written with it (``finished_at_ms``: retention counts from it).
    assert after == replace(ended.task, ended_at_ms=2_600)
    assert (after.metadata, after.revision, after.children) == (counted.metadata, 4, (3, 1, 1, 1, 0, 0))


async def test_a_parents_children_and_titles_are_listed_newest_first_paged(store: Store) -> None:
    """``parent=``: one parent's children only (ix_tasks_parent), newest first, paged, by state too;
    ``title=``: the titles that contain a text, case aside, its ``%`` and ``_`` taken as they are."""
    made: dict[str, Any] = {}
    for n, (task_id, parent, title) in enumerate(
        [
            ("p", None, "Import of 2,000 files"),
            ("c1", "p", "file_1.csv"),
            ("c2", "p", "FILE 2.csv"),
            ("other", "q", "100% done"),
            ("c3", "p", None),
        ]
    ):
        task, ttl_ms, now = queued(task_id, now=1_000 + n)
        made[task_id] = replace(task, parent=parent, title=title)
        async with store.write() as writing:
            await writing.insert_task(made[task_id], ttl_ms, now)
    async with store.write() as writing:
        c2 = (await writing.lock_tasks(["c2"]))["c2"].task
        await writing.record(apply_event(c2, Start(2_000, "w")), b'{"type":"start"}', 2_000)
    async with store.read() as tx:
        children = await tx.newest_tasks(state=None, before=None, limit=5, parent="p")
        assert [t.id for t in children] == ["c3", "c2", "c1"]
        page = await tx.newest_tasks(state=None, before=(1_004, "c3"), limit=1, parent="p")
        assert [t.id for t in page] == ["c2"]
        assert [t.id for t in await tx.newest_tasks(state="queued", before=None, limit=5, parent="p")] == [
            "c3",
            "c1",
        ]
        assert await tx.newest_tasks(state=None, before=None, limit=5, parent="nobody") == []
        assert await tx.newest_tasks(state=None, before=None, limit=5, parent="nul\x00") == []

        async def titled(text: str) -> list[str]:
            return [t.id for t in await tx.newest_tasks(state=None, before=None, limit=5, title=text)]

        assert await titled("file") == ["c2", "c1", "p"]
        assert await titled("file_") == ["c1"]  # "_" is no wildcard
        assert await titled("0%") == ["other"]  # nor "%"
        assert await titled("% d") == ["other"]
        assert await titled("nothing") == []
        assert await titled("") == [t.id for t in await tx.newest_tasks(state=None, before=None, limit=5)]
        both = await tx.newest_tasks(state=None, before=None, limit=5, parent="p", title="csv")
        assert [t.id for t in both] == ["c2", "c1"]


async def children_in_store(store: Store, parent: str) -> tuple[int, ...]:
    """A count of the parent's children by state, from their rows: what its counts must equal."""
    async with store.read() as tx:
        children = await tx.newest_tasks(state=None, before=None, limit=500, parent=parent)
    states = [t.state for t in children]
    return (len(states), *(states.count(s) for s in ("queued", "running", "succeeded", "failed", "expired")))


async def test_a_parents_counts_move_in_the_transaction_of_each_childs_creation_and_change(
    store: Store,
) -> None:
    """Through the book: a child counted at its creation, then at each change of state (a cancel counts as
    failed, a requeue back to queued, an expiry as expired), after its parent ended too; a parent created
    with progressFromChildren moved by the gateway only upward and only while it runs; every count equal
    to a count of the children's rows."""
    clock = FakeClock(1_000)
    book = Book(store, clock)
    parent, _ = await book.create("p", 60_000, 1, beside=Beside(title="Import", progress_from_children=True))
    assert parent.children is None
    for n in range(4):
        await book.create(f"c{n}", 1_000 if n == 3 else 60_000, 2, beside=Beside(parent="p"))
    with pytest.raises(UnknownTask):
        await book.create("orphan", 60_000, 1, beside=Beside(parent="nobody"))
    counts = (await book.get("p")).children
    assert counts == (4, 4, 0, 0, 0, 0) == await children_in_store(store, "p")
    assert (await book.get("p")).revision == 4
    await book.callback("p", lambda now: Start(now, "boss"))
    await book.callback("c0", lambda now: Start(now, "w0"))
    await book.callback("c1", lambda now: Start(now, "w1"))
    await book.callback("c1", lambda now: Succeed(now, "r", "h"))
    assert (await book.get("p")).children == (4, 2, 1, 1, 0, 0) == await children_in_store(store, "p")
    # progressFromChildren: 1 of 4 ended -> 25, an entry of the gateway's with its mark.
    after = await book.get("p")
    assert (after.progress, after.revision) == (25, 7)
    async with store.read() as tx:
        (last,) = await tx.entries("p", after.version - 1, after.version)
    assert orjson.loads(last[1]) == {
        "type": "progress",
        "atMs": 1_000,
        "progress": 25,
        "cursor": "children:1/4",
    }
    await book.callback("c0", lambda now: Fail(now, "again", True))  # requeued: running -> queued
    await book.act("c2", lambda task, now: cancel_task(task, now, "not wanted"))  # failed
    assert (await book.get("p")).children == (4, 2, 0, 1, 1, 0) == await children_in_store(store, "p")
    assert (await book.get("p")).progress == 50
    clock.advance(1_000)
    assert await book.expire_due() == 1  # c3
    assert (await book.get("p")).children == (4, 1, 0, 1, 1, 1) == await children_in_store(store, "p")
    assert (await book.get("p")).progress == 75
    # The parent ends: no child is added any more, but those it has are still counted.
    await book.act("p", lambda task, now: cancel_task(task, now))
    with pytest.raises(Conflict) as refused:
        await book.create("late", 60_000, 1, beside=Beside(parent="p"))
    assert refused.value.code == "parent-ended" and refused.value.task is not None
    await book.callback("c0", lambda now: Start(now, "w0"))
    await book.callback("c0", lambda now: Succeed(now, "r", "h"))
    ended = await book.get("p")
    assert ended.children == (4, 0, 0, 2, 1, 1) == await children_in_store(store, "p")
    assert (ended.state, ended.progress) == ("failed", 75)  # not moved once it ended
    async with store.read() as tx:
        assert await tx.task("late") is None and await tx.task("orphan") is None


async def test_a_create_again_compares_its_title_parent_and_progress_from_children_not_its_metadata(
    store: Store,
) -> None:
    book = Book(store, FakeClock(1_000))
    await book.create("p", 60_000, 1)
    made, created = await book.create("c", 60_000, 1, beside=Beside("Sales", '{"n":1}', "p"))
    assert created and (made.title, made.metadata, made.parent) == ("Sales", '{"n":1}', "p")
    again, created = await book.create("c", 60_000, 1, beside=Beside("Sales", '{"n":2}', "p"))
    assert not created and again == made  # counted once; its metadata as it is
    assert (await book.get("p")).children == (1, 1, 0, 0, 0, 0)
    for other in (
        Beside("Other", '{"n":1}', "p"),
        Beside("Sales", "{}", None),
        Beside("Sales", "{}", "p", True),
    ):
        with pytest.raises(Conflict) as refused:
            await book.create("c", 60_000, 1, beside=other)
        assert refused.value.code == "task-exists"


async def test_the_last_starts_worker_and_time_and_the_end_are_recorded_with_the_entries(
    store: Store,
) -> None:
    clock = FakeClock(1_000)
    book = Book(store, clock)
    await book.create("t", 60_000, 2)
    await book.callback("t", lambda now: Start(now, "first"))
    clock.advance(10)
    requeued = (await book.callback("t", lambda now: Fail(now, "flaky", True))).transition.task
    assert (requeued.worker, requeued.started_at_ms, requeued.ended_at_ms) == ("first", 1_000, None)
    clock.advance(10)
    await book.callback("t", lambda now: Start(now, "second"))
    clock.advance(10)
    done = (await book.callback("t", lambda now: Succeed(now, "r", "h"))).transition.task
    assert (done.worker, done.started_at_ms, done.ended_at_ms) == ("second", 1_020, 1_030)
    assert await book.get("t") == done


async def test_a_child_is_never_forgotten_before_its_parent(store: Store) -> None:
    """Retention keeps a finished child while its parent is there (protocol.md, Batches), and takes it once
    the parent is gone; a parent is never held by its children."""
    book = Book(store, FakeClock(1_000))
    await book.create("p", 60_000, 1)
    await book.create("c", 60_000, 1, beside=Beside(parent="p"))
    for task_id in ("c", "p"):
        await book.act(task_id, lambda task, now: cancel_task(task, now))
    await book.drain(notifications_body)
    async with store.write() as tx:
        assert await tx.claim_finished(1_000, None, 10, relay=False) == [(1_000, "p")]
        assert await tx.forget(["p"]) == 1
    async with store.write() as tx:
        assert await tx.claim_finished(1_000, None, 10, relay=False) == [(1_000, "c")]
