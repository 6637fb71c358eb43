"""Who hears of a book's commits is the explicit list it was built with: each listener of a kind hears each
commit of that kind once, after it is committed, and a refused write tells nobody."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from gateway.book.book import Book, Listeners
from gateway.errors import Conflict
from gateway.machine import Start, Succeed
from gateway.store.memory import MemoryStore
from tests.support import FakeClock

pytestmark = pytest.mark.anyio


class Heard:
    def __init__(self) -> None:
        self.deadlines: list[int] = []
        self.expired: list[list[int]] = []
        self.notified = 0

    def deadline(self, at_ms: int) -> None:
        self.deadlines.append(at_ms)

    def expiry(self, deadlines_ms: Sequence[int]) -> None:
        self.expired.append(list(deadlines_ms))

    def notification(self) -> None:
        self.notified += 1


def listening(*heard: Heard) -> Listeners:
    return Listeners(
        deadline=[h.deadline for h in heard],
        expired=[h.expiry for h in heard],
        notifications=[h.notification for h in heard],
    )


async def test_every_listener_hears_each_commit_of_its_kind_once() -> None:
    clock = FakeClock(1_000)
    first, second = Heard(), Heard()
    book = Book(MemoryStore(), clock, listeners=listening(first, second))

    await book.create("a", 500, 1)
    await book.create("b", 60_000, 1)
    await book.create("a", 500, 1)  # the same task again: nothing new is committed
    assert first.deadlines == second.deadlines == [1_500, 61_000]

    await book.callback("b", lambda now: Start(now, "w"))
    assert first.notified == 0  # a task that only started has nothing to notify
    await book.callback("b", lambda now: Succeed(now, "s3://r", "sha256:1"), attempt=1)
    assert first.notified == second.notified == 1

    clock.advance(1_000)
    assert await book.expire_due() == 1
    assert first.expired == second.expired == [[1_500]]
    assert first.notified == second.notified == 2  # the expiry's notification too


async def test_a_refused_write_tells_no_listener() -> None:
    heard = Heard()
    book = Book(MemoryStore(), FakeClock(1_000), listeners=listening(heard))
    await book.create("a", 500, 1)
    await book.callback("a", lambda now: Start(now, "w"))
    with pytest.raises(Conflict):
        await book.callback("a", lambda now: Succeed(now, "s3://r", "sha256:1"), attempt=2)  # stale attempt
    assert heard.notified == 0
    assert await book.expire_due() == 0
    assert heard.expired == []


async def test_a_book_built_without_listeners_tells_nobody_and_still_commits() -> None:
    book = Book(MemoryStore(), FakeClock(1_000))
    task, created = await book.create("a", 500, 1)
    assert created and task.state == "queued"
