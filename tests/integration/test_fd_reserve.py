"""A gateway process near its file descriptor limit refuses new WebSockets cleanly (``503
too-many-sockets``, counted in ``gateway_sockets_refused``, said once in the log) and keeps answering
callbacks and health checks with the descriptors it keeps (``GATEWAY_FD_RESERVE``)."""

from __future__ import annotations

import contextlib
import logging
import resource

import anyio
import orjson
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import InvalidStatus

from tests.support import Running, create_task, http_client, post_callback, running_gateway

CEILING = 4  # connections the gateway process may hold before a new WebSocket is refused


def ws_url(gw: Running, task_id: str) -> str:
    return gw.url.replace("http://", "ws://") + f"/v1/tasks/{task_id}/ws"


async def refused_metric(gw: Running) -> float:
    text = (await gw.client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("gateway_sockets_refused_total "):
            return float(line.split()[1])
    raise AssertionError("no gateway_sockets_refused_total in /metrics")


@pytest.mark.anyio
async def test_past_its_descriptors_a_process_refuses_websockets_and_still_answers_callbacks(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    # The reserve leaves CEILING connections to this (in-process) gateway: the test's own client among them.
    async with (
        running_gateway(sqlite_url, fd_reserve=soft - CEILING) as gw,
        contextlib.AsyncExitStack() as sockets,
    ):
        made = await create_task(gw, "t")
        opened: list[ClientConnection] = []
        refusal: InvalidStatus | None = None
        with caplog.at_level(logging.WARNING, logger="gateway.http"), anyio.fail_after(30):
            for _ in range(CEILING + 2):  # the ceiling counts the test's client too: refused by then
                try:
                    opened.append(await sockets.enter_async_context(connect(ws_url(gw, "t"))))
                except InvalidStatus as exc:
                    refusal = exc
                    break
            assert refusal is not None, f"{len(opened)} WebSockets opened past a ceiling of {CEILING}"
            assert opened, "not one WebSocket was let in under the ceiling"
            assert refusal.response.status_code == 503
            assert orjson.loads(refusal.response.body or b"{}")["error"]["code"] == "too-many-sockets"
            for ws in opened:  # those let in are served
                assert orjson.loads(await ws.recv())["type"] == "caught-up"

            # Plain requests go on, on connections of their own: a health check and a callback.
            async with http_client(base_url=gw.url, timeout=10) as fresh:
                assert (await fresh.get("/healthz")).status_code == 200
            answer = await post_callback(gw, "t", made["callbackToken"], {"type": "start", "worker": "w"})
            assert answer["reason"] == "started"
            assert orjson.loads(await opened[0].recv())["type"] == "event"  # and frames flow

            # A second refusal is counted too, and not said again in the log.
            with pytest.raises(InvalidStatus):
                await sockets.enter_async_context(connect(ws_url(gw, "t")))
            assert await refused_metric(gw) == 2
            said = [r for r in caplog.records if "refusing new WebSockets" in r.getMessage()]
            assert len(said) == 1, said

            # One WebSocket closed: its descriptor is free, and a new one is let in.
            await opened.pop().close()
            while True:
                try:
                    async with connect(ws_url(gw, "t")) as again:
                        assert orjson.loads(await again.recv())["type"] in ("caught-up", "delta")
                        break
                except InvalidStatus:  # the close is not counted yet: try again
                    await anyio.sleep(0.05)
