"""The write turns of SQLite and the in-memory store: urgent first, each kind in arrival order, and a waiter
that gives up (cancelled) never leaves the lock stuck."""

from __future__ import annotations

import asyncio

import anyio
import anyio.lowlevel
import pytest

from gateway.store.priority_lock import PriorityLock

pytestmark = pytest.mark.anyio


async def test_urgent_waiters_go_first_then_the_others_in_arrival_order() -> None:
    lock = PriorityLock()
    order: list[str] = []
    release = anyio.Event()

    async def hold() -> None:
        async with lock.hold():
            await release.wait()

    async def take(name: str, urgent: bool) -> None:
        async with lock.hold(urgent=urgent):
            order.append(name)
            await anyio.lowlevel.checkpoint()  # held across a turn of the loop, as a transaction is

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(hold)
            await anyio.wait_all_tasks_blocked()
            for name, urgent in [("a", False), ("u1", True), ("b", False), ("u2", True), ("c", False)]:
                tg.start_soon(take, name, urgent)
                await anyio.wait_all_tasks_blocked()
            release.set()
    assert order == ["u1", "u2", "a", "b", "c"]
    assert not lock.locked()


async def test_a_waiter_cancelled_in_the_queue_leaves_the_lock_to_the_next() -> None:
    lock = PriorityLock()
    got: list[str] = []
    gave_up = anyio.CancelScope()

    async def take(name: str, urgent: bool = False) -> None:
        async with lock.hold(urgent=urgent):
            got.append(name)

    async def take_or_give_up() -> None:
        with gave_up:
            await take("gave-up", urgent=True)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg, lock.hold():
            tg.start_soon(take_or_give_up)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(take, "next")
            await anyio.wait_all_tasks_blocked()
            gave_up.cancel()
            await anyio.wait_all_tasks_blocked()
    assert got == ["next"]
    assert not lock.locked()


async def test_a_waiter_cancelled_as_it_is_handed_the_lock_hands_it_on() -> None:
    lock = PriorityLock()
    got: list[str] = []

    async def take(name: str) -> None:
        async with lock.hold():
            got.append(name)

    with anyio.fail_after(5):
        async with lock.hold():
            first = asyncio.create_task(take("first"))
            second = asyncio.create_task(take("second"))
            await anyio.wait_all_tasks_blocked()
        # Released: the lock is "first"'s now, and "first" is cancelled before it gets to run.
        first.cancel()
        await asyncio.gather(first, second, return_exceptions=True)
    assert first.cancelled()
    assert got == ["second"]
    assert not lock.locked()
