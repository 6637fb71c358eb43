"""Concurrency against a real server, on SQLite and PostgreSQL: many requests at once on one task, one
callback id, one task id, one Idempotency-Key, and the notification outbox.

Every request of a burst is fired at once over httpx (one task group); the answers, and what the store
holds afterwards, must be those of some serial order: no lost update, no gap or repeat in the versions,
no second state change for a repeated callback, create, delivery or drain.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import httpx
import pytest
from sqlalchemy import func, select

from gateway.jobs.sweeper import sweep_once
from gateway.store.tables import deliveries
from tests.support import (
    FakeClock,
    Running,
    create_task,
    post_callback,
    reap_leftover_driver_tasks,
    running_gateway,
)

# Bounds every burst: a deadlock or a lost wake-up fails the test instead of hanging it.
BURST_TIMEOUT_S = 60


@pytest.fixture(autouse=True)
async def _reap_driver_tasks() -> AsyncIterator[None]:
    """A SQLite gateway stopped in the middle of a query can leave a database-driver task that never ends,
    which hangs the event loop's shutdown (test_expiry.py's
    test_stopping_during_a_sweep_leaves_no_driver_task_behind guards against it): give such tasks a
    second to end, then cancel them until they do, so that a regression cannot hang the whole run."""
    yield
    await reap_leftover_driver_tasks()


class TickingClock(FakeClock):
    """A fake clock that moves one millisecond every time it is read: two stamps are never equal, so an
    equal stamp in two answers means one write, not two."""

    def __call__(self) -> int:
        self.now += 1
        return self.now


async def burst(calls: list[Callable[[], Awaitable[httpx.Response]]]) -> list[httpx.Response]:
    """Run every call at once; the answers in the order of ``calls``."""
    answers: list[httpx.Response | None] = [None] * len(calls)

    async def one(i: int) -> None:
        answers[i] = await calls[i]()

    with anyio.fail_after(BURST_TIMEOUT_S):
        async with anyio.create_task_group() as tg:
            for i in range(len(calls)):
                tg.start_soon(one, i)
    assert all(a is not None for a in answers)
    return [a for a in answers if a is not None]


async def history(gw: Running, task_id: str) -> dict[str, Any]:
    answer = await gw.client.get(f"/v1/tasks/{task_id}/events", params={"cursor": 0})
    assert answer.status_code == 200, answer.text
    body = dict(answer.json())
    # A snapshot would hide the entries; the tests raise retention so that cursor 0 is always a delta.
    assert body["mode"] in ("delta", "caught-up"), body
    return body


@pytest.mark.anyio
async def test_concurrent_progress_callbacks_never_lose_an_update(database_url: str) -> None:
    rng = random.Random(20240611)
    progress_values = [rng.randint(1, 100) for _ in range(50)]
    async with running_gateway(database_url, retention_versions=10_000) as gw:
        made = await create_task(gw, "busy")
        token = made["callbackToken"]
        started = await post_callback(gw, "busy", token, {"type": "start", "worker": "w1"})
        assert started["reason"] == "started"

        def progress_callback(i: int, p: int) -> Callable[[], Awaitable[httpx.Response]]:
            event = {"type": "progress", "progress": p, "cursor": f"c{i}"}
            return lambda: post_callback(gw, "busy", token, event, callback_id=f"busy-{i}", expect=None)

        answers = await burst([progress_callback(i, p) for i, p in enumerate(progress_values)])

        assert [a.status_code for a in answers] == [200] * 50, [
            a.text for a in answers if a.status_code != 200
        ]
        bodies = [a.json() for a in answers]
        assert all(b["duplicateCallback"] is False for b in bodies)
        reasons = Counter(b["reason"] for b in bodies)
        assert set(reasons) <= {"progress", "stale-progress", "duplicate-progress"}, reasons
        changed = [b for b in bodies if b["changed"]]
        assert all(b["reason"] == "progress" for b in changed)
        assert all(not b["changed"] for b in bodies if b["reason"] != "progress")

        body = await history(gw, "busy")
        entries = body["events"]
        versions = [e["version"] for e in entries]
        n = body["task"]["version"]
        assert versions == list(range(1, n + 1)), "versions must be 1..N with no gap or repeat"
        assert body["version"] == n
        assert n == 1 + len(changed)
        assert entries[0]["event"]["type"] == "start"
        assert all(e["event"]["type"] == "progress" for e in entries[1:])

        # Each changed answer is one entry: its version, holding its progress and its cursor.
        by_version = {e["version"]: e["event"] for e in entries}
        assert len({b["task"]["version"] for b in changed}) == len(changed)
        for b in changed:
            event = by_version[b["task"]["version"]]
            assert event["progress"] == b["task"]["progress"]
        cursors = [e["event"]["cursor"] for e in entries[1:]]
        assert len(set(cursors)) == len(cursors)

        # Stale progress was refused: the history only climbs, up to the largest value sent.
        progress = [e["event"]["progress"] for e in entries[1:]]
        assert progress == sorted(set(progress)), "progress in the history must be strictly increasing"
        assert progress[-1] == max(progress_values)
        assert body["task"]["progress"] == max(progress_values)
        # The answers of the refused ones are the task life's: stale (below) or duplicate (equal).
        for b in bodies:
            if b["reason"] == "stale-progress":
                assert b["duplicate"] is False
            if b["reason"] == "duplicate-progress":
                assert b["duplicate"] is True


@pytest.mark.anyio
async def test_one_callback_id_sent_concurrently_changes_the_task_once(database_url: str) -> None:
    async with running_gateway(database_url, retention_versions=10_000) as gw:
        token = (await create_task(gw, "retried"))["callbackToken"]
        await post_callback(gw, "retried", token, {"type": "start", "worker": "w1"})
        before = await history(gw, "retried")

        event = {"type": "progress", "progress": 42, "cursor": "row-42"}
        answers = await burst(
            [
                lambda: post_callback(gw, "retried", token, event, callback_id="the-one", expect=None)
                for _ in range(20)
            ]
        )

        assert [a.status_code for a in answers] == [200] * 20, [a.text for a in answers]
        bodies = [a.json() for a in answers]
        firsts = [b for b in bodies if not b["duplicateCallback"]]
        assert len(firsts) == 1
        assert firsts[0]["changed"] is True and firsts[0]["reason"] == "progress"
        repeats = [b for b in bodies if b["duplicateCallback"]]
        assert len(repeats) == 19
        assert all(b["changed"] is False and b["reason"] == "duplicate-callback" for b in repeats)

        after = await history(gw, "retried")
        assert len(after["events"]) == len(before["events"]) + 1
        assert after["task"]["version"] == before["task"]["version"] + 1
        assert after["events"][-1]["event"]["progress"] == 42


@pytest.mark.anyio
async def test_concurrent_creates_of_one_id(database_url: str) -> None:
    clock = FakeClock()
    async with running_gateway(database_url, clock=clock) as gw:
        same = {"id": "twin", "ttlMs": 60_000, "maxAttempts": 2}
        answers = await burst([lambda: gw.client.post("/v1/tasks", json=same) for _ in range(20)])
        statuses = Counter(a.status_code for a in answers)
        assert statuses == {201: 1, 200: 19}, [a.text for a in answers if a.status_code not in (200, 201)]
        tasks = [a.json()["task"] for a in answers]
        assert all(t == tasks[0] for t in tasks), "every answer describes the one task"
        assert tasks[0]["version"] == 0 and tasks[0]["state"] == "queued"
        # Fresh tokens in every answer, each good for the one task.
        token = answers[-1].json()["callbackToken"]
        started = await post_callback(gw, "twin", token, {"type": "start", "worker": "w"})
        assert started["task"]["version"] == 1

        # Different parameters: one wins, every other is a conflict, and the winner's parameters stick.
        def rival(i: int) -> Callable[[], Awaitable[httpx.Response]]:
            body = {"id": "rival", "ttlMs": 10_000 + i, "maxAttempts": 1}
            return lambda: gw.client.post("/v1/tasks", json=body)

        answers = await burst([rival(i) for i in range(20)])
        statuses = Counter(a.status_code for a in answers)
        assert statuses == {201: 1, 409: 19}, [a.text for a in answers if a.status_code not in (201, 409)]
        assert all(a.json()["error"]["code"] == "task-exists" for a in answers if a.status_code == 409)
        winner = next(i for i, a in enumerate(answers) if a.status_code == 201)
        got = await gw.client.get("/v1/tasks/rival")
        assert got.json()["expiresAtMs"] == clock.now + 10_000 + winner
        assert got.json()["version"] == 0


@pytest.mark.anyio
async def test_concurrent_deliveries_with_one_key_make_one_receipt(database_url: str) -> None:
    async with running_gateway(database_url, clock=TickingClock()) as gw:
        token = (await create_task(gw, "done"))["callbackToken"]
        await post_callback(gw, "done", token, {"type": "start", "worker": "w"})
        succeeded = await post_callback(
            gw, "done", token, {"type": "succeed", "resultRef": "s3://b/done", "resultHash": "sha256:d"}
        )
        assert succeeded["reason"] == "succeeded"

        answers = await burst(
            [
                lambda: gw.client.post(
                    "/v1/tasks/done/deliveries", headers={"Idempotency-Key": "deliver-once"}
                )
                for _ in range(20)
            ]
        )
        assert [a.status_code for a in answers] == [200] * 20, [a.text for a in answers]
        bodies = [a.json() for a in answers]
        assert all(b["ok"] is True for b in bodies)
        assert Counter(b["duplicate"] for b in bodies) == {False: 1, True: 19}
        assert Counter(b["reason"] for b in bodies) == {"delivered": 1, "duplicate-delivery": 19}
        receipts = [b["receipt"] for b in bodies]
        assert all(r == receipts[0] for r in receipts), "one receipt: the same deliveredAtMs for every answer"
        assert receipts[0]["resultRef"] == "s3://b/done" and receipts[0]["idempotencyKey"] == "deliver-once"

        async with gw.gateway.db.read() as conn:
            stored = (await conn.execute(select(func.count()).select_from(deliveries))).scalar_one()
        assert stored == 1


@pytest.mark.anyio
async def test_concurrent_drains_take_each_notification_once(database_url: str) -> None:
    clock = FakeClock()
    async with running_gateway(database_url, clock=clock, sweep_interval_ms=0) as gw:
        expected: dict[str, str] = {}
        for i in range(30):
            task_id = f"t{i:02d}"
            kind = ("succeeded", "failed", "expired")[i % 3]
            made = await create_task(
                gw, task_id, ttl_ms=1_000 if kind == "expired" else 600_000, max_attempts=1
            )
            if kind != "expired":
                token = made["callbackToken"]
                await post_callback(gw, task_id, token, {"type": "start", "worker": "w"})
                event = (
                    {"type": "succeed", "resultRef": f"r/{task_id}", "resultHash": "h"}
                    if kind == "succeeded"
                    else {"type": "fail", "error": "boom", "retryable": False}
                )
                answer = await post_callback(gw, task_id, token, event)
                assert answer["reason"] == kind, answer
            expected[task_id] = kind
        clock.advance(1_000)
        assert await sweep_once(gw.gateway.book) == 10

        answers = await burst([lambda: gw.client.post("/v1/notifications/drain") for _ in range(10)])
        assert [a.status_code for a in answers] == [200] * 10, [a.text for a in answers]
        lists = [a.json() for a in answers]
        seen = [(n["taskId"], n["state"], n["version"]) for drained in lists for n in drained]
        assert len(seen) == len(set(seen)) == 30, "every notification in exactly one drain answer"
        assert {t: s for t, s, _ in seen} == expected
        for drained in lists:  # each answer in protocol.md's order (Notifications): by task id, then time
            assert [n["taskId"] for n in drained] == sorted(n["taskId"] for n in drained)
        for n in (n for drained in lists for n in drained):
            if n["state"] == "expired":
                assert n["atMs"] == clock.now and n["version"] == 1
            else:
                assert n["version"] == 2

        again = await gw.client.post("/v1/notifications/drain")
        assert again.status_code == 200 and again.json() == []
