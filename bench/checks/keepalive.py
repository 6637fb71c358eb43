"""**ws-keepalive**: a WebSocket peer that never answers the server's pings is dropped within two ping
intervals (``GATEWAY_WS_PING_INTERVAL_MS``: the server drops one whose pong is as late as an interval),
on ``gateway serve`` with the interval at 250 ms.

A raw client (tests/support/rawsocket.py) opens ``/v1/ws`` and then reads everything that comes without
ever answering (its kernel buffer never fills, the pings are not parsed). Held to: closed by the server
within two intervals and 1 s (a slow machine's delays) of its opening, pinged before that.

The suite holds the behaviour without the bound (tests/integration/test_ws_keepalive.py: a peer that
answers is kept through rounds of pings, one that does not is dropped, never before its pong was due, and
leaves the wheel).
"""

from __future__ import annotations

import time

from bench.lib import harness
from bench.lib.verdict import Figure
from tests.support.rawsocket import RawWebSocket, read_until_closed, tcp

PING_MS = 250
SLACK_S = 1.0


async def dropped() -> list[Figure]:
    env = {"GATEWAY_WS_PING_INTERVAL_MS": str(PING_MS), "GATEWAY_WS_AUTH_DEADLINE_S": "60"}
    async with harness.gateway(env=env) as gw, tcp(gw.port) as stream:
        ws = RawWebSocket(stream, "/v1/ws")
        await ws.open()
        opened = time.monotonic()
        received = await read_until_closed(stream, within_s=30)
        lasted = time.monotonic() - opened
    pinged = b"\x89\x04" in received
    check = "ws-keepalive (SQLite)"
    detail = f"pinged before the drop: {pinged}; {len(received)} bytes read"
    return [
        Figure(
            check,
            f"a peer that never answers, dropped after ({PING_MS} ms pings)",
            lasted,
            "s",
            2 * PING_MS / 1000 + SLACK_S,
            digits=2,
            detail=detail,
        ),
        Figure(check, "pings sent before the drop", 1 if pinged else 0, "", 1, at_least=True, detail=detail),
    ]
