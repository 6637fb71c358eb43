"""The sweeper's timing on the in-memory store: a slow pass does not hold up the tasks falling due after it
started (on PostgreSQL a commit can take a while under load; the next pass must not wait for it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import orjson
import pytest

from gateway.book.book import Book
from gateway.jobs.sweeper import Sweeper
from gateway.machine import Start, create_task
from gateway.store.memory import MemoryStore, MemoryTx
from gateway.web.render import notifications_body
from tests.support import FakeClock, eventually

pytestmark = pytest.mark.anyio


class FirstExpiryStalls(MemoryStore):
    """The first expiry transaction waits for ``go`` before it starts (a connection slow to come back);
    every other transaction goes at once."""

    def __init__(self) -> None:
        super().__init__()
        self.stalled = anyio.Event()
        self.go = anyio.Event()

    @asynccontextmanager
    async def write(self, *, urgent: bool = False) -> AsyncIterator[MemoryTx]:
        if urgent and not self.stalled.is_set():
            self.stalled.set()
            await self.go.wait()
        async with super().write(urgent=urgent) as tx:
            yield tx


async def test_a_stalled_pass_does_not_hold_up_the_next() -> None:
    clock = FakeClock(1_000)
    store = FirstExpiryStalls()
    book = Book(store, clock)
    async with store.write() as tx:
        for task_id, ttl in [("first", 10), ("second", 1_000)]:
            task = create_task(id=task_id, now_ms=1_000, ttl_ms=ttl, max_attempts=1)
            await tx.insert_task(task, ttl, 1_000)
    clock.advance(100)

    async def state(task_id: str) -> str:
        async with store.read() as tx:
            stored = await tx.task(task_id)
        assert stored is not None
        return stored.task.state

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(Sweeper(book, 0.05).run)
            await store.stalled.wait()  # the first pass is stuck before it could claim "first"
            clock.advance(1_000)  # both are due now
            await eventually(
                lambda: state("second"),
                lambda found: found == "expired",
                "the second task expired by the next pass while the first is stalled",
                poll_s=0.01,
            )
            store.go.set()
            tg.cancel_scope.cancel()
    assert await state("first") == "expired"


class CountsWrites(MemoryStore):
    """Counts write transactions, and says when one begins."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.wrote = anyio.Event()

    @asynccontextmanager
    async def write(self, *, urgent: bool = False) -> AsyncIterator[MemoryTx]:
        self.writes += 1
        self.wrote.set()
        async with super().write(urgent=urgent) as tx:
            yield tx


async def test_a_pass_with_nothing_due_takes_no_write_turn() -> None:
    """Passes run five times a second whatever is due; one that finds nothing due must not write. On SQLite
    a write takes the process's one write turn, and a callback arriving meanwhile waits for it."""
    clock = FakeClock(1_000)
    store = CountsWrites()
    book = Book(store, clock)
    async with store.write() as tx:
        task = create_task(id="later", now_ms=1_000, ttl_ms=60_000, max_attempts=1)
        await tx.insert_task(task, 60_000, 1_000)
    store.writes = 0
    passes = 0
    real_next_due = book.next_due
    enough = anyio.Event()

    async def counting_next_due() -> tuple[int | None, int | None]:
        nonlocal passes
        passes += 1
        if passes >= 10:
            enough.set()
        return await real_next_due()

    book.next_due = counting_next_due  # type: ignore[method-assign]
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(Sweeper(book, 0.01).run)
            await enough.wait()  # ten passes at least, nothing due in any
            assert store.writes == 0
            store.wrote = anyio.Event()
            clock.advance(60_000)  # now it is due: the next pass writes and expires it
            await store.wrote.wait()
            tg.cancel_scope.cancel()  # the batch under way ends first (it is shielded)
    async with store.read() as tx:
        stored = await tx.task("later")
    assert stored is not None and stored.task.state == "expired"


async def test_a_pass_writes_only_for_the_kind_of_work_that_is_due() -> None:
    """A lease that ran out takes one write (its end), not also an empty expiry transaction; and the
    sweeper wakes for it although no deadline is near."""
    clock = FakeClock(1_000)
    store = CountsWrites()
    book = Book(store, clock)
    await book.create("leased", 60_000, 1, 1_000)
    await book.callback("leased", lambda now: Start(now, "w1"))
    store.writes = 0
    store.wrote = anyio.Event()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(Sweeper(book, 0.01).run)
            clock.advance(1_000)  # the lease's end; the deadline is a minute away
            await store.wrote.wait()
            await eventually(book.next_due, lambda due: due[1] is None, "the lease ended", poll_s=0.01)
            tg.cancel_scope.cancel()
    assert store.writes == 1
    assert (await book.get("leased")).state == "failed"


async def history(book: Book, task_id: str) -> list[dict[str, object]]:
    async with book.store.read() as tx:
        return [orjson.loads(raw) for _, raw in await tx.entries(task_id, 0, 1_000)]


@pytest.mark.parametrize("max_attempts", [1, 2])
async def test_a_late_pass_ends_a_lease_that_ran_out_before_the_deadline_first(max_attempts: int) -> None:
    """A pass that comes after both a lease's end and the deadline (the gateway was down, or busy): the
    history says what happened in time's order, the lease's end first. The last attempt fails with
    heartbeat-timeout at the lease's end (the deadline, later, finds it ended); with attempts left the task
    is requeued at the lease's end, then expires at its deadline."""
    clock = FakeClock(1_000)
    book = Book(MemoryStore(), clock)
    await book.create("t", 5_000, max_attempts, 1_000)
    await book.callback("t", lambda now: Start(now, "w1"))
    clock.advance(6_000)  # the lease ended at 2,000, the deadline at 6,000: both are behind
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(Sweeper(book, 60).run)
            await eventually(lambda: book.get("t"), lambda t: t.terminal, "the task ended", poll_s=0.01)
            tg.cancel_scope.cancel()
    timeout = {"type": "fail", "atMs": 2_000, "error": "heartbeat-timeout", "retryable": True}
    start = {"type": "start", "atMs": 1_000, "worker": "w1"}
    task = await book.get("t")
    if max_attempts == 1:
        assert (task.state, task.error) == ("failed", "heartbeat-timeout")
        assert await history(book, "t") == [start, timeout]
        (notification,) = (await book.drain(notifications_body)).taken
        assert (notification.state, notification.at_ms) == ("failed", 2_000)
    else:
        assert task.state == "expired"
        assert await history(book, "t") == [start, timeout, {"type": "expire", "atMs": 6_000}]
        (notification,) = (await book.drain(notifications_body)).taken
        assert (notification.state, notification.at_ms) == ("expired", 6_000)
