"""Heartbeat leases through the HTTP API of a real server (SQLite and PostgreSQL), on a clock the test moves:
``heartbeatMs`` at create, the lease in the callbacks' answers, ``POST /v1/tasks/{id}/heartbeat`` and its
refusals, and an ended lease as the retryable fail of protocol.md's task life, pushed to a subscriber like
any entry."""

from __future__ import annotations

import json
from typing import Any

import pytest
from websockets.asyncio.client import connect

from bench.checks.under_load import histogram
from gateway.jobs.sweeper import end_leases_once
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

HEARTBEAT_MS = 2_000
START = {"type": "start", "worker": "w1"}
TIMEOUT = {"type": "fail", "error": "heartbeat-timeout", "retryable": True}


async def make(gw: Running, task_id: str, heartbeat_ms: Any = HEARTBEAT_MS, **body: Any) -> Any:
    fields = {"id": task_id, "ttlMs": 600_000, "maxAttempts": 2, "heartbeatMs": heartbeat_ms, **body}
    return await gw.client.post("/v1/tasks", json=fields)


async def beat(gw: Running, task_id: str, token: str, body: Any) -> Any:
    return await gw.client.post(f"/v1/tasks/{task_id}/heartbeat", json=body, headers=bearer(token))


async def test_heartbeat_ms_is_checked_and_a_create_with_another_is_another_create(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        for bad in (999, 0, -1_000, 1_500.5, "2000", True, 2**53):
            message = error(await make(gw, "bad", bad), 400, "invalid-request")
            assert "heartbeatMs" in message, (bad, message)
        made = await make(gw, "t", 2_000.0)  # a whole number of milliseconds, however written
        assert made.status_code == 201, made.text
        assert (await make(gw, "t", 2_000)).status_code == 200  # the same create again
        for other in (3_000, None):
            message = error(await make(gw, "t", other), 409, "task-exists")
            assert "heartbeatMs 2000" in message
        plain = await create_task(gw, "plain")
        assert "heartbeatMs" not in plain.task  # the task's shape is protocol.md's: the lease is not in it
        error(await make(gw, "plain", 2_000, ttlMs=600_000, maxAttempts=3), 409, "task-exists")


async def test_callbacks_and_heartbeats_renew_the_lease_from_the_gateways_clock(database_url: str) -> None:
    clock = FakeClock()
    async with running_gateway(database_url, clock=clock, sweep_interval_ms=0) as gw:
        made = (await make(gw, "t")).json()
        token = made["callbackToken"]
        queued = await beat(gw, "t", token, {"attempt": 0})
        assert "queued" in error(queued, 409, "not-running")
        started = await post_callback(gw, "t", token, START)
        assert (started["leaseUntilMs"], started["heartbeatMs"]) == (clock.now + HEARTBEAT_MS, HEARTBEAT_MS)
        clock.advance(700)
        progress = await post_callback(
            gw, "t", token, {"type": "progress", "progress": 5, "cursor": "c"}, attempt=1
        )
        assert progress["leaseUntilMs"] == clock.now + HEARTBEAT_MS
        clock.advance(700)
        renewed = await beat(gw, "t", token, {"attempt": 1})
        assert renewed.status_code == 200, renewed.text
        assert renewed.json() == {"leaseUntilMs": clock.now + HEARTBEAT_MS, "heartbeatMs": HEARTBEAT_MS}
        as_float = await beat(gw, "t", token, {"attempt": 1.0})  # one JSON number, however written
        assert as_float.json() == renewed.json(), as_float.text
        task = (await gw.client.get("/v1/tasks/t")).json()
        assert (task["state"], task["version"]) == ("running", 2)  # a heartbeat adds no entry
        error(await beat(gw, "t", token, {"attempt": 2}), 409, "stale-attempt")
        error(await beat(gw, "nope", token, {"attempt": 1}), 403, "forbidden")  # the token is t's
        for body in (
            {},
            {"attempt": "1"},
            {"attempt": -1},
            {"attempt": 1.5},
            {"attempt": 1, "extra": 1},
            [1],
        ):
            error(await beat(gw, "t", token, body), 400, "invalid-request")
        error(await beat(gw, "t", made["subscribeToken"], {"attempt": 1}), 403, "forbidden")
        done = {"type": "succeed", "resultRef": "r", "resultHash": "h"}
        finished = await post_callback(gw, "t", token, done, attempt=1)
        assert "leaseUntilMs" not in finished  # no lease once the attempt is over
        assert "succeeded" in error(await beat(gw, "t", token, {"attempt": 1}), 409, "not-running")

        # A running task created without heartbeatMs: nothing to renew, the attempt is current.
        plain = await create_task(gw, "plain")
        answer = await post_callback(gw, "plain", plain.callback_token, START)
        assert "leaseUntilMs" not in answer and "heartbeatMs" not in answer
        nothing = await beat(gw, "plain", plain.callback_token, {"attempt": 1})
        assert nothing.status_code == 200 and nothing.json() == {"leaseUntilMs": None, "heartbeatMs": None}


async def test_an_ended_lease_requeues_pushes_the_fail_and_fences_the_vanished_worker(
    database_url: str,
) -> None:
    clock = FakeClock()
    async with running_gateway(database_url, clock=clock, sweep_interval_ms=0) as gw:
        made = (await make(gw, "t")).json()
        token = made["callbackToken"]
        await post_callback(gw, "t", token, START)
        lease_end = clock.now + HEARTBEAT_MS
        async with connect(f"{gw.url.replace('http', 'ws')}/v1/tasks/t/ws?cursor=1") as ws:
            assert json.loads(await ws.recv())["type"] == "caught-up"
            clock.advance(HEARTBEAT_MS + 300)  # the sweeper is late: the entry is still at the lease's end
            assert await end_leases_once(gw.gateway.book, gw.gateway.metrics) == 1
            frame = json.loads(await ws.recv())
        assert frame["type"] == "event" and frame["version"] == 2
        assert frame["event"] == {
            "type": "fail",
            "atMs": lease_end,
            "error": "heartbeat-timeout",
            "retryable": True,
        }
        assert (frame["task"]["state"], frame["task"]["error"]) == ("queued", "heartbeat-timeout")
        metrics = (await gw.client.get("/metrics")).text
        assert "gateway_leases_ended_by_sweeper_total 1.0" in metrics

        # The vanished worker wakes: told its attempt is over, then fenced once another has started.
        late = await beat(gw, "t", token, {"attempt": 1})
        assert "requeued" in error(late, 409, "not-running")
        second = await post_callback(gw, "t", token, START)
        assert second["reason"] == "started" and second["task"]["attempts"] == 2
        stale = await post_callback(
            gw, "t", token, {"type": "progress", "progress": 9, "cursor": "x"}, attempt=1, expect=None
        )
        error(stale, 409, "stale-attempt")
        # The last attempt's lease ends: failed for good, with one notification at the lease's end.
        clock.advance(HEARTBEAT_MS)
        assert await end_leases_once(gw.gateway.book) == 1
        drained = (await gw.client.post("/v1/notifications/drain")).json()
        assert drained == [{"taskId": "t", "state": "failed", "atMs": clock.now, "version": 4}]


async def test_the_sweeper_wakes_at_a_lease_end_not_at_its_interval(database_url: str) -> None:
    """GATEWAY_SWEEP_INTERVAL_MS is the longest the sweeper sleeps: it wakes for the earliest lease end it
    knows of (told by the start that began the lease), and a renewal moves that end later."""
    async with running_gateway(database_url, sweep_interval_ms=3_600_000) as gw:
        made = (await make(gw, "t", 1_000)).json()
        token = made["callbackToken"]
        await post_callback(gw, "t", token, START)
        progress = {"type": "progress", "progress": 5, "cursor": "c"}
        renewed = await post_callback(gw, "t", token, progress, attempt=1)
        ended = await eventually(
            lambda: gw.client.get("/v1/tasks/t/events", params={"cursor": 2}),
            lambda answer: answer.json()["task"]["state"] == "queued",
            "the lease ended, the task requeued",
        )
        (entry,) = ended.json()["events"]
        assert entry["event"] == {
            **TIMEOUT,
            "atMs": renewed["leaseUntilMs"],
        }  # the renewed end, not the first
        # Ended within a step of the test, not at the sweeper's interval of an hour, and counted (how late
        # exactly is the bench check lease-load's to hold).
        lateness = await histogram(gw.client, "gateway_lease_lateness_seconds", 1)
        assert lateness["+Inf"] == 1, lateness
