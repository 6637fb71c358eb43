"""Resumes of one task asked for together share one store read (a reconnect storm), and each still gets
exactly what it missed from its own cursor."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel
import pytest

from gateway.book.book import Book
from gateway.errors import UnknownTask
from gateway.machine import Event, Progress, Resume, Start
from gateway.store.memory import MemoryStore, MemoryTx
from tests.support import FakeClock

pytestmark = pytest.mark.anyio


class CountingStore(MemoryStore):
    """The in-memory store, counting read transactions; ``gate`` holds reads back until it is set."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.gate: anyio.Event | None = None

    @asynccontextmanager
    async def read(self) -> AsyncIterator[MemoryTx]:
        if self.gate is not None:
            await self.gate.wait()
        self.reads += 1
        async with super().read() as tx:
            yield tx


async def task_at_version(book: Book, task_id: str, version: int) -> None:
    await book.create(task_id, 3_600_000, 1)
    await book.callback(task_id, lambda now: Start(now, "w1"))
    for n in range(2, version + 1):
        await book.callback(task_id, progress_to(n), attempt=1)


def progress_to(n: int) -> Callable[[int], Event]:
    """The event of a progress callback to ``n``, at the time the book stamps it with."""
    return lambda now: Progress(now, n, f"c{n}")


async def resume_all(book: Book, asks: list[tuple[str, int]]) -> list[Resume | BaseException]:
    results: list[Resume | BaseException] = [RuntimeError("not answered")] * len(asks)

    async def one(i: int, task_id: str, cursor: int) -> None:
        try:
            results[i] = await book.resume(task_id, cursor)
        except Exception as exc:
            results[i] = exc

    async with anyio.create_task_group() as tg:
        for i, (task_id, cursor) in enumerate(asks):
            tg.start_soon(one, i, task_id, cursor)
    return results


async def test_resumes_asked_together_share_one_read_and_each_gets_its_own_answer() -> None:
    store = CountingStore()
    book = Book(store, FakeClock(1_000), retention_versions=8)
    await task_at_version(book, "t", 12)
    store.reads = 0
    store.gate = anyio.Event()  # the storm arrives while the database is busy
    cursors = [12, 11, 9, 4, 3, 0, 20, 11, 9]
    async with anyio.create_task_group() as tg:
        answers: list[list[Resume | BaseException]] = []

        async def storm() -> None:
            answers.append(await resume_all(book, [("t", c) for c in cursors]))

        tg.start_soon(storm)
        await anyio.wait_all_tasks_blocked()
        store.gate.set()
    assert store.reads == 1
    got = answers[0]
    for cursor, answer in zip(cursors, got, strict=True):
        assert isinstance(answer, Resume)
        assert answer.task.version == 12
        expected = {12: "caught-up", 20: "snapshot"}.get(cursor, "delta" if 12 - cursor <= 8 else "snapshot")
        assert answer.mode == expected, cursor
        if expected == "delta":
            assert [v for v, _ in answer.entries] == list(range(cursor + 1, 13))
        else:
            assert answer.entries == ()
    assert {a.reason for a in got if isinstance(a, Resume) and a.mode == "snapshot"} == {
        "retention",
        "cursor-ahead",
    }


async def test_each_task_gets_its_own_read_and_an_unknown_task_fails_only_its_resumes() -> None:
    store = CountingStore()
    book = Book(store, FakeClock(1_000))
    await task_at_version(book, "a", 3)
    await task_at_version(book, "b", 5)
    store.reads = 0
    store.gate = anyio.Event()
    async with anyio.create_task_group() as tg:
        answers: list[list[Resume | BaseException]] = []

        async def storm() -> None:
            answers.append(await resume_all(book, [("a", 1), ("b", 4), ("nope", 0), ("a", 2), ("nope", 0)]))

        tg.start_soon(storm)
        await anyio.wait_all_tasks_blocked()
        store.gate.set()
    assert store.reads == 3
    a1, b4, nope1, a2, nope2 = answers[0]
    assert isinstance(a1, Resume) and [v for v, _ in a1.entries] == [2, 3]
    assert isinstance(a2, Resume) and [v for v, _ in a2.entries] == [3]
    assert isinstance(b4, Resume) and [v for v, _ in b4.entries] == [5]
    assert isinstance(nope1, UnknownTask) and isinstance(nope2, UnknownTask)


async def test_a_resume_asked_after_the_shared_read_started_reads_again() -> None:
    """A read that has started may miss what a later subscriber needs: the later one reads anew, and sees
    an entry committed in between."""
    store = CountingStore()
    book = Book(store, FakeClock(1_000))
    await task_at_version(book, "t", 3)
    first = await book.resume("t", 0)
    await book.callback("t", lambda now: Progress(now, 50, "c4"), attempt=1)
    second = await book.resume("t", 0)
    assert (first.task.version, second.task.version) == (3, 4)


async def test_one_caller_cancelled_does_not_cancel_the_others_read() -> None:
    store = CountingStore()
    book = Book(store, FakeClock(1_000))
    await task_at_version(book, "t", 4)
    store.gate = anyio.Event()
    results: list[Resume] = []
    doomed = anyio.CancelScope()

    async def cancelled() -> None:
        with doomed:
            await book.resume("t", 1)

    async def survivor() -> None:
        results.append(await book.resume("t", 2))

    async with anyio.create_task_group() as tg:
        tg.start_soon(cancelled)
        tg.start_soon(survivor)
        await anyio.wait_all_tasks_blocked()
        doomed.cancel()
        await anyio.wait_all_tasks_blocked()
        store.gate.set()
    assert doomed.cancelled_caught
    assert [v for v, _ in results[0].entries] == [3, 4]


@pytest.mark.anyio
async def test_an_operation_begun_by_a_cancelled_caller_runs_to_its_end() -> None:
    """A shutdown cancels the sweeper mid-pass: the database operation it begins then still runs to its end
    (within the book's own deadline), instead of timing out at once and being logged as an unreachable
    database."""

    class Remote(MemoryStore):
        """A store whose reads wait on I/O, as a database's do (the in-memory one never yields)."""

        @asynccontextmanager
        async def read(self) -> AsyncIterator[MemoryTx]:
            await anyio.lowlevel.checkpoint()
            async with super().read() as tx:
                yield tx

    book = Book(Remote(), FakeClock(1_000))
    await book.create("t", 60_000, 1)
    with anyio.CancelScope() as scope:
        scope.cancel()
        task = await book.get("t")
    assert task.id == "t"
