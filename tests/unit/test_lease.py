"""Heartbeat leases (gateway.lease), as decisions and over the book on the in-memory store: what renews a
lease, what a heartbeat answers, and how an ended lease fails the attempt with the task machine's own
event."""

from __future__ import annotations

from collections.abc import Sequence

import orjson
import pytest

from gateway.book.book import Book, CallbackRequest
from gateway.book.listeners import Listeners
from gateway.errors import Conflict
from gateway.lease import Lease, heartbeat, lease_of, renewal, timed_out
from gateway.machine import (
    Fail,
    Progress,
    Start,
    Succeed,
    Task,
    apply_event,
    cancel_task,
    create_task,
    task_to_json,
)
from gateway.store.memory import MemoryStore
from gateway.web.render import notifications_body
from tests.support import FakeClock

pytestmark = pytest.mark.anyio

NOW = 1_000_000
HEARTBEAT_MS = 2_000


def running(max_attempts: int = 3, ttl_ms: int = 600_000) -> Task:
    queued = create_task(id="t", now_ms=NOW, ttl_ms=ttl_ms, max_attempts=max_attempts)
    return apply_event(queued, Start(NOW, "w1")).task


# --- the decisions ----------------------------------------------------------------------------------------


def test_a_running_task_with_a_lease_is_renewed_from_now() -> None:
    task = running()
    assert renewal(task, HEARTBEAT_MS, NOW + 500) == NOW + 500 + HEARTBEAT_MS
    assert renewal(task, None, NOW + 500) is None  # created without heartbeatMs: nothing to renew
    queued = create_task(id="q", now_ms=NOW, ttl_ms=600_000, max_attempts=3)
    assert renewal(queued, HEARTBEAT_MS, NOW) is None  # only a running attempt holds a lease
    done = apply_event(task, Succeed(NOW + 1, "r", "h")).task
    assert renewal(done, HEARTBEAT_MS, NOW + 1) is None


def test_a_worker_is_told_its_lease_only_while_its_task_runs() -> None:
    task = running()
    assert lease_of(task, HEARTBEAT_MS, NOW + 5) == Lease(NOW + 5, HEARTBEAT_MS)
    assert lease_of(task, None, None) == Lease(None, None)
    assert lease_of(apply_event(task, Succeed(NOW + 1, "r", "h")).task, HEARTBEAT_MS, NOW) is None


def test_a_heartbeat_is_taken_only_on_a_running_task_and_says_what_became_of_the_attempt() -> None:
    task = running()
    beat = heartbeat(task)
    assert (beat.task, beat.changed, beat.entry, beat.notify) == (task, False, None, False)
    requeued = apply_event(task, Fail(NOW + 1, "oops", True)).task
    with pytest.raises(Conflict) as refused:
        heartbeat(requeued)
    assert refused.value.code == "not-running" and "queued" in refused.value.message
    failed = apply_event(running(max_attempts=1), Fail(NOW + 1, "oops", False)).task
    with pytest.raises(Conflict, match="ended \\(failed, error 'oops'\\)") as ended:
        heartbeat(failed)
    assert ended.value.code == "not-running"
    # The refusal carries the task, beside the error, so a worker tells a cancel from a requeue.
    assert ended.value.to_json()["task"] == task_to_json(failed)
    cancelled = cancel_task(task, NOW + 1, "wrong export").task
    with pytest.raises(Conflict) as stopped:
        heartbeat(cancelled)
    assert stopped.value.to_json()["task"]["error"] == "cancelled"


def test_an_ended_lease_is_the_task_machines_retryable_fail_at_the_leases_end() -> None:
    end = NOW + HEARTBEAT_MS
    requeued = timed_out(running(max_attempts=2), end)
    assert requeued.reason == "requeued" and requeued.task.state == "queued" and not requeued.notify
    assert requeued.entry is not None
    assert requeued.entry.event == Fail(end, "heartbeat-timeout", True)
    assert requeued.task.error == "heartbeat-timeout"
    # The machine decides, as for any fail: the last attempt fails for good, with a notification.
    last = timed_out(running(max_attempts=1), end)
    assert (last.reason, last.task.state, last.notify) == ("failed", "failed", True)
    # A lease that ends at or after the deadline: the deadline comes first, as for any event.
    late = timed_out(running(ttl_ms=1_000), NOW + 5_000)
    assert late.reason == "expired" and late.entry is not None and late.entry.event.at_ms == NOW + 1_000


# --- over the book ------------------------------------------------------------------------------------------


class Heard:
    def __init__(self) -> None:
        self.deadlines: list[int] = []
        self.ended: list[list[int]] = []

    def listeners(self) -> Listeners:
        return Listeners(deadline=[self.deadlines.append], leases_ended=[self.lease_ends])

    def lease_ends(self, ends: Sequence[int]) -> None:
        self.ended.append(list(ends))


async def entries(book: Book, task_id: str) -> list[dict[str, object]]:
    async with book.store.read() as tx:
        return [orjson.loads(raw) for _, raw in await tx.entries(task_id, 0, 1_000)]


async def test_every_callback_of_the_running_attempt_renews_its_lease_and_a_retry_does_not() -> None:
    clock, heard = FakeClock(NOW), Heard()
    book = Book(MemoryStore(), clock, listeners=heard.listeners())
    await book.create("t", 600_000, 3, HEARTBEAT_MS)
    started = await book.callback("t", lambda now: Start(now, "w1"), callback_id="s")
    assert started.lease == Lease(NOW + HEARTBEAT_MS, HEARTBEAT_MS)
    assert heard.deadlines[-1] == NOW + HEARTBEAT_MS  # the sweeper is told of the new lease's end
    clock.advance(1_500)
    progress = await book.callback("t", lambda now: Progress(now, 10, "c"), callback_id="p", attempt=1)
    assert progress.lease == Lease(NOW + 1_500 + HEARTBEAT_MS, HEARTBEAT_MS)
    clock.advance(100)
    same = await book.callback("t", lambda now: Progress(now, 10, "c"), callback_id="p2", attempt=1)
    assert same.transition.reason == "duplicate-progress"
    assert same.lease == Lease(NOW + 1_600 + HEARTBEAT_MS, HEARTBEAT_MS)  # no entry, yet a sign of life
    clock.advance(100)
    retry = await book.callback("t", lambda now: Progress(now, 10, "c"), callback_id="p2", attempt=1)
    assert retry.duplicate_callback
    assert retry.lease == same.lease  # a retry of a callback already applied renews nothing
    beat = await book.callbacks([CallbackRequest("t", None, attempt=1)])
    assert not isinstance(beat[0], Exception)
    assert beat[0].lease == Lease(NOW + 1_700 + HEARTBEAT_MS, HEARTBEAT_MS)
    assert [e["type"] for e in await entries(book, "t")] == ["start", "progress"]  # a heartbeat adds none
    assert (await book.get("t")).version == 2


async def test_a_heartbeat_is_fenced_by_attempt_and_refused_on_a_task_that_is_not_running() -> None:
    clock = FakeClock(NOW)
    book = Book(MemoryStore(), clock)
    await book.create("t", 600_000, 3, HEARTBEAT_MS)
    await book.create("plain", 600_000, 3)

    async def beat(task_id: str, attempt: int) -> object:
        (outcome,) = await book.callbacks([CallbackRequest(task_id, None, attempt=attempt)])
        return outcome

    refused = await beat("t", 0)
    assert isinstance(refused, Conflict) and refused.code == "not-running"  # queued, never started
    await book.callback("t", lambda now: Start(now, "w1"))
    stale = await beat("t", 2)
    assert isinstance(stale, Conflict) and stale.code == "stale-attempt"
    missing = await beat("nope", 1)
    assert isinstance(missing, Exception) and getattr(missing, "code", None) == "unknown-task"
    # A running task created without heartbeatMs: nothing to renew, and the attempt is still current.
    await book.callback("plain", lambda now: Start(now, "w1"))
    plain = await beat("plain", 1)
    assert not isinstance(plain, Exception) and plain.lease == Lease(None, None)  # type: ignore[attr-defined]


async def test_an_ended_lease_requeues_the_attempt_then_fails_the_last_and_fences_its_worker() -> None:
    clock, heard = FakeClock(NOW), Heard()
    book = Book(MemoryStore(), clock, listeners=heard.listeners())
    await book.create("t", 600_000, 2, HEARTBEAT_MS)
    await book.callback("t", lambda now: Start(now, "w1"))
    clock.advance(HEARTBEAT_MS - 1)
    assert await book.next_due() == (NOW + 600_000, NOW + HEARTBEAT_MS)  # the sweeper's next work
    assert await book.end_leases() == 0  # not yet
    clock.advance(1)
    assert await book.end_leases() == 1
    assert heard.ended == [[NOW + HEARTBEAT_MS]]
    task = await book.get("t")
    assert (task.state, task.attempts, task.error) == ("queued", 1, "heartbeat-timeout")
    assert (await entries(book, "t"))[-1] == {
        "type": "fail",
        "atMs": NOW + HEARTBEAT_MS,
        "error": "heartbeat-timeout",
        "retryable": True,
    }
    assert (await book.drain(notifications_body)).taken == ()  # requeued: nothing to notify
    # The vanished worker is fenced once the next attempt has started.
    await book.callback("t", lambda now: Start(now, "w2"))
    with pytest.raises(Conflict, match="attempt 1 is not"):
        await book.callback("t", lambda now: Progress(now, 50, "c"), attempt=1)
    # The last attempt's lease ends too: failed for good, notified at the lease's end.
    clock.advance(10_000)
    assert await book.end_leases() == 1
    assert (await book.get("t")).state == "failed"
    (notification,) = (await book.drain(notifications_body)).taken
    assert (notification.state, notification.at_ms) == (
        "failed",
        NOW + 2 * HEARTBEAT_MS,
    )  # w2 started at NOW + 2 s
    assert await book.end_leases() == 0  # a lease is ended once


async def test_a_repeated_create_with_another_heartbeat_is_another_create() -> None:
    book = Book(MemoryStore(), FakeClock(NOW))
    _, created = await book.create("t", 600_000, 3, HEARTBEAT_MS)
    assert created
    _, again = await book.create("t", 600_000, 3, HEARTBEAT_MS)
    assert not again
    for other in (None, 3_000):
        with pytest.raises(Conflict, match="heartbeatMs 2000") as conflict:
            await book.create("t", 600_000, 3, other)
        assert conflict.value.code == "task-exists"
    await book.create("plain", 600_000, 3)
    with pytest.raises(Conflict, match="heartbeatMs none"):
        await book.create("plain", 600_000, 3, HEARTBEAT_MS)
