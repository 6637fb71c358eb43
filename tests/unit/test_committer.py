"""Group commit (``gateway.book.committer`` over ``Book.callbacks``), on the in-memory store: no socket.

What a worker would notice: every callback gets its own answer (one refused callback never fails its
neighbours), duplicates inside one batch are still duplicates, answers come only after the commit, a
failed commit fails every callback of its batch (so each retries) and nothing of it is written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import orjson
import pytest

from gateway.book.book import Book, CallbackOutcome, CallbackRequest
from gateway.book.committer import Committer
from gateway.errors import Conflict, GatewayError, InvalidRequest, UnknownTask
from gateway.machine import Event, Progress, Start, Succeed
from gateway.store.memory import MemoryStore
from tests.support import FakeClock

pytestmark = pytest.mark.anyio


def start(worker: str = "w1") -> Callable[[int], Event]:
    return lambda now: Start(now, worker)


def progress(value: int, cursor: str = "c") -> Callable[[int], Event]:
    return lambda now: Progress(now, value, cursor)


def succeed() -> Callable[[int], Event]:
    return lambda now: Succeed(now, "s3://r", "sha256:1")


async def book_with(*task_ids: str) -> Book:
    book = Book(MemoryStore(), FakeClock())
    for task_id in task_ids:
        await book.create(task_id, 600_000, 3)
    return book


async def history(book: Book, task_id: str) -> list[dict[str, Any]]:
    return [orjson.loads(raw) for _, raw in await book.entries_between(task_id, 0, 10**9)]


async def test_each_callback_of_a_batch_gets_its_own_outcome() -> None:
    book = await book_with("a", "b")
    outcomes = await book.callbacks(
        [
            CallbackRequest("a", start(), "a-start", "d1"),
            CallbackRequest("a", progress(101), "a-bad", "d2", attempt=1),  # refused by the machine
            CallbackRequest("b", start(), "b-start", "d3"),
            CallbackRequest("a", start(), "a-start", "d1"),  # the same callback again: a duplicate
            CallbackRequest("a", start(), "a-start", "other"),  # the same id, another body
            CallbackRequest("a", progress(10), None, "", attempt=7),  # another attempt's
            CallbackRequest("a", progress(40), "a-p40", "d4", attempt=1),
            CallbackRequest("nope", start(), "x", "d5"),
            CallbackRequest("b", succeed(), "b-done", "d6", attempt=1),
        ]
    )
    kinds = [type(o).__name__ if isinstance(o, GatewayError) else o.transition.reason for o in outcomes]
    assert kinds == [
        "started",
        "InvalidRequest",
        "started",
        "duplicate-callback",
        "Conflict",
        "Conflict",
        "progress",
        "UnknownTask",
        "succeeded",
    ]
    assert isinstance(outcomes[4], Conflict) and outcomes[4].code == "callback-id-reused"
    assert isinstance(outcomes[5], Conflict) and outcomes[5].code == "stale-attempt"
    # The versions follow each other within the batch, each event stamped, nothing of the refused ones.
    assert [e["type"] for e in await history(book, "a")] == ["start", "progress"]
    assert [e["type"] for e in await history(book, "b")] == ["start", "succeed"]
    a = await book.get("a")
    assert (a.version, a.progress, a.attempts) == (2, 40, 1)
    assert (await book.get("b")).state == "succeeded"
    # The refused callback's id was not remembered: sent again with a valid body, it applies.
    (again,) = await book.callbacks([CallbackRequest("a", progress(50), "a-bad", "d2", attempt=1)])
    assert isinstance(again, CallbackOutcome) and again.transition.reason == "progress"


async def test_callbacks_queued_during_a_commit_form_the_next_batch_answered_after_its_commit() -> None:
    book = await book_with("t")
    committer = Committer(book)
    real = book.callbacks
    sizes: list[int] = []
    first_held, release = anyio.Event(), anyio.Event()

    async def held(requests: Sequence[CallbackRequest]) -> list[CallbackOutcome | GatewayError]:
        sizes.append(len(requests))
        if len(sizes) == 1:
            first_held.set()
            await release.wait()  # the first batch's commit is slow
        return await real(requests)

    book.callbacks = held  # type: ignore[method-assign]
    answers: dict[int, str] = {}

    async def post(i: int, make: Callable[[int], Event], attempt: int | None) -> None:
        outcome = await committer.submit(CallbackRequest("t", make, f"cb-{i}", f"d-{i}", attempt))
        answers[i] = outcome.transition.reason

    async with anyio.create_task_group() as tg:
        tg.start_soon(committer.run)
        await anyio.lowlevel.checkpoint()
        tg.start_soon(post, 0, start(), None)
        with anyio.fail_after(5):
            await first_held.wait()
        for i in range(1, 10):
            tg.start_soon(post, i, progress(i * 10), 1)
        for _ in range(20):
            await anyio.lowlevel.checkpoint()
        assert answers == {}  # nothing answered before its commit
        release.set()
        with anyio.fail_after(5):
            while len(answers) < 10:
                await anyio.lowlevel.checkpoint()
        tg.cancel_scope.cancel()
    assert sizes == [1, 9]  # the nine that arrived during the first commit: one batch, one commit
    assert answers == {0: "started", **{i: "progress" for i in range(1, 10)}}
    assert [
        e["version"] for e in [{"version": v} for v, _ in await book.entries_between("t", 0, 99)]
    ] == list(range(1, 11))


async def test_a_failed_commit_fails_every_callback_of_its_batch_and_writes_nothing() -> None:
    book = await book_with("t")
    committer = Committer(book)
    store = book.store
    assert isinstance(store, MemoryStore)
    real_transact = store.transact

    async def failing_transact(*args: Any, **kwargs: Any) -> Any:
        raise OSError("the database went away")

    store.transact = failing_transact  # type: ignore[method-assign]
    errors: list[BaseException] = []

    async def post(i: int) -> None:
        try:
            await committer.submit(CallbackRequest("t", start(f"w{i}"), f"cb-{i}", f"d-{i}"))
        except OSError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(committer.run)
        await anyio.lowlevel.checkpoint()
        async with anyio.create_task_group() as posts:
            for i in range(5):
                posts.start_soon(post, i)
        tg.cancel_scope.cancel()
    assert len(errors) == 5
    store.transact = real_transact  # type: ignore[method-assign]
    assert (await book.get("t")).version == 0
    assert await book.entries_between("t", 0, 99) == []


async def test_a_refused_callback_in_a_batch_is_raised_to_its_own_caller_only() -> None:
    book = await book_with("t")
    committer = Committer(book)
    results: dict[str, object] = {}

    async def post(name: str, request: CallbackRequest) -> None:
        try:
            results[name] = (await committer.submit(request)).transition.reason
        except (InvalidRequest, UnknownTask) as exc:
            results[name] = type(exc).__name__

    async with anyio.create_task_group() as tg:
        tg.start_soon(committer.run)
        await anyio.lowlevel.checkpoint()
        async with anyio.create_task_group() as posts:
            posts.start_soon(post, "good", CallbackRequest("t", start(), "g", "d"))
            posts.start_soon(post, "unknown", CallbackRequest("nope", start(), "u", "d"))
            posts.start_soon(post, "bad", CallbackRequest("t", lambda now: Start(-1, "w"), "b", "d"))
        tg.cancel_scope.cancel()
    assert results == {"good": "started", "unknown": "UnknownTask", "bad": "InvalidRequest"}


async def test_with_several_commits_in_flight_a_slow_commit_holds_up_only_its_own_batch() -> None:
    """On PostgreSQL batches commit side by side (``concurrency``): a batch whose commit is held up (here:
    it waits before it starts, as a commit stuck behind a slow disk would) does not hold up the callbacks
    that arrive after it; with one commit at a time (SQLite) they would wait for it."""
    book = await book_with("a", "b")
    committer = Committer(book, concurrency=2)
    store = book.store
    assert isinstance(store, MemoryStore)
    real_transact = store.transact
    held = anyio.Event()
    release = anyio.Event()

    async def transact(work: Any, *, urgent: bool = False) -> Any:
        if not held.is_set():  # the first batch is the slow one
            held.set()
            await release.wait()
        return await real_transact(work, urgent=urgent)

    store.transact = transact  # type: ignore[method-assign]
    answered: list[str] = []
    answers = {"a": anyio.Event(), "b": anyio.Event()}

    async def post(task_id: str) -> None:
        await committer.submit(CallbackRequest(task_id, start(), f"{task_id}-start", "d"))
        answered.append(task_id)
        answers[task_id].set()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(committer.run)
            tg.start_soon(post, "a")
            await held.wait()
            tg.start_soon(post, "b")
            await answers["b"].wait()  # answered while "a" is held up
            assert answered == ["b"]
            release.set()
            await answers["a"].wait()
            tg.cancel_scope.cancel()
    assert answered == ["b", "a"]
    assert [(await book.get(t)).state for t in ("a", "b")] == ["running", "running"]


# --- how many batches commit at once ----------------------------------------------------------------------


def test_the_processes_of_one_gateway_serve_share_the_batches_in_flight() -> None:
    """On PostgreSQL one process commits several batches at once; the processes of ``--workers N`` share
    that number (one each at least), so that their batches are as large as one process's."""
    from gateway.runtime import COMMITS_IN_FLIGHT, Gateway
    from gateway.settings import Settings

    def in_flight(database_url: str, workers: int = 1) -> int:
        settings = Settings(database_url=database_url, api_key="k", secret="s" * 32, workers=workers)
        return Gateway(settings, lambda: 0).committer.concurrency

    pg = "postgresql://gw@db.internal/gateway"
    assert in_flight(pg) == COMMITS_IN_FLIGHT > 1
    assert [in_flight(pg, workers) for workers in (2, 3, 6)] == [1, 1, 1]
    assert in_flight("sqlite:///gateway.db") == 1  # writes take turns there anyway
