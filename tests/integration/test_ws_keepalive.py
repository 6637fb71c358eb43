"""The server's keep-alive pings of WebSockets (``GATEWAY_WS_PING_INTERVAL_MS``, sent by the loop's wheel,
``gateway.server.keepalive``), seen from raw clients over a real server: one that answers is pinged every
interval and kept, one that never answers is dropped (never before its pong was due) and leaves the wheel.
How soon (within two intervals) is no test, a loaded machine can miss it: it is the bench check
``ws-keepalive`` (bench/checks/keepalive.py)."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import anyio
import pytest
from websockets.frames import Opcode
from websockets.protocol import State

from gateway.server.keepalive import wheel_for
from tests.integration.test_live_support import wait_until
from tests.support import Running, running_gateway
from tests.support.rawsocket import RawWebSocket, read_until_closed, tcp

PING_S = 0.25


def port(gw: Running) -> int:
    found = urlsplit(gw.url).port
    assert found is not None
    return found


def connections(gw: Running) -> int:
    count: int = gw.gateway.hub.stats()["connections"]
    return count


@pytest.mark.anyio
async def test_a_client_that_answers_pings_is_pinged_every_interval_and_kept(sqlite_url: str) -> None:
    rounds = 5
    async with (
        running_gateway(sqlite_url, ws_ping_interval_ms=int(PING_S * 1000), ws_auth_deadline_s=60) as gw,
        tcp(port(gw)) as stream,
    ):
        ws = RawWebSocket(stream, "/v1/ws")
        await ws.open()  # its client protocol answers each ping with a pong
        pings: list[bytes] = []
        # Kept through five rounds of pings, each answered: had a pong not counted, the server would have
        # closed the socket at the next round (a close frame, or the end of the stream).
        with anyio.fail_after(30):
            while len(pings) < rounds:
                frames = await ws.receive_frames()
                assert ws.conn.state is not State.CLOSED, f"closed after {len(pings)} pings"
                assert all(f.opcode in (Opcode.PING, Opcode.PONG) for f in frames), frames
                pings += [bytes(f.data) for f in frames if f.opcode == Opcode.PING]
        assert len(set(pings)) == len(pings), "each ping has a payload of its own"
        assert connections(gw) == 1
        # Pinged by the loop's wheel (the server runs on the test's loop), not by timers of its own.
        wheel = wheel_for(asyncio.get_running_loop(), PING_S)
        assert wheel is not None and len(wheel) == 1 and wheel.running
        await ws.send('{"type": "ping"}')
        assert await ws.recv() == {"type": "pong"}


@pytest.mark.anyio
async def test_a_client_that_never_answers_a_ping_is_dropped(sqlite_url: str) -> None:
    async with (
        running_gateway(sqlite_url, ws_ping_interval_ms=int(PING_S * 1000), ws_auth_deadline_s=60) as gw,
        tcp(port(gw)) as stream,
    ):
        ws = RawWebSocket(stream, "/v1/ws")
        await ws.open()
        opened = anyio.current_time()
        await wait_until(lambda: connections(gw) == 1, "the connection counted")
        # Reads what comes (its kernel buffer never fills) but never answers: the pings are not parsed.
        received = await read_until_closed(stream)
        lasted = anyio.current_time() - opened
        assert b"\x89\x04" in received, "pinged before being dropped"
        assert lasted >= PING_S, f"dropped after {lasted:.3f} s: before its pong was even due"
        await wait_until(lambda: connections(gw) == 0, "the dropped connection let go")
        wheel = wheel_for(asyncio.get_running_loop(), PING_S)
        assert wheel is not None and len(wheel) == 0 and not wheel.running, "it left the wheel"
