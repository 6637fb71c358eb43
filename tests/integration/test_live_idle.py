"""A ``/v1/ws`` socket that holds no subscription is let go (protocol.md, Close codes).

One that has held none for ``GATEWAY_WS_AUTH_DEADLINE_S`` (since it opened, or since its last subscription
ended) is sent an ``error`` frame (``request-timeout``) and closed with ``4408``, however busy it keeps
itself: answering the server's pings, sending ``ping`` messages or refused subscribes. One that has
had five messages refused while holding none is closed at the fifth (``too-many-refusals``, ``4429``). A
socket holding an authorized subscription is not touched, however many of its other subscribes fail.

The deadline tests move the clock the deadline is measured on (the hub's ``monotonic``) by hand: a socket
is past its deadline when the test says so, once it has done what it does before that, however slow the
machine. What is awaited is the close, which the gateway's watchdog makes on its own (real) time; what is
asserted is the frames and the close code, never how long anything took. The refusal test has a deadline
far longer than itself, so that only the count closes its socket.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from tests.integration.test_live_support import live_gateway, recv_frame, socket, ws_url
from tests.support import STEP_S, Running, bearer, create_task, mint, post_callback

pytestmark = pytest.mark.anyio

API_KEY = "idle-api-key"
DEADLINE_S = 10.0  # on the tests' own clock, which moves only when a test says
LONG_DEADLINE_S = 3_600.0  # longer than any test: no socket reaches it
REFUSALS = 5


class HubClock:
    """Seconds that move only when the test says so, as the hub's ``monotonic``."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@asynccontextmanager
async def idle_gateway(sqlite_url: str, **overrides: Any) -> AsyncIterator[tuple[Running, HubClock]]:
    """A gateway whose sockets' deadlines (``DEADLINE_S``) are measured on a clock the test moves."""
    async with live_gateway(sqlite_url, ws_auth_deadline_s=DEADLINE_S, **overrides) as gw:
        clock = HubClock()
        gw.gateway.hub.monotonic = clock  # before any socket opens
        yield gw, clock


async def pong(ws: ClientConnection) -> None:
    """A ``ping`` answered: the socket is open, and what the server did before that answer is done."""
    with anyio.fail_after(STEP_S):
        await ws.send('{"type": "ping"}')
        assert await recv_frame(ws) == {"type": "pong"}


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
    """Pongs (as many as came before the close: none at all is fine), then the ``request-timeout`` error
    frame."""
    *pongs, last = frames
    return all(f == {"type": "pong"} for f in pongs) and last["code"] == "request-timeout"


async def read_until_closed(ws: ClientConnection) -> list[dict[str, Any]]:
    """Every frame the server sends until it closes the socket."""
    frames: list[dict[str, Any]] = []
    with anyio.fail_after(STEP_S), contextlib.suppress(ConnectionClosed):
        async for raw in ws:
            frames.append(json.loads(raw))
    return frames


@pytest.mark.parametrize("api_key", [API_KEY, None], ids=["keyed", "open-mode"])
async def test_a_socket_that_only_pings_is_closed_after_the_deadline_and_an_authorized_one_stays(
    sqlite_url: str, api_key: str | None
) -> None:
    headers = bearer(api_key) if api_key else None
    async with idle_gateway(sqlite_url, api_key=api_key) as (gw, clock):
        made = await create_task(gw, "watched", headers=headers)
        async with socket(ws_url(gw, "/v1/ws")) as watching:
            # Opened first, and authorized: as far past its opening as the other by the time that one is cut.
            await watching.send(subscribe("watched", made.subscribe_token))
            assert (await recv_frame(watching))["type"] == "caught-up"
            async with socket(ws_url(gw, "/v1/ws")) as idle:
                await pong(idle)
                clock.advance(DEADLINE_S / 2)
                await pong(idle)  # a ping halfway through does not start the deadline again
                clock.advance(DEADLINE_S / 2)
                frames, closed = await ping_until_closed(idle)
            assert timed_out(frames), frames
            assert frames[-1]["type"] == "error" and "taskId" not in frames[-1], frames[-1]
            assert closed == 4408
            # The authorized socket, past its deadline too, is still served.
            await post_callback(gw, "watched", made.callback_token, {"type": "start", "worker": "w"})
            frame = await recv_frame(watching)
            assert (frame["type"], frame["version"]) == ("event", 1), frame
            await pong(watching)
            assert watching.close_code is None


async def test_refused_subscribes_do_not_hold_a_socket_past_the_deadline(sqlite_url: str) -> None:
    """Refused subscribes (fewer than the refusals that close a socket), before and after the deadline's
    halfway point, keep nothing open."""
    async with idle_gateway(sqlite_url, api_key=API_KEY) as (gw, clock):
        await create_task(gw, "mine", headers=bearer(API_KEY))
        async with socket(ws_url(gw, "/v1/ws")) as ws:
            codes: list[str] = []
            for refusal in range(REFUSALS - 1):
                if refusal == (REFUSALS - 1) // 2:
                    clock.advance(DEADLINE_S / 2)
                await ws.send(subscribe("mine", "not-a-jwt"))
                codes.append((await recv_frame(ws))["code"])
            assert codes == ["unauthorized"] * (REFUSALS - 1)
            clock.advance(DEADLINE_S / 2)
            frames = await read_until_closed(ws)
        assert [f["code"] for f in frames] == ["request-timeout"], frames
        assert ws.close_code == 4408


async def test_a_socket_is_closed_at_its_fifth_refused_message_while_it_holds_no_subscription(
    sqlite_url: str,
) -> None:
    async with live_gateway(sqlite_url, api_key=API_KEY, ws_auth_deadline_s=LONG_DEADLINE_S) as gw:
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
            with anyio.fail_after(STEP_S):
                for message, _ in refused:
                    await ws.send(message)
            frames = await read_until_closed(ws)
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
            await pong(ws)
            assert ws.close_code is None


async def test_a_socket_whose_last_subscription_ended_is_closed_after_the_deadline(sqlite_url: str) -> None:
    async with idle_gateway(sqlite_url, api_key=API_KEY) as (gw, clock):
        made = await create_task(gw, "short", headers=bearer(API_KEY))
        async with socket(ws_url(gw, "/v1/ws")) as ws:
            await ws.send(subscribe("short", made.subscribe_token))
            assert (await recv_frame(ws))["type"] == "caught-up"
            clock.advance(2 * DEADLINE_S)  # holding a subscription: no deadline runs
            await post_callback(gw, "short", made.callback_token, {"type": "start", "worker": "w"})
            done = {"type": "fail", "error": "boom", "retryable": False}
            await post_callback(gw, "short", made.callback_token, done)
            assert [(await recv_frame(ws))["version"] for _ in range(2)] == [1, 2]  # 2: terminal, the end
            # Answered after the subscription was let go (the same writer sends both): its deadline runs.
            await pong(ws)
            clock.advance(DEADLINE_S)
            frames, closed = await ping_until_closed(ws)
        assert timed_out(frames), frames
        assert closed == 4408
