"""A ``/v1/ws`` socket that holds no subscription is let go (protocol.md, Close codes).

One that has held none for ``GATEWAY_WS_AUTH_DEADLINE_S`` (since it opened, or since its last subscription
ended) is sent an ``error`` frame (``request-timeout``) and closed with ``4408``, however busy it keeps
itself: answering the server's pings, sending ``ping`` messages or refused subscribes. One that has
had five messages refused while holding none is closed at the fifth (``too-many-refusals``, ``4429``). A
socket holding an authorized subscription is not touched, however many of its other subscribes fail.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from tests.integration.test_live_support import live_gateway, recv_frame, socket, ws_url
from tests.support import STEP_S, bearer, create_task, mint, post_callback

pytestmark = pytest.mark.anyio

API_KEY = "idle-api-key"
DEADLINE_S = 0.5  # short, so that the tests wait little for it
REFUSALS = 5


async def ping_until_closed(ws: ClientConnection) -> tuple[list[dict[str, Any]], int | None]:
    """Keep the socket busy as a client keeping its link alive does (a ``ping`` every 50 ms) until the
    server closes it; every frame received, and the close code."""
    frames: list[dict[str, Any]] = []

    async def read() -> None:
        with contextlib.suppress(ConnectionClosed):  # a close code other than 1000 ends the loop so
            async for raw in ws:
                frames.append(json.loads(raw))

    with anyio.fail_after(STEP_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            try:
                while True:
                    await ws.send('{"type": "ping"}')
                    await anyio.sleep(0.05)  # the client's pace, not a wait for anything
            except ConnectionClosed:
                pass
    return frames, ws.close_code


def subscribe(task_id: str, token: str | None) -> str:
    message: dict[str, Any] = {"type": "subscribe", "taskId": task_id, "cursor": 0}
    if token is not None:
        message["token"] = token
    return json.dumps(message)


def timed_out(frames: list[dict[str, Any]]) -> bool:
    """Pongs, then the ``request-timeout`` error frame."""
    *pongs, last = frames
    return bool(pongs) and all(f == {"type": "pong"} for f in pongs) and last["code"] == "request-timeout"


@pytest.mark.parametrize("api_key", [API_KEY, None], ids=["keyed", "open-mode"])
async def test_a_socket_that_only_pings_is_closed_after_the_deadline_and_an_authorized_one_stays(
    sqlite_url: str, api_key: str | None
) -> None:
    headers = bearer(api_key) if api_key else None
    async with live_gateway(sqlite_url, api_key=api_key, ws_auth_deadline_s=DEADLINE_S) as gw:
        made = await create_task(gw, "watched", headers=headers)
        async with socket(ws_url(gw, "/v1/ws")) as watching:
            # Opened first, and authorized: it is older than the deadline by the time the other is cut.
            await watching.send(subscribe("watched", made.subscribe_token))
            assert (await recv_frame(watching))["type"] == "caught-up"
            async with socket(ws_url(gw, "/v1/ws")) as idle:
                frames, closed = await ping_until_closed(idle)
            assert timed_out(frames), frames
            assert frames[-1]["type"] == "error" and "taskId" not in frames[-1], frames[-1]
            assert closed == 4408
            # The authorized socket is still served.
            await post_callback(gw, "watched", made.callback_token, {"type": "start", "worker": "w"})
            frame = await recv_frame(watching)
            assert (frame["type"], frame["version"]) == ("event", 1), frame
            await watching.send('{"type": "ping"}')
            assert await recv_frame(watching) == {"type": "pong"}
            assert watching.close_code is None


async def test_refused_subscribes_do_not_hold_a_socket_past_the_deadline(sqlite_url: str) -> None:
    """A refused subscribe every so often (fewer than the refusals that close a socket) keeps nothing open."""
    async with live_gateway(sqlite_url, api_key=API_KEY, ws_auth_deadline_s=DEADLINE_S) as gw:
        await create_task(gw, "mine", headers=bearer(API_KEY))
        async with socket(ws_url(gw, "/v1/ws")) as ws:
            frames: list[dict[str, Any]] = []
            with anyio.fail_after(STEP_S):
                try:
                    for _ in range(REFUSALS - 1):
                        await ws.send(subscribe("mine", "not-a-jwt"))
                        frames.append(await recv_frame(ws))
                    async for raw in ws:
                        frames.append(json.loads(raw))
                except ConnectionClosed:
                    pass
        codes = [f["code"] for f in frames]
        assert codes == ["unauthorized"] * (REFUSALS - 1) + ["request-timeout"], frames
        assert ws.close_code == 4408


async def test_a_socket_is_closed_at_its_fifth_refused_message_while_it_holds_no_subscription(
    sqlite_url: str,
) -> None:
    async with live_gateway(sqlite_url, api_key=API_KEY) as gw:  # the default deadline: 10 s
        mine = await create_task(gw, "mine", headers=bearer(API_KEY))
        theirs = await create_task(gw, "theirs", headers=bearer(API_KEY))
        refused = [
            (subscribe("mine", "not-a-jwt"), "unauthorized"),
            (subscribe("mine", API_KEY), "unauthorized"),  # the API key is no subscribe token
            (subscribe("mine", theirs.subscribe_token), "forbidden"),
            ('{"type": "subscribe", "taskId": ', "invalid-request"),  # any message refused counts
            (subscribe("ghost", mint("ghost")), "unknown-task"),
        ]
        assert len(refused) == REFUSALS
        async with socket(ws_url(gw, "/v1/ws")) as ws:
            frames: list[dict[str, Any]] = []
            with anyio.fail_after(STEP_S):
                for message, _ in refused:
                    await ws.send(message)
                try:
                    async for raw in ws:
                        frames.append(json.loads(raw))
                except ConnectionClosed:
                    pass
        assert [f["code"] for f in frames] == [code for _, code in refused] + ["too-many-refusals"], frames
        assert "taskId" not in frames[-1]
        assert ws.close_code == 4429

        # Holding an authorized subscription, a socket's refused subscribes are only errors.
        async with socket(ws_url(gw, "/v1/ws")) as ws:
            with anyio.fail_after(STEP_S):
                await ws.send(subscribe("mine", mine.subscribe_token))
                assert (await recv_frame(ws))["type"] == "caught-up"
                for message, code in refused * 2:
                    await ws.send(message)
                    assert (await recv_frame(ws))["code"] == code
                await ws.send('{"type": "ping"}')
                assert await recv_frame(ws) == {"type": "pong"}
            assert ws.close_code is None


async def test_a_socket_whose_last_subscription_ended_is_closed_after_the_deadline(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url, api_key=API_KEY, ws_auth_deadline_s=DEADLINE_S) as gw:
        made = await create_task(gw, "short", headers=bearer(API_KEY))
        async with socket(ws_url(gw, "/v1/ws")) as ws:
            await ws.send(subscribe("short", made.subscribe_token))
            assert (await recv_frame(ws))["type"] == "caught-up"
            await post_callback(gw, "short", made.callback_token, {"type": "start", "worker": "w"})
            done = {"type": "fail", "error": "boom", "retryable": False}
            await post_callback(gw, "short", made.callback_token, done)
            assert [(await recv_frame(ws))["version"] for _ in range(2)] == [1, 2]  # 2: terminal, the end
            frames, closed = await ping_until_closed(ws)
        assert timed_out(frames), frames
        assert closed == 4408
