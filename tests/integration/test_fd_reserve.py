"""A gateway process near its file descriptor limit refuses new WebSockets and SSE streams cleanly (``503
too-many-sockets``, counted in ``gateway_sockets_refused``, said once in the log) and keeps answering
callbacks and health checks with the descriptors it keeps (``GATEWAY_FD_RESERVE``); with ``--workers``,
each process keeps its own."""

from __future__ import annotations

import contextlib
import logging
import resource
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.support import (
    STEP_S,
    Running,
    create_task,
    http_client,
    post_callback,
    postgres_database,
    running_gateway,
)
from tests.support.processes import STARTUP_COMPLETE, spawn_gateway

CEILING = 4  # connections the gateway process may hold before a new WebSocket or stream is refused
REFUSING = "refusing new WebSockets and SSE streams"


class Refused(Exception):
    def __init__(self, status: int, body: bytes, headers: httpx.Headers | None = None) -> None:
        super().__init__(f"{status} {body!r}")
        self.status = status
        self.code = orjson.loads(body or b"{}").get("error", {}).get("code")
        self.headers = headers


@dataclass
class Stream:
    """A subscriber let in: its next frame, and how to let go of it."""

    next_frame: Callable[[], Awaitable[dict[str, Any]]]
    close: Callable[[], Awaitable[object]]


async def open_websocket(url: str, stack: contextlib.AsyncExitStack) -> Stream:
    try:
        ws = await stack.enter_async_context(connect(url.replace("http://", "ws://") + "/v1/tasks/t/ws"))
    except InvalidStatus as exc:
        raise Refused(exc.response.status_code, bytes(exc.response.body or b"")) from None

    async def next_frame() -> dict[str, Any]:
        frame: dict[str, Any] = orjson.loads(await ws.recv())
        return frame

    return Stream(next_frame, ws.close)


async def open_sse(url: str, stack: contextlib.AsyncExitStack) -> Stream:
    """An SSE stream on a connection of its own (a client each: as many browsers)."""
    client = await stack.enter_async_context(http_client(base_url=url, timeout=STEP_S))
    response = await stack.enter_async_context(client.stream("GET", "/v1/tasks/t/stream"))
    if response.status_code != 200:
        raise Refused(response.status_code, bytes(await response.aread()), response.headers)
    lines = response.aiter_lines()

    async def next_frame() -> dict[str, Any]:
        async for line in lines:
            if line.startswith("data: "):
                frame: dict[str, Any] = orjson.loads(line.removeprefix("data: "))
                return frame
        raise AssertionError("the stream ended")

    return Stream(next_frame, response.aclose)


OPENERS = {"websocket": open_websocket, "sse": open_sse}


async def refused_metric(gw: Running) -> float:
    text = (await gw.client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("gateway_sockets_refused_total "):
            return float(line.split()[1])
    raise AssertionError("no gateway_sockets_refused_total in /metrics")


@pytest.mark.parametrize("kind", list(OPENERS))
@pytest.mark.anyio
async def test_past_its_descriptors_a_process_refuses_streams_and_still_answers_callbacks(
    kind: str, sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_stream = OPENERS[kind]
    # The reserve leaves CEILING connections to this (in-process) gateway: the test's own client among them.
    async with (
        running_gateway(sqlite_url, fd_reserve=soft - CEILING) as gw,
        contextlib.AsyncExitStack() as streams,
    ):
        made = await create_task(gw, "t")
        opened: list[Stream] = []
        refusal: Refused | None = None
        with caplog.at_level(logging.WARNING, logger="gateway.http"), anyio.fail_after(30):
            for _ in range(CEILING + 2):  # the ceiling counts the test's client too: refused by then
                try:
                    opened.append(await open_stream(gw.url, streams))
                except Refused as exc:
                    refusal = exc
                    break
            assert refusal is not None, f"{len(opened)} {kind} streams opened past a ceiling of {CEILING}"
            assert opened, f"not one {kind} stream was let in under the ceiling"
            assert (refusal.status, refusal.code) == (503, "too-many-sockets")
            if refusal.headers is not None:  # an SSE refusal lets go of its connection (and descriptor)
                assert refusal.headers["connection"] == "close"
            for stream in opened:  # those let in are served
                assert (await stream.next_frame())["type"] == "caught-up"

            # Plain requests go on, on connections of their own: a health check and a callback.
            async with http_client(base_url=gw.url, timeout=10) as fresh:
                assert (await fresh.get("/healthz")).status_code == 200
            answer = await post_callback(gw, "t", made["callbackToken"], {"type": "start", "worker": "w"})
            assert answer["reason"] == "started"
            assert (await opened[0].next_frame())["type"] == "event"  # and frames flow

            # A second refusal is counted too, and not said again in the log.
            with pytest.raises(Refused):
                await open_stream(gw.url, streams)
            assert await refused_metric(gw) == 2
            said = [r for r in caplog.records if REFUSING in r.getMessage()]
            assert len(said) == 1, said

            # One closed: its descriptor is free, and a new one is let in.
            await opened.pop().close()
            while True:
                try:
                    async with contextlib.AsyncExitStack() as again:
                        stream = await open_stream(gw.url, again)
                        assert (await stream.next_frame())["type"] in ("caught-up", "delta")
                        break
                except Refused:  # the close is not counted yet: try again
                    await anyio.sleep(0.05)


# --- --workers: a reserve per process -----------------------------------------------------------------------

NOFILE = 128  # each process's descriptor limit
RESERVE = 96  # kept for callbacks, health checks and the database: a ceiling of 32 connections per process
WORKERS = 2
# Refusals in a row that end the opening: each new connection goes to a process by a hash of its addresses,
# so this many in a row means that both processes are at their ceiling (but once in 2**20 tries).
IN_A_ROW = 20


@pytest.fixture
def postgres_url() -> Iterator[str]:
    with postgres_database() as url:  # --workers runs on PostgreSQL only
        yield url


@pytest.mark.anyio
async def test_with_workers_each_process_refuses_sse_streams_past_its_reserve(
    postgres_url: str, tmp_path: Path
) -> None:
    """``gateway serve --workers 2`` under a real descriptor limit: SSE streams are let in until each process
    reaches its ceiling, then refused ``503 too-many-sockets``; callbacks and health checks on new
    connections are all answered, whichever process takes them. (Streams used to take every descriptor:
    neither callbacks nor ``/readyz`` were answered.)"""
    env = {"GATEWAY_FD_RESERVE": str(RESERVE)}
    args = ["--workers", str(WORKERS)]
    gw = await spawn_gateway("gw", postgres_url, tmp_path / "gw.log", env=env, args=args, nofile=NOFILE)
    try:
        await gw.serving()
        await gw.wait_for(STARTUP_COMPLETE, count=WORKERS)  # a connection may go to either
        fresh = httpx.Limits(max_keepalive_connections=0)  # a connection per request
        async with (
            httpx.AsyncClient(base_url=gw.url, timeout=STEP_S, limits=fresh) as client,
            contextlib.AsyncExitStack() as streams,
        ):
            made = await create_task(client, "t")
            opened: list[Stream] = []  # held open (a stream let go of frees its descriptor)
            in_a_row = 0
            with anyio.fail_after(60):
                while in_a_row < IN_A_ROW:
                    assert len(opened) <= WORKERS * (NOFILE - RESERVE), f"{len(opened)} streams let in"
                    try:
                        stream = await open_sse(gw.url, streams)
                    except Refused as exc:
                        assert (exc.status, exc.code) == (503, "too-many-sockets"), exc
                        in_a_row += 1
                        continue
                    except httpx.TransportError as exc:
                        raise AssertionError(f"stream {len(opened) + 1} not answered ({exc!r})") from None
                    assert (await stream.next_frame())["type"] == "caught-up"
                    opened.append(stream)
                    in_a_row = 0
                # Each on a new connection: both processes take some.
                await post_callback(client, "t", made.callback_token, {"type": "start", "worker": "w"})
                for i in range(1, 20):
                    event = {"type": "progress", "progress": i, "cursor": f"row-{i}"}
                    await post_callback(client, "t", made.callback_token, event, attempt=1)
                    assert (await client.get("/readyz")).status_code == 200
            for stream in opened:  # still served
                assert (await stream.next_frame())["type"] == "event"
        assert gw.output().count(REFUSING) == WORKERS  # each process said it once
    finally:
        await gw.stop()
