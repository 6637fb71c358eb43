"""Cancel (``POST /v1/tasks/{task_id}/cancel``, protocol.md): a backend ends a queued or running task.

Against a real uvicorn server, real WebSocket clients and a real webhook receiver: the task ends ``failed``
with ``error: "cancelled"`` through one ``cancel`` entry that every subscriber sees, one signed
notification reaches the relay's receiver (and the drain), and the worker's next callback raises
``TaskCancelled``. A finished task does not change (``terminal-conflict``), a cancel past the deadline
expires the task, and bad input, a missing key and an unknown task get the protocol's errors with nothing
written.
"""

from __future__ import annotations

import anyio
import httpx
import pytest

from gateway.client import CallbackIgnored, TaskCancelled, Worker
from tests.integration.test_live_support import (
    StreamCheck,
    live_gateway,
    read_to_close,
    recv_frame,
    socket,
    ws_url,
)
from tests.integration.test_relay import FAST, SECRET, expected, relay_metric, relayed
from tests.support import (
    STEP_S,
    FakeClock,
    bearer,
    create_task,
    drain_all,
    error,
    post_callback,
    running_gateway,
)
from tests.support.history import History
from tests.support.receiver import Receiver, serving_receiver

pytestmark = pytest.mark.anyio

API_KEY = "cancel-test-key"


async def cancel(
    client: httpx.AsyncClient, task_id: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> httpx.Response:
    return await client.post(f"/v1/tasks/{task_id}/cancel", content=body, headers=headers)


async def test_a_running_task_cancelled_is_seen_by_every_subscriber_relayed_once_and_fences_its_worker(
    database_url: str,
) -> None:
    seen = History()
    receiver = Receiver(SECRET)
    async with (
        serving_receiver(receiver) as hook_url,
        live_gateway(database_url, notify_url=hook_url, **FAST) as gw,
    ):
        made = await create_task(gw, "export-7", ttl_ms=600_000, max_attempts=3)
        seen.created(made.task)
        async with Worker(gw.url, "export-7", made.callback_token) as worker:
            await worker.start("w1")
            await worker.progress(40, cursor="row-400")

            # Three subscribers, each at its own cursor: two single-task sockets and one many-task socket.
            checks = [StreamCheck("export-7", 0), StreamCheck("export-7", 2), StreamCheck("export-7", 1)]
            with anyio.fail_after(STEP_S * 3):
                async with (
                    socket(ws_url(gw, "/v1/tasks/export-7/ws", cursor=0)) as one,
                    socket(ws_url(gw, "/v1/tasks/export-7/ws", cursor=2)) as two,
                    socket(ws_url(gw, "/v1/ws")) as many,
                ):
                    await many.send('{"type": "subscribe", "taskId": "export-7", "cursor": 1}')
                    for check, ws in zip(checks, (one, two, many), strict=True):
                        frame = await recv_frame(ws)  # the resume frame: subscribed from here on
                        check.feed(frame)
                        seen.frame(f"s{check.cursor}", frame)

                    answer = await cancel(gw.client, "export-7", b'{"reason": "wrong export"}')
                    assert answer.status_code == 200, answer.text
                    body = answer.json()
                    seen.cancel("export-7", 200, body)
                    assert {k: body[k] for k in ("changed", "duplicate", "notify", "reason")} == {
                        "changed": True,
                        "duplicate": False,
                        "notify": True,
                        "reason": "cancelled",
                    }
                    task = body["task"]
                    assert (task["state"], task["error"], task["attempts"], task["progress"]) == (
                        "failed",
                        "cancelled",
                        1,
                        40,
                    )
                    # The single-task sockets get the cancel entry, then close: the task is terminal.
                    for check, ws in zip(checks[:2], (one, two), strict=True):
                        assert await read_to_close(ws, check) == 1000
                    frame = await recv_frame(many)
                    checks[2].feed(frame)
                    for check in checks:
                        check.assert_final(task)
                        assert check.types[-1] == "event"
                    entry = frame["event"]
                    assert entry["type"] == "cancel" and entry["reason"] == "wrong export", frame
                    assert (frame["version"], frame["task"]) == (3, task)
                    seen.frame("s1", frame)

            # The worker's next callback: terminal-conflict, raised as TaskCancelled (a CallbackIgnored).
            with pytest.raises(TaskCancelled) as stopped:
                await worker.progress(60, cursor="row-600")
            assert isinstance(stopped.value, CallbackIgnored)
            assert stopped.value.reason == "terminal-conflict"
            assert stopped.value.task is not None and stopped.value.task["error"] == "cancelled"

        # One notification, signed, at the cancel's time; the drain has it too (independent consumers).
        await receiver.until(lambda: len(receiver.delivered) == 1)
        await relayed(gw, 1)
        assert relay_metric(gw, "gateway_tasks_cancelled_total") == 1
        drained = await drain_all(gw, 1)
        assert drained == [{"taskId": "export-7", "state": "failed", "atMs": entry["atMs"], "version": 3}]
        # A second cancel changes nothing and notifies nothing.
        again = await cancel(gw.client, "export-7")
        assert (again.status_code, again.json()["reason"], again.json()["changed"]) == (
            200,
            "terminal-conflict",
            False,
        )
        seen.cancel("export-7", 200, again.json())
        assert (await gw.client.post("/v1/notifications/drain")).json() == []
        history = (await gw.client.get("/v1/tasks/export-7/events", params={"cursor": 0})).json()
        seen.final("export-7", history)
        assert [e["event"]["type"] for e in history["events"]] == ["start", "progress", "cancel"]
    # One notification, signed: a try the receiver was too slow to answer in time is sent again under the
    # same webhook-id (at least once), so count notifications, not tries.
    assert all(t.verified for t in receiver.tries)
    assert len({t.msg_id for t in receiver.tries}) == 1
    assert receiver.delivered == dict([expected(drained[0])])
    for item in drained:
        seen.notification(item)
    for t in receiver.tries:
        seen.notification(t.body, t.msg_id)
    seen.check()


async def test_cancel_takes_the_api_key_and_refuses_what_it_cannot_do(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, api_key=API_KEY, sweep_interval_ms=0) as gw:
        key = bearer(API_KEY)
        made = await create_task(gw, "q-1", headers=key)
        # Credentials first: none, a task token, the key in the URL.
        error(await cancel(gw.client, "q-1"), 401, "unauthorized")
        error(await cancel(gw.client, "q-1", headers=bearer(made.subscribe_token)), 403, "forbidden")
        error(await cancel(gw.client, "q-1", headers=bearer(made.callback_token)), 403, "forbidden")
        error(await gw.client.post(f"/v1/tasks/q-1/cancel?token={API_KEY}"), 401, "unauthorized")
        error(await cancel(gw.client, "ghost", headers=key), 404, "unknown-task")
        error(await cancel(gw.client, "ghost"), 401, "unauthorized")  # ids cannot be probed without it

        # Bad bodies: 400 naming the field (or 415), and nothing written.
        for raw, says in (
            (b"not json", "malformed JSON"),
            (b"[]", "body: must be a JSON object"),
            (b'{"reason": 5}', "reason:"),
            (b'{"reason": ""}', "reason:"),
            (b'{"reason": "' + b"x" * 1025 + b'"}', "reason:"),
            (b'{"reason": "a\\u0000b"}', "reason:"),
            (b'{"why": "x"}', "why: unknown field"),
        ):
            message = error(await cancel(gw.client, "q-1", raw, headers=key), 400, "invalid-request")
            assert says in message, (raw, message)
        text = {"Content-Type": "text/plain"}
        error(
            await cancel(gw.client, "q-1", b'{"reason": "x"}', headers={**key, **text}),
            415,
            "unsupported-media-type",
        )
        assert (await gw.client.get("/v1/tasks/q-1", headers=key)).json()["version"] == 0

        # A queued task, with no body at all: cancelled, and no reason in the entry.
        answer = await cancel(gw.client, "q-1", headers=key)
        assert answer.status_code == 200, answer.text
        assert set(answer.json()) == {"changed", "duplicate", "notify", "reason", "task"}
        assert (answer.json()["reason"], answer.json()["task"]["state"]) == ("cancelled", "failed")
        events = (await gw.client.get("/v1/tasks/q-1/events", headers=key)).json()["events"]
        assert [e["event"] for e in events] == [{"type": "cancel", "atMs": events[0]["event"]["atMs"]}]
        # A worker that comes later learns it from its start.
        async with Worker(gw.url, "q-1", made.callback_token) as late:
            with pytest.raises(TaskCancelled):
                await late.start("w1")

        # A task that ended otherwise: terminal-conflict, unchanged.
        done = await create_task(gw, "s-1", headers=key)
        await post_callback(gw, "s-1", done.callback_token, {"type": "start", "worker": "w"})
        succeed = {"type": "succeed", "resultRef": "s3://r", "resultHash": "h"}
        await post_callback(gw, "s-1", done.callback_token, succeed)
        answer = await cancel(gw.client, "s-1", b'{"reason": "too late"}', headers=key)
        assert answer.status_code == 200, answer.text
        assert {k: answer.json()[k] for k in ("changed", "notify", "reason")} == {
            "changed": False,
            "notify": False,
            "reason": "terminal-conflict",
        }
        assert answer.json()["task"]["state"] == "succeeded" and answer.json()["task"]["version"] == 2
        # A worker cannot send the gateway's own event.
        message = error(
            await gw.client.post(
                "/v1/tasks/s-1/callbacks",
                json={"event": {"type": "cancel", "reason": "mine"}},
                headers=bearer(done.callback_token),
            ),
            400,
            "invalid-request",
        )
        assert "cancel is the gateway's own event" in message
        # A TaskCancelled is only for a cancelled task: another ending stays a plain CallbackIgnored.
        async with Worker(gw.url, "s-1", done.callback_token) as worker:
            with pytest.raises(CallbackIgnored) as ignored:
                await worker.fail("late", retryable=False)
            assert not isinstance(ignored.value, TaskCancelled)


async def test_a_cancel_at_or_after_the_deadline_expires_the_task(
    database_url: str, clock: FakeClock
) -> None:
    async with live_gateway(database_url, clock=clock) as gw:
        made = await create_task(gw, "late-1", ttl_ms=1_000)
        await post_callback(gw, "late-1", made.callback_token, {"type": "start", "worker": "w"})
        deadline = made.task["expiresAtMs"]
        clock.advance(1_000)
        answer = await cancel(gw.client, "late-1", b'{"reason": "stop"}')
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert (body["reason"], body["changed"], body["notify"], body["task"]["state"]) == (
            "expired",
            True,
            True,
            "expired",
        )
        history = (await gw.client.get("/v1/tasks/late-1/events")).json()["events"]
        assert history[-1] == {"version": 2, "event": {"type": "expire", "atMs": deadline}}
        drained = await drain_all(gw, 1)
        assert drained == [{"taskId": "late-1", "state": "expired", "atMs": clock(), "version": 2}]


async def test_in_open_mode_a_page_elsewhere_cannot_cancel(sqlite_url: str) -> None:
    """Open mode takes no credential, so a state-changing request from a foreign page is refused."""
    async with running_gateway(sqlite_url, sweep_interval_ms=0) as gw:
        await create_task(gw, "o-1")
        foreign = await cancel(gw.client, "o-1", headers={"Origin": "https://evil.example"})
        error(foreign, 403, "forbidden")
        assert (await gw.client.get("/v1/tasks/o-1")).json()["state"] == "queued"
        local = await cancel(gw.client, "o-1", headers={"Origin": gw.url})
        assert (local.status_code, local.json()["reason"]) == (200, "cancelled")


async def test_a_worker_whose_heartbeat_hears_of_the_cancel_raises_task_cancelled(sqlite_url: str) -> None:
    """On a task with a lease, the background heartbeat usually learns of a cancel before the job's next
    callback: the block still raises ``TaskCancelled`` (not ``AttemptOver``), so a job that catches it
    sees why its work stopped."""
    async with running_gateway(sqlite_url) as gw:
        body = {"id": "hb-1", "ttlMs": 600_000, "maxAttempts": 3, "heartbeatMs": 1_000}
        made = await gw.client.post("/v1/tasks", json=body)
        assert made.status_code == 201, made.text
        token = made.json()["callbackToken"]
        job_stopped = anyio.Event()
        with anyio.fail_after(STEP_S), pytest.raises(TaskCancelled) as stopped:
            async with Worker(gw.url, "hb-1", token) as worker:
                await worker.start("w1")
                assert worker.heartbeating
                answer = await cancel(gw.client, "hb-1", b'{"reason": "wrong export"}')
                assert answer.json()["reason"] == "cancelled", answer.text
                try:
                    await anyio.Event().wait()  # the job, with nothing to report: only heartbeats run
                finally:
                    job_stopped.set()
        assert job_stopped.is_set()
        assert stopped.value.task is not None
        assert (stopped.value.task["state"], stopped.value.task["error"]) == ("failed", "cancelled")
