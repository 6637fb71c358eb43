"""Callbacks do not wait for fan-out (protocol.md, Slow consumers: one slow subscriber never delays the
others; hub: a callback is answered as soon as it is committed).

1,000 subscribers watch one task on their own sockets and read everything. One more subscriber watches
that task and a second one (``jam``) on one ``/v1/ws`` socket: it first stops reading while ``jam`` gets
big entries, until the gateway's writes to it stop making progress (its backlog grows), and from then on it
reads only when the test lets it. Callbacks on the watched task are then answered, and reach all 1,000
others, while that subscriber has not read them; the order of these facts is recorded and checked, with no
timing threshold.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.integration.test_live_support import (
    STEP_S,
    StreamCheck,
    get_task,
    live_gateway,
    loads,
    read_to_close,
    recv_frame,
    socket,
    wait_until,
    ws_url,
)
from tests.support import create_task, post_callback

SUBSCRIBERS = 1_000
CONNECTING = 50  # handshakes in flight at once
JAM_PAD = "j" * 48_000
FAN_VERSIONS = (2, 3, 4)  # the callbacks whose answers are ordered against the slow reader
# The test's bound: a step, and a tenth of a second for each subscriber (its handshake, its frames, its close)
# to come in a row with the others'. Beside two CPU burners and other tests (load 17 on 2 cores) the 1,000
# took 41-78 s, against the 60 s this was.
DEADLINE_S = STEP_S + SUBSCRIBERS * 0.1


@pytest.mark.anyio
async def test_callbacks_are_answered_and_fanned_out_while_a_subscriber_is_not_reading(
    sqlite_url: str,
) -> None:
    log: list[tuple[str, int]] = []
    # A thousand subscribers from one loopback address: past the per-address limit, lifted here.
    async with live_gateway(sqlite_url, write_timeout_ms=120_000, max_connections_per_address=0) as gw:
        hub = gw.gateway.hub
        fan = await create_task(gw, "fan")
        jam = await create_task(gw, "jam", max_attempts=1_000)
        await post_callback(gw, "fan", fan["callbackToken"], {"type": "start", "worker": "w1"})  # v1
        await post_callback(gw, "jam", jam["callbackToken"], {"type": "start", "worker": "w1"})  # v1

        connected = anyio.Event()
        n_connected = 0
        have: dict[int, int] = dict.fromkeys(range(1, 6), 0)
        everyone_has = {v: anyio.Event() for v in have}
        fast_checks: list[StreamCheck] = []
        close_codes: list[int | None] = []
        limiter = anyio.CapacityLimiter(CONNECTING)

        class Counting(StreamCheck):
            def feed(self, frame: dict[str, Any]) -> None:
                super().feed(frame)
                have[self.version] += 1
                if have[self.version] == SUBSCRIBERS:
                    everyone_has[self.version].set()

        async def fast_subscriber() -> None:
            nonlocal n_connected
            check = Counting("fan", 1)
            fast_checks.append(check)
            async with limiter:
                ws = await connect(
                    ws_url(gw, "/v1/tasks/fan/ws", cursor=1), compression=None, open_timeout=30
                )
            try:
                check.feed(await recv_frame(ws))
                n_connected += 1
                if n_connected == SUBSCRIBERS:
                    connected.set()
                close_codes.append(await read_to_close(ws, check))
            finally:
                await ws.close()

        release = anyio.Event()
        slow_checks = {"fan": StreamCheck("fan", 1), "jam": StreamCheck("jam", 1)}

        async def slow_subscriber(ws: ClientConnection) -> None:
            await release.wait()
            while slow_checks["fan"].version < FAN_VERSIONS[-1]:
                frame = loads(await ws.recv())
                slow_checks[frame["taskId"]].feed(frame)
                if frame["taskId"] == "fan":
                    log.append(("slow has", frame["version"]))

        with anyio.fail_after(DEADLINE_S):
            # The socket outlives the task group: the slow subscriber reads to the last of FAN_VERSIONS
            # behind the jam's big entries, which on a loaded machine takes longer than the last callback
            # (the socket closed under it, its reads failed with no close frame received).
            async with (
                # Its own keep-alive pings off: their pongs would wait behind the jam it does not read (past
                # 40 s of that, the client itself would drop the connection).
                socket(
                    ws_url(gw, "/v1/ws"), max_queue=1, compression=None, max_size=None, ping_interval=None
                ) as slow,
                anyio.create_task_group() as tg,
            ):
                for task_id in ("jam", "fan"):
                    await slow.send(json.dumps({"type": "subscribe", "taskId": task_id, "cursor": 1}))
                    slow_checks[task_id].feed(await recv_frame(slow))
                for _ in range(SUBSCRIBERS):
                    tg.start_soon(fast_subscriber)
                await connected.wait()
                assert hub.stats()["connections"] == SUBSCRIBERS + 1

                # Jam the slow one: big entries only it watches, until the gateway cannot write to it
                # and its backlog grows (the fast ones watch nothing that moves meanwhile).
                progress, sent = 0, 0
                while hub.stats()["pending_max"] < 4:
                    assert sent < 1_000, "the slow subscriber's socket never filled"
                    if progress == 100:
                        token = jam["callbackToken"]
                        await post_callback(
                            gw, "jam", token, {"type": "fail", "error": "e", "retryable": True}
                        )
                        await post_callback(gw, "jam", token, {"type": "start", "worker": "w"})
                        progress = 0
                    progress += 1
                    sent += 1
                    event = {"type": "progress", "progress": progress, "cursor": f"{sent}{JAM_PAD}"}
                    await post_callback(gw, "jam", jam["callbackToken"], event)
                tg.start_soon(slow_subscriber, slow)

                for version in FAN_VERSIONS:
                    event = {"type": "progress", "progress": version * 10, "cursor": f"fan-{version}"}
                    answer = await post_callback(gw, "fan", fan["callbackToken"], event)
                    assert answer["task"]["version"] == version
                    log.append(("answered", version))
                    await everyone_has[version].wait()
                    log.append(("all fast have", version))
                release.set()

                done = {"type": "succeed", "resultRef": "s3://fan", "resultHash": "h"}
                await post_callback(gw, "fan", fan["callbackToken"], done)  # v5: the fast sockets close

        for version in FAN_VERSIONS:
            answered = log.index(("answered", version))
            fanned_out = log.index(("all fast have", version))
            slow_has = log.index(("slow has", version))
            assert answered < fanned_out < slow_has, log
        # The slow subscriber had read none of them when the last was answered and fanned out.
        assert log.index(("slow has", FAN_VERSIONS[0])) > log.index(("all fast have", FAN_VERSIONS[-1]))
        assert slow_checks["fan"].event_versions == list(FAN_VERSIONS)

        final = await get_task(gw, "fan")
        assert close_codes == [1000] * SUBSCRIBERS
        for check in fast_checks:
            check.assert_final(final)
            assert check.event_versions == [2, 3, 4, 5]


@pytest.mark.anyio
async def test_fan_out_yields_to_a_callback_from_the_moment_it_is_read_until_it_is_answered(
    sqlite_url: str,
) -> None:
    """Callbacks first (hub.flush): fan-out takes the event loop in short slices and holds back while a
    callback is being answered. A callback counts from its first byte read by the route, body still on its
    way, not only once it waits for its commit: otherwise fan-out would take the loop while its body is
    read and parsed."""
    async with live_gateway(sqlite_url) as gw:
        made = await create_task(gw, "t")
        hub = gw.gateway.hub
        assert not hub.callbacks_waiting()
        body = json.dumps(
            {"callbackId": "cb-1", "event": {"type": "start", "worker": "w1"}}, separators=(",", ":")
        ).encode()
        host, port = gw.url.removeprefix("http://").split(":")
        stream = await anyio.connect_tcp(host, int(port))
        async with stream:
            head = (
                f"POST /v1/tasks/t/callbacks HTTP/1.1\r\nHost: {host}:{port}\r\n"
                f"Authorization: Bearer {made['callbackToken']}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            await stream.send(head + body[:10])  # the route starts; the rest of the body is on its way
            await wait_until(hub.callbacks_waiting, "the callback counted as waiting from its first byte")
            await stream.send(body[10:])
            answer = b""
            with anyio.fail_after(STEP_S):
                while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                    answer += await stream.receive()
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["changed"] is True
        assert not hub.callbacks_waiting()  # answered: fan-out goes on at once
        assert (await get_task(gw, "t"))["version"] == 1
