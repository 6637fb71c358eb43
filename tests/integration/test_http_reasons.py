"""Every reason string of protocol.md's task life, reached through the HTTP API, with the whole answer
checked.

Each callback answer is compared whole: ``changed``, ``duplicate``, ``duplicateCallback``, ``notify``,
``reason`` and every field of ``task``. Then the protocol's 409s of callbacks, creation and delivery, the
drain, and ``GET /v1/tasks/{id}/events`` (protocol.md, Resuming).

Flows that write or read stored state run on both databases (``database_url``); pure HTTP-shape checks
use ``sqlite_url`` only, to keep the suite fast. Time is a :class:`FakeClock`, so every ``atMs`` and
``expiresAtMs`` is known exactly.

Two reasons of the task life cannot appear in an HTTP answer, and are covered as follows:

- ``duplicate-expire`` is what ``expireTask`` (or an ``expire`` event) answers on an expired task. A
  callback cannot carry type ``expire`` (``400``, see test_http_bad_input.py), and any other callback on an
  expired task is ``terminal-conflict`` (the task life's order). Only the sweeper expires tasks as a system
  action; :func:`test_sweeper_expires_at_the_deadline` checks that it expires a task once and never again
  (another pass changes nothing, and the state machine answers ``duplicate-expire`` for that task as stored),
  and the unit tests (tests/unit/test_machine.py) cover the reason itself.
- ``not-startable`` needs a queued task whose ``attempts`` reached ``maxAttempts``, which no sequence of
  callbacks produces (a requeue happens only while ``attempts < maxAttempts``). The test seeds such a row
  in the store, as a migration or an operator could leave it, and then reaches the reason through HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import pytest
from sqlalchemy import update

from gateway.jobs.sweeper import sweep_once
from gateway.machine import expire_task
from gateway.store.tables import tasks as tasks_table
from tests.support import (
    FakeClock,
    Running,
    bearer,
    create_task,
    error,
    eventually,
    post_callback,
    running_gateway,
)

pytestmark = pytest.mark.anyio

TTL = 60_000


# --- helpers ----------------------------------------------------------------------------------------------


# What the gateway records of a task's runs (protocol.md, Shapes): the last start's worker and time, the end.
# Beside the history, and checked by test_batches.py and the store conformance: these tests hold the task to
# what its history makes.
RUNS = ("worker", "startedAtMs", "endedAtMs")


class Expected(dict[str, Any]):
    """The task a test expects, equal to a task's JSON whatever its ``RUNS`` fields (compared first, being a
    subclass, on either side of ``==``, in a dict of an answer too)."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, dict):
            return NotImplemented
        return {k: v for k, v in self.items() if k not in RUNS} == {
            k: v for k, v in other.items() if k not in RUNS
        }

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None


@dataclass
class Handle:
    """One task created through the API, with its tokens and the task we expect the gateway to hold."""

    gw: Running
    id: str
    callback_token: str
    subscribe_token: str
    expected: dict[str, Any] = field(default_factory=dict)

    @classmethod
    async def create(cls, gw: Running, task_id: str, *, ttl_ms: int = TTL, max_attempts: int = 2) -> Handle:
        """Create the task (open mode); check that it is queued with the given parameters."""
        made = await create_task(gw, task_id, ttl_ms=ttl_ms, max_attempts=max_attempts)
        handle = cls(gw, task_id, made.callback_token, made.subscribe_token)
        handle.expected = Expected(
            {
                "id": task_id,
                "state": "queued",
                "expiresAtMs": gw.gateway.clock() + ttl_ms,
                "attempts": 0,
                "maxAttempts": max_attempts,
                "progress": 0,
                "version": 0,
                # The gateway's own fields: no tags asked for, created by the gateway's clock now.
                "tags": [],
                "createdAtMs": gw.gateway.clock(),
                # And which history of its id it is: 12 hex digits made at random (protocol.md, Resuming).
                "epoch": made.task["epoch"],
                # Beside the history: no metadata, no change of it.
                "metadata": {},
                "revision": 0,
            }
        )
        assert made.task == handle.expected
        assert len(made.task["epoch"]) == 12 and int(made.task["epoch"], 16) >= 0
        return handle

    @property
    def cb(self) -> dict[str, str]:
        return bearer(self.callback_token)

    @property
    def sub(self) -> dict[str, str]:
        return bearer(self.subscribe_token)

    async def post(
        self, event: dict[str, Any], *, callback_id: str | None = None, attempt: int | None = None
    ) -> httpx.Response:
        """Send a callback; the response as it came."""
        return await post_callback(
            self.gw,
            self.id,
            self.callback_token,
            event,
            callback_id=callback_id,
            attempt=attempt,
            expect=None,
        )

    async def get(self) -> dict[str, Any]:
        answer = await self.gw.client.get(f"/v1/tasks/{self.id}", headers=self.sub)
        assert answer.status_code == 200, answer.text
        return answer.json()  # type: ignore[no-any-return]

    async def events(self, cursor: Any) -> httpx.Response:
        return await self.gw.client.get(
            f"/v1/tasks/{self.id}/events", params={"cursor": cursor}, headers=self.sub
        )

    async def history(self) -> list[dict[str, Any]]:
        answer = await self.events(0)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["mode"] in ("delta", "caught-up"), body
        return body["events"]  # type: ignore[no-any-return]

    async def expect(
        self,
        event: dict[str, Any],
        reason: str,
        *,
        changed: bool,
        duplicate: bool = False,
        notify: bool = False,
        duplicate_callback: bool = False,
        status: int = 200,
        callback_id: str | None = None,
        attempt: int | None = None,
    ) -> dict[str, Any]:
        """Send a callback; check the status and the whole answer against ``self.expected``."""
        body = await post_callback(
            self.gw,
            self.id,
            self.callback_token,
            event,
            callback_id=callback_id,
            attempt=attempt,
            expect=status,
        )
        assert body == {
            "changed": changed,
            "duplicate": duplicate,
            "duplicateCallback": duplicate_callback,
            "notify": notify,
            "reason": reason,
            "task": self.expected,
        }
        return body

    def becomes(self, **changes: Any) -> None:
        """The task we expect after a change: the given fields, and ``version`` one higher."""
        self.expected = Expected({**self.expected, **changes, "version": self.expected["version"] + 1})


@asynccontextmanager
async def gateway(url: str, clock: FakeClock, **overrides: Any) -> AsyncIterator[Running]:
    """A gateway with the background sweeper off (unless asked for), so that only callbacks expire tasks."""
    async with running_gateway(url, clock=clock, **{"sweep_interval_ms": 0, **overrides}) as gw:
        yield gw


START = {"type": "start", "worker": "w1"}
SUCCEED = {"type": "succeed", "resultRef": "s3://bucket/r", "resultHash": "sha256:aa"}


def progress(n: int, cursor: str = "c") -> dict[str, Any]:
    return {"type": "progress", "progress": n, "cursor": cursor}


def failure(retryable: bool, error: str = "boom") -> dict[str, Any]:
    return {"type": "fail", "error": error, "retryable": retryable}


def stamped(event: dict[str, Any], at_ms: int) -> dict[str, Any]:
    return {**event, "atMs": at_ms}


# --- the task life's reasons ------------------------------------------------------------------------------


async def test_started_progress_succeeded(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        t = await Handle.create(gw, "r-1")
        t0 = clock()
        t.becomes(state="running", attempts=1)
        await t.expect(START, "started", changed=True)
        clock.advance(10)
        t.becomes(progress=40)
        await t.expect(progress(40, "row-400"), "progress", changed=True)
        clock.advance(10)
        t.becomes(state="succeeded", progress=100, resultRef="s3://bucket/r", resultHash="sha256:aa")
        await t.expect(SUCCEED, "succeeded", changed=True, notify=True)

        assert await t.get() == t.expected
        assert await t.history() == [
            {"version": 1, "event": stamped(START, t0)},
            {"version": 2, "event": stamped(progress(40, "row-400"), t0 + 10)},
            {"version": 3, "event": stamped(SUCCEED, t0 + 20)},
        ]


async def test_requeued_then_failed(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        t = await Handle.create(gw, "r-2", max_attempts=2)
        t.becomes(state="running", attempts=1)
        await t.expect(START, "started", changed=True)
        t.becomes(progress=30)
        await t.expect(progress(30), "progress", changed=True)
        # Retryable with attempts left: back to the queue, progress reset, error kept.
        t.becomes(state="queued", progress=0, error="flaky")
        await t.expect(failure(True, "flaky"), "requeued", changed=True)
        t.becomes(state="running", attempts=2)
        await t.expect({"type": "start", "worker": "w2"}, "started", changed=True)
        # Retryable but no attempts left: failed, and it notifies.
        t.becomes(state="failed", error="flaky again")
        await t.expect(failure(True, "flaky again"), "failed", changed=True, notify=True)
        assert await t.get() == t.expected


async def test_failed_not_retryable(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        t = await Handle.create(gw, "r-3", max_attempts=5)
        t.becomes(state="running", attempts=1)
        await t.expect(START, "started", changed=True)
        t.becomes(state="failed", error="fatal")
        await t.expect(failure(False, "fatal"), "failed", changed=True, notify=True)


async def test_callback_at_the_deadline_expires(database_url: str, clock: FakeClock) -> None:
    # The sweeper is off so that only the callback can expire the task.
    async with gateway(database_url, clock, sweep_interval_ms=0) as gw:
        t = await Handle.create(gw, "r-4", ttl_ms=1_000)
        deadline = t.expected["expiresAtMs"]
        t.becomes(state="running", attempts=1)
        await t.expect(START, "started", changed=True)
        clock.advance(999)  # one millisecond before the deadline: still accepted
        t.becomes(progress=10)
        await t.expect(progress(10), "progress", changed=True)
        clock.advance(1)  # exactly at expiresAtMs (the task life's "at or after")
        t.becomes(state="expired")
        await t.expect(SUCCEED, "expired", changed=True, notify=True, callback_id="late-1")
        assert await t.get() == t.expected
        history = await t.history()
        # The late callback is not recorded; the expiry is, pinned to the deadline.
        assert [e["event"]["type"] for e in history] == ["start", "progress", "expire"]
        assert history[-1] == {"version": 3, "event": {"type": "expire", "atMs": deadline}}
        # The callback id was remembered: the same callback again is a duplicate callback.
        await t.expect(
            SUCCEED,
            "duplicate-callback",
            changed=False,
            duplicate=True,
            duplicate_callback=True,
            callback_id="late-1",
        )
        # Anything else on an expired task is a terminal conflict (there is no way to send an expire).
        await t.expect(SUCCEED, "terminal-conflict", changed=False)
        await t.expect(START, "terminal-conflict", changed=False)
        # The notification is protocol.md's (Notifications): the callback's time (the deadline here) and the
        # version.
        drained = await gw.client.post("/v1/notifications/drain")
        assert drained.json() == [{"taskId": "r-4", "state": "expired", "atMs": deadline, "version": 3}]


async def test_callback_after_the_deadline_expires_a_queued_task(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock, sweep_interval_ms=0) as gw:
        t = await Handle.create(gw, "r-5", ttl_ms=1_000)
        deadline = t.expected["expiresAtMs"]
        clock.advance(5_000)
        t.becomes(state="expired")
        await t.expect(START, "expired", changed=True, notify=True)
        assert await t.history() == [{"version": 1, "event": {"type": "expire", "atMs": deadline}}]
        drained = await gw.client.post("/v1/notifications/drain")
        assert drained.json() == [
            {"taskId": "r-5", "state": "expired", "atMs": deadline + 4_000, "version": 1}
        ]


async def test_sweeper_expires_at_the_deadline(database_url: str, clock: FakeClock) -> None:
    # Default settings: the background sweeper runs.
    async with running_gateway(database_url, clock=clock) as gw:
        t = await Handle.create(gw, "r-6", ttl_ms=1_000)
        other = await Handle.create(gw, "r-6-live", ttl_ms=10_000)
        deadline = t.expected["expiresAtMs"]
        t.becomes(state="running", attempts=1)
        await t.expect(START, "started", changed=True)
        clock.advance(999)
        assert await sweep_once(gw.gateway.book) == 0  # not yet due
        clock.advance(1)  # exactly at expiresAtMs (the task life's "at or after")
        # Poll until the background sweeper has done it.
        await eventually(t.get, lambda task: task["state"] == "expired", "r-6 expired by the sweeper")
        t.becomes(state="expired")
        assert await t.get() == t.expected
        assert (await t.history())[-1] == {"version": 2, "event": {"type": "expire", "atMs": deadline}}
        # The entry and the notification are pinned to the deadline.
        drained = await gw.client.post("/v1/notifications/drain")
        assert drained.json() == [{"taskId": "r-6", "state": "expired", "atMs": deadline, "version": 2}]
        # A task whose deadline has not come is left alone.
        assert await other.get() == other.expected

        # Expired once, never again: another pass finds nothing, and the stored task is unchanged. For
        # that task the state machine's expiry is duplicate-expire (no HTTP route can send an expire).
        assert await sweep_once(gw.gateway.book) == 0
        assert await t.get() == t.expected
        stored = await gw.gateway.book.get("r-6")
        again = expire_task(stored)
        assert (again.changed, again.duplicate, again.reason) == (False, True, "duplicate-expire")
        # A worker's late callback learns the task's fate.
        await t.expect(SUCCEED, "terminal-conflict", changed=False)
        assert (await gw.client.post("/v1/notifications/drain")).json() == []


async def test_duplicate_result_and_terminal_conflict(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        t = await Handle.create(gw, "r-7")
        t.becomes(state="running", attempts=1)
        await t.expect(START, "started", changed=True)
        t.becomes(state="succeeded", progress=100, resultRef="s3://bucket/r", resultHash="sha256:aa")
        await t.expect(SUCCEED, "succeeded", changed=True, notify=True)
        # The same result hash again (even with another ref): a duplicate result.
        await t.expect(
            {**SUCCEED, "resultRef": "s3://elsewhere"}, "duplicate-result", changed=False, duplicate=True
        )
        # Another hash, a failure, a start, a progress: terminal conflicts.
        await t.expect({**SUCCEED, "resultHash": "sha256:bb"}, "terminal-conflict", changed=False)
        await t.expect(failure(False), "terminal-conflict", changed=False)
        await t.expect(START, "terminal-conflict", changed=False)
        await t.expect(progress(50), "terminal-conflict", changed=False)
        assert await t.get() == t.expected


async def test_terminal_conflict_on_failed(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        t = await Handle.create(gw, "r-8", max_attempts=1)
        t.becomes(state="running", attempts=1)
        await t.expect(START, "started", changed=True)
        t.becomes(state="failed", error="no")
        await t.expect(failure(True, "no"), "failed", changed=True, notify=True)
        # Even the success a failed task never had is a conflict, not a duplicate.
        await t.expect(SUCCEED, "terminal-conflict", changed=False)


async def test_already_running_not_running_stale_and_duplicate_progress(
    database_url: str, clock: FakeClock
) -> None:
    async with gateway(database_url, clock) as gw:
        t = await Handle.create(gw, "r-9")
        # Progress, succeed and fail on a queued task are not-running.
        await t.expect(progress(10), "not-running", changed=False)
        await t.expect(SUCCEED, "not-running", changed=False)
        await t.expect(failure(True), "not-running", changed=False)
        t.becomes(state="running", attempts=1)
        await t.expect(START, "started", changed=True)
        await t.expect({"type": "start", "worker": "w2"}, "already-running", changed=False, duplicate=True)
        t.becomes(progress=50)
        await t.expect(progress(50), "progress", changed=True)
        await t.expect(progress(30), "stale-progress", changed=False)
        await t.expect(progress(50, "other cursor"), "duplicate-progress", changed=False, duplicate=True)
        assert await t.get() == t.expected
        assert [e["version"] for e in await t.history()] == [1, 2]


async def test_not_startable(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        t = await Handle.create(gw, "r-10", max_attempts=2)
        # No callback sequence makes a queued task with attempts == maxAttempts: seed it in the store.
        async with gw.gateway.db.engine.begin() as conn:
            await conn.execute(update(tasks_table).where(tasks_table.c.id == "r-10").values(attempts=2))
        t.expected = Expected({**t.expected, "attempts": 2})
        await t.expect(START, "not-startable", changed=False)
        assert await t.get() == t.expected


async def test_duplicate_callback(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        t = await Handle.create(gw, "r-11")
        t.becomes(state="running", attempts=1)
        await t.expect(START, "started", changed=True, callback_id="cb-1")
        clock.advance(5)
        await t.expect(
            START,
            "duplicate-callback",
            changed=False,
            duplicate=True,
            duplicate_callback=True,
            callback_id="cb-1",
        )
        t.becomes(progress=20)
        await t.expect(progress(20), "progress", changed=True, callback_id="cb-2", attempt=1)
        # The same body as parsed JSON (other key order, spacing, 20.0 for 20) is the same callback.
        raw = (
            b'{ "event" : {"cursor":"c", "progress": 20.0, "type":"progress"}, "attempt":1, '
            b'"callbackId":"cb-2"}'
        )
        answer = await gw.client.post(
            f"/v1/tasks/{t.id}/callbacks", content=raw, headers={**t.cb, "Content-Type": "application/json"}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "changed": False,
            "duplicate": True,
            "duplicateCallback": True,
            "notify": False,
            "reason": "duplicate-callback",
            "task": t.expected,
        }
        # A callback id is remembered even when its event changed nothing.
        await t.expect(progress(10), "stale-progress", changed=False, callback_id="cb-3")
        await t.expect(
            progress(10),
            "duplicate-callback",
            changed=False,
            duplicate=True,
            duplicate_callback=True,
            callback_id="cb-3",
        )
        # The callback id comes first: a retried callback whose attempt is now stale is still a duplicate.
        t.becomes(state="queued", progress=0, error="e")
        await t.expect(failure(True, "e"), "requeued", changed=True, callback_id="cb-4", attempt=1)
        t.becomes(state="running", attempts=2)
        await t.expect(START, "started", changed=True)
        await t.expect(
            failure(True, "e"),
            "duplicate-callback",
            changed=False,
            duplicate=True,
            duplicate_callback=True,
            callback_id="cb-4",
            attempt=1,
        )
        assert await t.get() == t.expected
        assert [e["version"] for e in await t.history()] == [1, 2, 3, 4]


# --- the protocol's 409s ------------------------------------------------------------------------------------


async def test_callback_id_reused(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        a = await Handle.create(gw, "r-12a")
        b = await Handle.create(gw, "r-12b")
        a.becomes(state="running", attempts=1)
        await a.expect(START, "started", changed=True, callback_id="shared")
        # Same id, another event: 409, nothing changes.
        error(await a.post(progress(10), callback_id="shared"), 409, "callback-id-reused")
        # Same id and event on another task: ids are global, and the task id is part of the body.
        error(await b.post(START, callback_id="shared"), 409, "callback-id-reused")
        assert await a.get() == a.expected
        assert await b.get() == b.expected
        assert [e["version"] for e in await a.history()] == [1]
        assert await b.history() == []


async def test_callback_id_reused_with_another_attempt(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        t = await Handle.create(gw, "r-13")
        t.becomes(state="running", attempts=1)
        await t.expect(START, "started", changed=True)
        t.becomes(progress=10)
        await t.expect(progress(10), "progress", changed=True, callback_id="p", attempt=1)
        error(await t.post(progress(10), callback_id="p"), 409, "callback-id-reused")
        error(await t.post(progress(10), callback_id="p", attempt=2), 409, "callback-id-reused")
        assert await t.get() == t.expected


async def test_stale_attempt(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        t = await Handle.create(gw, "r-14", max_attempts=3)
        t.becomes(state="running", attempts=1)
        await t.expect(START, "started", changed=True)
        t.becomes(state="queued", progress=0, error="retry")
        await t.expect(failure(True, "retry"), "requeued", changed=True, attempt=1)
        t.becomes(state="running", attempts=2)
        await t.expect(START, "started", changed=True)
        # The worker of attempt 1 cannot write into attempt 2, whatever the event.
        for event in (progress(60), SUCCEED, failure(False)):
            error(await t.post(event, attempt=1, callback_id="old-worker"), 409, "stale-attempt")
        error(await t.post(progress(60), attempt=3), 409, "stale-attempt")
        assert await t.get() == t.expected
        assert [e["version"] for e in await t.history()] == [1, 2, 3]
        # The stale callback did not burn its callback id: the same id with the current attempt works.
        t.becomes(progress=60)
        await t.expect(progress(60), "progress", changed=True, attempt=2, callback_id="old-worker")
        # Fencing comes before the state machine: attempt 2 of a task that moved on is still checked.
        t.becomes(state="succeeded", progress=100, resultRef="s3://bucket/r", resultHash="sha256:aa")
        await t.expect(SUCCEED, "succeeded", changed=True, notify=True, attempt=2)
        await t.expect(SUCCEED, "duplicate-result", changed=False, duplicate=True, attempt=2)
        error(await t.post(SUCCEED, attempt=1), 409, "stale-attempt")
        # Neither attempt nor callbackId is part of a history entry.
        history = await t.history()
        assert [e["event"]["type"] for e in history] == ["start", "fail", "start", "progress", "succeed"]
        assert all(set(e) == {"version", "event"} for e in history)
        assert all("attempt" not in e["event"] and "callbackId" not in e["event"] for e in history)


async def test_stale_attempt_after_the_deadline_changes_nothing(database_url: str, clock: FakeClock) -> None:
    """Fencing comes before the state machine, so a stale callback does not even expire the task."""
    async with gateway(database_url, clock) as gw:
        t = await Handle.create(gw, "r-14b", ttl_ms=1_000)
        t.becomes(state="running", attempts=1)
        await t.expect(START, "started", changed=True)
        clock.advance(2_000)
        error(await t.post(progress(10), attempt=7, callback_id="late"), 409, "stale-attempt")
        assert await t.get() == t.expected
        t.becomes(state="expired")
        await t.expect(progress(10), "expired", changed=True, notify=True, attempt=1, callback_id="late")


async def test_create_is_idempotent_for_the_same_parameters(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        t = await Handle.create(gw, "r-15", ttl_ms=5_000, max_attempts=3)
        t.becomes(state="running", attempts=1)
        await t.expect(START, "started", changed=True)
        clock.advance(1_000)
        again = await create_task(gw, "r-15", ttl_ms=5_000, max_attempts=3, expect=200)
        assert set(again) == {"task", "callbackToken", "subscribeToken"}
        # The same task as it stands (not reset, deadline unchanged).
        assert again.task == t.expected
        # Fresh tokens that work.
        answer = await post_callback(gw, "r-15", again.callback_token, progress(5))
        assert answer["reason"] == "progress", answer
        sub = bearer(again.subscribe_token)
        assert (await gw.client.get("/v1/tasks/r-15", headers=sub)).json()["progress"] == 5
        # maxAttempts 3.0 is the same JSON number as 3.
        same_number = await gw.client.post(
            "/v1/tasks", json={"id": "r-15", "ttlMs": 5_000, "maxAttempts": 3.0}
        )
        assert same_number.status_code == 200, same_number.text


async def test_task_exists(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        t = await Handle.create(gw, "r-16", ttl_ms=5_000, max_attempts=3)
        for ttl_ms, max_attempts in ((6_000, 3), (5_000, 2)):
            answer = await create_task(gw, "r-16", ttl_ms=ttl_ms, max_attempts=max_attempts, expect=None)
            error(answer, 409, "task-exists")
        assert await t.get() == t.expected


async def test_create_without_id_generates_one(sqlite_url: str, clock: FakeClock) -> None:
    async with gateway(sqlite_url, clock) as gw:
        first = await create_task(gw, None, ttl_ms=1_000, max_attempts=1)
        second = await create_task(gw, None, ttl_ms=1_000, max_attempts=1)
        ids = {first.task["id"], second.task["id"]}
        assert len(ids) == 2 and all(ids)


async def _succeeded(gw: Running, task_id: str) -> Handle:
    t = await Handle.create(gw, task_id)
    t.becomes(state="running", attempts=1)
    await t.expect(START, "started", changed=True)
    t.becomes(state="succeeded", progress=100, resultRef=f"s3://b/{task_id}", resultHash=f"h-{task_id}")
    await t.expect(
        {"type": "succeed", "resultRef": f"s3://b/{task_id}", "resultHash": f"h-{task_id}"},
        "succeeded",
        changed=True,
        notify=True,
    )
    return t


async def deliver(gw: Running, task_id: str, key: str) -> httpx.Response:
    return await gw.client.post(f"/v1/tasks/{task_id}/deliveries", headers={"Idempotency-Key": key})


async def test_deliveries(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        a = await _succeeded(gw, "d-a")
        b = await _succeeded(gw, "d-b")
        queued = await Handle.create(gw, "d-q")
        at = clock()
        receipt = {
            "taskId": "d-a",
            "resultRef": "s3://b/d-a",
            "resultHash": "h-d-a",
            "idempotencyKey": "k1",
            "deliveredAtMs": at,
        }
        first = await deliver(gw, "d-a", "k1")
        assert first.status_code == 200, first.text
        assert first.json() == {"ok": True, "duplicate": False, "reason": "delivered", "receipt": receipt}
        clock.advance(1_000)
        # Same key: the same receipt, time included.
        again = await deliver(gw, "d-a", "k1")
        assert again.status_code == 200, again.text
        assert again.json() == {
            "ok": True,
            "duplicate": True,
            "reason": "duplicate-delivery",
            "receipt": receipt,
        }
        # Another key delivers again, with the same result.
        other = await deliver(gw, "d-a", "k2")
        assert other.json() == {
            "ok": True,
            "duplicate": False,
            "reason": "delivered",
            "receipt": {**receipt, "idempotencyKey": "k2", "deliveredAtMs": at + 1_000},
        }
        # The key of task a on task b (even a task that does not exist): refused.
        error(await deliver(gw, "d-b", "k1"), 409, "key-reused-for-other-task")
        error(await deliver(gw, "d-missing", "k1"), 409, "key-reused-for-other-task")
        # A task that has not succeeded: refused, and the key is not burnt.
        error(await deliver(gw, "d-q", "k3"), 409, "not-succeeded")
        ok = await deliver(gw, "d-b", "k3")
        assert ok.status_code == 200 and ok.json()["receipt"]["taskId"] == "d-b", ok.text
        # A new key on a task that does not exist.
        error(await deliver(gw, "d-missing", "k4"), 404, "unknown-task")
        assert await a.get() == a.expected
        assert await b.get() == b.expected
        assert await queued.get() == queued.expected


async def test_not_succeeded_for_failed_and_expired(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock, sweep_interval_ms=0) as gw:
        f = await Handle.create(gw, "n-f", max_attempts=1)
        f.becomes(state="running", attempts=1)
        await f.expect(START, "started", changed=True)
        f.becomes(state="failed", error="x")
        await f.expect(failure(False, "x"), "failed", changed=True, notify=True)
        error(await deliver(gw, "n-f", "kf"), 409, "not-succeeded")
        e = await Handle.create(gw, "n-e", ttl_ms=10)
        clock.advance(10)
        e.becomes(state="expired")
        await e.expect(START, "expired", changed=True, notify=True)
        error(await deliver(gw, "n-e", "ke"), 409, "not-succeeded")


async def test_drain_returns_each_notification_once_by_task_id_then_time(
    database_url: str, clock: FakeClock
) -> None:
    # Ids sorted as JavaScript compares strings (UTF-16 code units): "B" < "a" < "b" < "😀" < "\ue000";
    # by code point "\ue000" would come before "😀" (U+1F600, D83D DE00 in UTF-16).
    ids_by_time = ["b", "\ue000", "a", "😀", "B"]
    async with gateway(database_url, clock) as gw:
        handles = [await Handle.create(gw, task_id) for task_id in ids_by_time]
        assert (await gw.client.post("/v1/notifications/drain")).json() == []
        finished: dict[str, dict[str, Any]] = {}
        for i, t in enumerate(handles):
            clock.advance(100)
            t.becomes(state="running", attempts=1)
            await t.expect(START, "started", changed=True)
            # Nothing that does not reach a terminal state notifies.
            t.becomes(progress=10)
            await t.expect(progress(10), "progress", changed=True)
            clock.advance(100)
            if i % 2:
                t.becomes(state="failed", error="e")
                await t.expect(failure(False, "e"), "failed", changed=True, notify=True)
            else:
                t.becomes(state="succeeded", progress=100, resultRef="s3://bucket/r", resultHash="sha256:aa")
                await t.expect(SUCCEED, "succeeded", changed=True, notify=True)
            # A duplicate result does not notify again.
            await t.expect(
                SUCCEED,
                "duplicate-result" if i % 2 == 0 else "terminal-conflict",
                changed=False,
                duplicate=i % 2 == 0,
            )
            finished[t.id] = {"taskId": t.id, "state": t.expected["state"], "atMs": clock(), "version": 3}
        drained = await gw.client.post("/v1/notifications/drain")
        assert drained.status_code == 200, drained.text
        order = ["B", "a", "b", "😀", "\ue000"]
        assert drained.json() == [finished[task_id] for task_id in order]
        # Each once.
        assert (await gw.client.post("/v1/notifications/drain")).json() == []


async def test_concurrent_drains_return_each_notification_once(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        handles = [await Handle.create(gw, f"cd-{i:02d}", max_attempts=1) for i in range(12)]
        for t in handles:
            assert (await t.post(START)).status_code == 200
            assert (await t.post(failure(False))).status_code == 200
        results: list[list[dict[str, Any]]] = []

        async def drain() -> None:
            answer = await gw.client.post("/v1/notifications/drain")
            assert answer.status_code == 200, answer.text
            results.append(answer.json())

        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(drain)
        seen = [n["taskId"] for batch in results for n in batch]
        assert sorted(seen) == [t.id for t in handles]
        for batch in results:
            assert [n["taskId"] for n in batch] == sorted(n["taskId"] for n in batch)


async def test_concurrent_callbacks_with_one_callback_id(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        t = await Handle.create(gw, "cc-1")
        answers: list[httpx.Response] = []

        async def send() -> None:
            answers.append(await t.post(START, callback_id="same"))

        async with anyio.create_task_group() as tg:
            for _ in range(10):
                tg.start_soon(send)
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        flags = sorted((a.json()["changed"], a.json()["duplicateCallback"]) for a in answers)
        assert flags == [(False, True)] * 9 + [(True, False)]
        assert [e["version"] for e in await t.history()] == [1]


async def test_concurrent_reuse_of_a_callback_id_on_two_tasks(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        for round_ in range(5):
            a = await Handle.create(gw, f"cr-{round_}-a")
            b = await Handle.create(gw, f"cr-{round_}-b")
            answers: dict[str, httpx.Response] = {}

            async def send(t: Handle, callback_id: str, answers: dict[str, httpx.Response] = answers) -> None:
                answers[t.id] = await t.post(START, callback_id=callback_id)

            async with anyio.create_task_group() as tg:
                tg.start_soon(send, a, f"race-{round_}")
                tg.start_soon(send, b, f"race-{round_}")
            statuses = sorted(answer.status_code for answer in answers.values())
            assert statuses == [200, 409], [answer.text for answer in answers.values()]
            loser = next(answer for answer in answers.values() if answer.status_code == 409)
            error(loser, 409, "callback-id-reused")
            versions = sorted([(await a.get())["version"], (await b.get())["version"]])
            assert versions == [0, 1]


async def test_concurrent_callbacks_keep_versions_contiguous(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock, retention_versions=100) as gw:  # the whole history as a delta
        t = await Handle.create(gw, "cv-1")
        assert (await t.post(START)).status_code == 200
        answers: list[httpx.Response] = []

        async def send(n: int) -> None:
            answers.append(await t.post(progress(n), callback_id=f"p-{n}"))

        async with anyio.create_task_group() as tg:
            for n in range(1, 21):
                tg.start_soon(send, n)
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        changed = [a.json() for a in answers if a.json()["changed"]]
        # Each change bumped the version by one; the stored history is exactly those changes, in order.
        assert sorted(c["task"]["version"] for c in changed) == list(range(2, 2 + len(changed)))
        history = await t.history()
        assert [e["version"] for e in history] == list(range(1, 2 + len(changed)))
        progresses = [e["event"]["progress"] for e in history[1:]]
        assert progresses == sorted(progresses) and progresses[-1] == 20
        assert (await t.get())["progress"] == 20


# --- GET /v1/tasks/{id}/events ----------------------------------------------------------------------------


async def test_events_caught_up_delta_and_snapshots(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        t = await Handle.create(gw, "e-1", max_attempts=1)
        answer = await t.events(0)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"mode": "caught-up", "version": 0, "events": [], "task": t.expected}

        t0 = clock()
        t.becomes(state="running", attempts=1)
        await t.expect(START, "started", changed=True)
        history = [{"version": 1, "event": stamped(START, t0)}]
        for n in range(1, 10):  # versions 2..10
            clock.advance(7)
            t.becomes(progress=n * 10)
            await t.expect(progress(n * 10, f"c{n}"), "progress", changed=True)
            history.append({"version": n + 1, "event": stamped(progress(n * 10, f"c{n}"), clock())})
        assert t.expected["version"] == 10

        # Not behind: caught up.
        answer = await t.events(10)
        assert answer.json() == {"mode": "caught-up", "version": 10, "events": [], "task": t.expected}
        # Up to 8 versions behind: a delta of exactly the entries after the cursor.
        for cursor in (9, 5, 2):
            answer = await t.events(cursor)
            assert answer.status_code == 200, answer.text
            assert answer.json() == {
                "mode": "delta",
                "version": 10,
                "events": history[cursor:],
                "task": t.expected,
            }
        # More than 8 behind: a snapshot for retention.
        for cursor in (1, 0):
            answer = await t.events(cursor)
            assert answer.json() == {
                "mode": "snapshot",
                "version": 10,
                "reason": "retention",
                "events": [],
                "task": t.expected,
            }
        # Ahead of the task: a snapshot, not caught-up (protocol.md's one difference).
        for cursor in (11, 1_000):
            answer = await t.events(cursor)
            assert answer.json() == {
                "mode": "snapshot",
                "version": 10,
                "reason": "cursor-ahead",
                "events": [],
                "task": t.expected,
            }
        # The cursor defaults to 0.
        answer = await gw.client.get("/v1/tasks/e-1/events", headers=t.sub)
        assert answer.json()["mode"] == "snapshot" and answer.json()["reason"] == "retention"


async def test_events_retention_is_a_setting(sqlite_url: str, clock: FakeClock) -> None:
    async with gateway(sqlite_url, clock, retention_versions=2) as gw:
        t = await Handle.create(gw, "e-2")
        t.becomes(state="running", attempts=1)
        await t.expect(START, "started", changed=True)
        for n in (10, 20):
            t.becomes(progress=n)
            await t.expect(progress(n), "progress", changed=True)
        assert (await t.events(1)).json()["mode"] == "delta"
        assert (await t.events(0)).json()["reason"] == "retention"


async def test_events_bad_cursor(sqlite_url: str, clock: FakeClock) -> None:
    async with gateway(sqlite_url, clock) as gw:
        t = await Handle.create(gw, "e-3")
        for cursor in ("-1", "abc", "1.5", "1e3"):
            message = error(await t.events(cursor), 400, "invalid-request")
            assert "cursor" in message, message
        # In the protocol's words (its field is `cursor`), not the machine's internal ones (cursorVersion).
        for cursor in ("-1", str(2**53)):
            message = error(await t.events(cursor), 400, "invalid-request")
            assert message == f"cursor: must be an integer from 0 to 9007199254740991, got {cursor}", message
        assert (await t.events(str(2**53 - 1))).json()["reason"] == "cursor-ahead"
        error(await gw.client.get("/v1/tasks/e-missing/events", params={"cursor": 0}), 404, "unknown-task")
