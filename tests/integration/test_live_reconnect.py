"""Reconnecting after a cut connection (protocol.md, WebSocket: resume frames and retention).

The test cuts each client's TCP connection itself (``transport.abort()``: no close frame, as when a
network drops) while entries are still arriving. A client that comes back with the last version it
applied as its cursor gets a ``delta`` holding exactly what it missed; one that was away for more than the
retention window (8 versions by default) gets a ``snapshot`` with ``reason: retention``. Both then follow
the live stream to the task's exact final state and a ``1000`` close.
"""

from __future__ import annotations

import anyio
import orjson
import pytest
from websockets.asyncio.client import connect

from tests.integration.test_live_support import (
    StreamCheck,
    get_task,
    live_gateway,
    read_to_close,
    recv_frame,
    socket,
    wait_until,
    ws_url,
)
from tests.support import TcpProxy, create_task, post_callback, running_gateway

RETENTION = 8  # the default


def progress(p: int) -> dict[str, object]:
    return {"type": "progress", "progress": p, "cursor": f"row-{p}"}


@pytest.mark.anyio
async def test_a_cut_client_resumes_with_a_delta_or_a_retention_snapshot_and_ends_exact(
    database_url: str,
) -> None:
    async with live_gateway(database_url) as gw:
        hub = gw.gateway.hub
        made = await create_task(gw, "recon")
        token, sub = made["callbackToken"], made["subscribeToken"]
        url = ws_url(gw, "/v1/tasks/recon/ws", token=sub)
        with anyio.fail_after(30):
            await post_callback(gw, "recon", token, {"type": "start", "worker": "w1"})  # v1
            near = StreamCheck("recon", 0, retention=RETENTION)
            far = StreamCheck("recon", 0, retention=RETENTION)
            async with socket(url) as ws_near, socket(url) as ws_far:
                near.feed(await recv_frame(ws_near))
                far.feed(await recv_frame(ws_far))
                for p in (10, 20, 30, 40):  # v2..v5, not waiting for anyone to read them
                    await post_callback(gw, "recon", token, progress(p))
                # ``near`` stops in the middle of what is arriving; ``far`` has applied all of it.
                while near.version < 3:
                    near.feed(await recv_frame(ws_near))
                while far.version < 5:
                    far.feed(await recv_frame(ws_far))
                ws_near.transport.abort()
                ws_far.transport.abort()
                # The gateway notices both dead peers and lets their feeds go.
                await hub.idle()
            assert hub.stats()["subscriptions"] == 0

            for p in (50, 60, 70):  # v6..v8: near missed 5 versions, within the retention window
                await post_callback(gw, "recon", token, progress(p))
            near_cursor = near.version
            near = StreamCheck("recon", near_cursor, base=near.task, retention=RETENTION)
            async with socket(ws_url(gw, "/v1/tasks/recon/ws", token=sub, cursor=near_cursor)) as ws_near:
                near.feed(await recv_frame(ws_near))
                assert near.resume is not None and near.resume["type"] == "delta"
                assert [e["version"] for e in near.resume["events"]] == [4, 5, 6, 7, 8]

                for p in range(71, 81):  # v9..v18: far is now 13 versions behind
                    await post_callback(gw, "recon", token, progress(p))
                far_cursor = far.version
                far = StreamCheck("recon", far_cursor, base=far.task, retention=RETENTION)
                async with socket(ws_url(gw, "/v1/tasks/recon/ws", token=sub, cursor=far_cursor)) as ws_far:
                    far.feed(await recv_frame(ws_far))
                    assert far.resume is not None
                    assert far.resume["type"] == "snapshot" and far.resume["reason"] == "retention"
                    assert far.version == 18

                    await post_callback(gw, "recon", token, progress(90))
                    done = {"type": "succeed", "resultRef": "s3://recon", "resultHash": "sha256:1"}
                    await post_callback(gw, "recon", token, done)  # v20
                    assert await read_to_close(ws_near, near) == 1000
                    assert await read_to_close(ws_far, far) == 1000

        final = await get_task(gw, "recon")
        assert final["version"] == 20 and final["state"] == "succeeded"
        near.assert_final(final)
        far.assert_final(final)
        assert near.event_versions == list(range(9, 21))
        assert far.event_versions == [19, 20]


@pytest.mark.anyio
async def test_the_server_lets_go_of_a_peer_that_vanished_without_a_fin(sqlite_url: str) -> None:
    """A subscriber's link dies silently (the relay stops forwarding both ways, closes nothing): the
    server's pings go unanswered, so it drops the connection and its subscription within twice the ping
    interval, instead of holding them until TCP gives up (many minutes)."""
    async with (
        running_gateway(sqlite_url, ws_ping_interval_ms=300) as gw,
        TcpProxy(int(gw.url.rsplit(":", 1)[1])) as relay,
    ):
        made = await create_task(gw, "vanished", ttl_ms=120_000)
        hub = gw.gateway.hub
        url = f"ws://127.0.0.1:{relay.port}/v1/ws"
        async with connect(url, ping_interval=None, close_timeout=0.1) as ws:  # a client that never pings
            await ws.send(
                orjson.dumps(
                    {"type": "subscribe", "taskId": "vanished", "cursor": 0, "token": made["subscribeToken"]}
                ).decode()
            )
            with anyio.fail_after(10):
                assert orjson.loads(await ws.recv())["type"] == "caught-up"
            assert hub.stats()["connections"] == 1
            relay.stall()
            await wait_until(
                lambda: hub.stats()["connections"] == hub.stats()["subscriptions"] == 0,
                lambda: f"the vanished peer's connection and subscription let go: {hub.stats()}",
            )
            relay.cut()
