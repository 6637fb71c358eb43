"""The end of a stream (protocol.md, Close codes: ``1000`` the single-task stream is complete).

A socket opened on a finished task (succeeded, failed or expired) gets its resume frame and a ``1000``
close; an open socket gets the terminal entry (the sweeper's ``expire`` included) and then ``1000``; on
``/v1/ws`` a finished task's subscription answers its resume frame and the socket stays open.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from gateway.jobs.sweeper import sweep_once
from tests.integration.test_live_support import (
    STEP_S,
    StreamCheck,
    closed_with,
    get_task,
    hold_resume_until_committed,
    live_gateway,
    read_to_close,
    recv_frame,
    socket,
    sse_frames,
    ws_url,
)
from tests.support import FakeClock, Running, create_task, http_client, post_callback

TTL_MS = 60_000


async def finish(gw: Running, clock: FakeClock, task_id: str, how: str) -> dict[str, Any]:
    """Bring a task to a terminal state with a few entries before it; returns the final task."""
    made = await create_task(gw, task_id, ttl_ms=TTL_MS)
    token = made["callbackToken"]
    await post_callback(gw, task_id, token, {"type": "start", "worker": "w1"})
    await post_callback(gw, task_id, token, {"type": "progress", "progress": 30, "cursor": "c"})
    if how == "succeeded":
        await post_callback(gw, task_id, token, {"type": "succeed", "resultRef": "s3://r", "resultHash": "h"})
    elif how == "failed":
        await post_callback(gw, task_id, token, {"type": "fail", "error": "bad input", "retryable": False})
    else:
        clock.advance(TTL_MS)
        assert await sweep_once(gw.gateway.book) == 1
    final = await get_task(gw, task_id)
    assert final["state"] == how and final["version"] == 3
    return final


@pytest.mark.anyio
async def test_a_socket_opened_on_a_finished_task_gets_its_resume_frame_then_1000(
    database_url: str, clock: FakeClock
) -> None:
    async with live_gateway(database_url, clock=clock) as gw:
        with anyio.fail_after(20):
            for how in ("succeeded", "failed", "expired"):
                final = await finish(gw, clock, how, how)
                for cursor, expected in ((0, "delta"), (2, "delta"), (3, "caught-up"), (8, "snapshot")):
                    check = StreamCheck(how, cursor, retention=8)
                    async with socket(ws_url(gw, f"/v1/tasks/{how}/ws", cursor=cursor)) as ws:
                        assert await read_to_close(ws, check) == 1000, (how, cursor)
                    assert check.types == [expected], (how, cursor, check.types)
                    check.assert_final(final)
            await gw.gateway.hub.idle()

            # On the many-task socket: the resume frame, and the socket stays open.
            async with socket(ws_url(gw, "/v1/ws")) as ws:
                await ws.send('{"type":"subscribe","taskId":"failed","cursor":1}')
                frame = await recv_frame(ws)
                assert (frame["type"], frame["version"], frame["task"]["state"]) == ("delta", 3, "failed")
                await ws.send('{"type":"ping"}')
                assert await recv_frame(ws) == {"type": "pong"}
                assert ws.close_code is None


@pytest.mark.anyio
async def test_an_open_socket_gets_the_terminal_entry_then_1000(sqlite_url: str, clock: FakeClock) -> None:
    async with live_gateway(sqlite_url, clock=clock) as gw:
        made = await create_task(gw, "live-end", ttl_ms=TTL_MS)
        await post_callback(gw, "live-end", made["callbackToken"], {"type": "start", "worker": "w1"})
        with anyio.fail_after(10):
            check = StreamCheck("live-end", 1)
            async with socket(ws_url(gw, "/v1/tasks/live-end/ws", cursor=1)) as ws:
                check.feed(await recv_frame(ws))
                clock.advance(TTL_MS)
                assert await sweep_once(gw.gateway.book) == 1  # the sweeper's pass, driven by hand
                assert await read_to_close(ws, check) == 1000
        assert check.types == ["caught-up", "event"]
        final = await get_task(gw, "live-end")
        assert final["state"] == "expired"
        check.assert_final(final)


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["ws", "sse"])
async def test_a_subscriber_that_connects_as_the_task_finishes_still_gets_1000(
    sqlite_url: str, transport: str
) -> None:
    async with live_gateway(sqlite_url) as gw:
        made = await create_task(gw, "edge")
        token = made["callbackToken"]
        await post_callback(gw, "edge", token, {"type": "start", "worker": "w1"})  # v1
        done = {"type": "succeed", "resultRef": "s3://edge", "resultHash": "h"}
        await hold_resume_until_committed(gw, lambda: post_callback(gw, "edge", token, done))
        check = StreamCheck("edge", 1)
        with anyio.fail_after(10):
            if transport == "ws":
                async with socket(ws_url(gw, "/v1/tasks/edge/ws", cursor=1)) as ws:
                    check.feed(await recv_frame(ws))  # the resume frame already holds the end
                    assert check.task is not None and check.task["state"] == "succeeded"
                    # A correct gateway closes at once; one that misses the end never does.
                    frames, closed = await closed_with(ws)
                assert frames == []
                assert closed == 1000
            else:
                client = http_client(base_url=gw.url, timeout=STEP_S)
                async with client, client.stream("GET", "/v1/tasks/edge/stream", params={"cursor": 1}) as r:
                    events = sse_frames(r)
                    check.feed((await anext(events))[2])
                    assert check.task is not None and check.task["state"] == "succeeded"
                    # A correct gateway ends the stream at once; one that misses the end never does (its
                    # heartbeats keep it open).
                    with anyio.fail_after(STEP_S):
                        rest = [data async for _, _, data in events]
                    assert rest == []
        assert check.types == ["delta"]
        check.assert_final(await get_task(gw, "edge"))
