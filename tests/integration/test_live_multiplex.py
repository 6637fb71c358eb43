"""Many subscriptions on one ``/v1/ws`` socket (protocol.md, WebSocket), with an API key configured.

200 subscribe messages, shuffled: 120 valid (with the task's subscribe token) and 80 that are refused,
each with an ``error`` frame (``unknown-task``, ``unauthorized`` for a bad token or the API key, which a
message does not carry, ``forbidden``, ``invalid-request`` for a cursor of the wrong type or for malformed
JSON) while the socket stays open.
Every valid subscription then streams its task; unsubscribed tasks stop streaming.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import anyio
import pytest

from tests.integration.test_live_support import (
    StreamCheck,
    live_gateway,
    recv_frame,
    socket,
    ws_url,
)
from tests.support import bearer, create_task, mint, post_callback

API_KEY = "live-api-key"
VALID = 120
EACH_INVALID = 16  # x 5 kinds = 80
UNSUBSCRIBED = 20


@pytest.mark.anyio
async def test_two_hundred_subscriptions_on_one_socket_valid_ones_stream_invalid_ones_get_errors(
    sqlite_url: str,
) -> None:
    rng = random.Random("live-multiplex")
    async with live_gateway(sqlite_url, api_key=API_KEY) as gw:
        ids = [f"mx-{i:03d}" for i in range(VALID)]
        limiter = anyio.CapacityLimiter(16)
        made: dict[str, dict[str, Any]] = {}

        async def make(task_id: str) -> None:
            async with limiter:
                made[task_id] = await create_task(gw, task_id, headers=bearer(API_KEY))

        async def post(task_id: str, event: dict[str, Any]) -> None:
            async with limiter:
                await post_callback(gw, task_id, made[task_id]["callbackToken"], event)

        async with anyio.create_task_group() as tg:
            for task_id in ids:
                tg.start_soon(make, task_id)

        messages: list[str] = []
        expected_errors: Counter[tuple[str | None, str]] = Counter()
        for task_id in ids:
            token = made[task_id]["subscribeToken"]
            messages.append(json.dumps({"type": "subscribe", "taskId": task_id, "cursor": 0, "token": token}))
        for k in range(EACH_INVALID):
            target = rng.choice(ids)
            other = made[rng.choice([t for t in ids if t != target])]
            ghost = f"ghost-{k}"
            # The API key is no subscribe token (it is taken from the Authorization header only).
            ghost_token, ghost_code = (API_KEY, "unauthorized") if k % 2 else (mint(ghost), "unknown-task")
            refused: list[tuple[dict[str, Any], str]] = [
                ({"taskId": ghost, "cursor": 0, "token": ghost_token}, ghost_code),
                ({"taskId": target, "cursor": 0, "token": "not-a-jwt"}, "unauthorized"),
                ({"taskId": target, "cursor": 0, "token": other["subscribeToken"]}, "forbidden"),
                ({"taskId": target, "cursor": ["1", 1.5, True][k % 3], "token": API_KEY}, "invalid-request"),
            ]
            for body, code in refused:
                messages.append(json.dumps({"type": "subscribe", **body}))
                expected_errors[(body["taskId"], code)] += 1
            messages.append('{"type": "subscribe", "taskId": ')  # malformed JSON: nobody to name
            expected_errors[(None, "invalid-request")] += 1
        assert len(messages) == 200
        rng.shuffle(messages)

        checks = {task_id: StreamCheck(task_id, 0) for task_id in ids}
        with anyio.fail_after(40):
            async with socket(ws_url(gw, "/v1/ws")) as ws:
                for message in messages:
                    await ws.send(message)
                errors: Counter[tuple[str | None, str]] = Counter()
                for _ in range(len(messages)):
                    frame = await recv_frame(ws)
                    if frame["type"] == "error":
                        errors[(frame.get("taskId"), frame["code"])] += 1
                    else:
                        checks[frame["taskId"]].feed(frame)
                assert errors == expected_errors
                assert all(c.resume is not None and c.resume["type"] == "caught-up" for c in checks.values())
                assert gw.gateway.hub.stats()["subscriptions"] == VALID

                # Every valid subscription streams its task.
                async with anyio.create_task_group() as tg:
                    for task_id in ids:
                        tg.start_soon(post, task_id, {"type": "start", "worker": "w1"})
                for _ in ids:
                    frame = await recv_frame(ws)
                    checks[frame["taskId"]].feed(frame)
                assert all(c.event_versions == [1] for c in checks.values())

                # Unsubscribed tasks stop streaming; the pong proves the unsubscribes were handled.
                gone = set(rng.sample(ids, UNSUBSCRIBED))
                for task_id in sorted(gone):
                    await ws.send(json.dumps({"type": "unsubscribe", "taskId": task_id}))
                await ws.send('{"type":"ping"}')
                assert await recv_frame(ws) == {"type": "pong"}
                async with anyio.create_task_group() as tg:
                    for task_id in ids:
                        tg.start_soon(post, task_id, {"type": "progress", "progress": 50, "cursor": "half"})
                for _ in range(VALID - UNSUBSCRIBED):
                    frame = await recv_frame(ws)
                    assert frame["taskId"] not in gone, frame
                    checks[frame["taskId"]].feed(frame)
                await ws.send('{"type":"ping"}')
                assert await recv_frame(ws) == {"type": "pong"}
                for task_id, check in checks.items():
                    assert check.event_versions == ([1] if task_id in gone else [1, 2])
                assert ws.close_code is None, "the socket stays open"
