"""Shutting down (protocol.md, Close codes: ``1001`` server shutting down): open subscribers are told, and
the process can then exit."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from websockets.asyncio.client import connect

from tests.integration.test_live_support import (
    live_gateway,
    recv_frame,
    sse_frames,
    ws_url,
)
from tests.support import create_task, http_client, post_callback

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.anyio
async def test_open_subscribers_get_1001_when_the_server_stops(database_url: str) -> None:
    sse_seen: list[dict[str, object]] = []
    sse_open = anyio.Event()
    sse_ended = anyio.Event()
    with anyio.fail_after(30):
        async with http_client(timeout=10) as sse_client, anyio.create_task_group() as tg:
            async with live_gateway(database_url) as gw:
                made = await create_task(gw, "open")
                await post_callback(gw, "open", made["callbackToken"], {"type": "start", "worker": "w1"})
                single = await connect(ws_url(gw, "/v1/tasks/open/ws", cursor=1))
                multi = await connect(ws_url(gw, "/v1/ws"))
                assert (await recv_frame(single))["type"] == "caught-up"
                await multi.send(json.dumps({"type": "subscribe", "taskId": "open", "cursor": 1}))
                assert (await recv_frame(multi))["type"] == "caught-up"

                async def sse_reader(url: str) -> None:
                    async with sse_client.stream("GET", url) as response:
                        async for _, _, data in sse_frames(response):
                            sse_seen.append(data)
                            sse_open.set()
                    sse_ended.set()

                tg.start_soon(sse_reader, f"{gw.url}/v1/tasks/open/stream?cursor=1")
                await sse_open.wait()
                assert gw.gateway.hub.stats()["connections"] == 3
            # The server has stopped.
            await single.wait_closed()
            await multi.wait_closed()
            await sse_ended.wait()
    assert single.close_code == 1001
    assert multi.close_code == 1001
    assert [f["type"] for f in sse_seen] == ["caught-up"]


# Run in a child process: the hang it looks for is in closing the event loop, after the gateway stopped.
STOP_DURING_A_SWEEP = textwrap.dedent(
    """
    import asyncio, sys
    import anyio
    from tests.support import running_gateway

    # A sweeper pass whose query is still running when the server stops (the real pass is the same
    # kind of read, only shorter: stopping in the middle of one is a matter of timing).
    LONG_READ = (
        "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n WHERE x < 1500000) "
        "SELECT count(*) FROM n"
    )

    async def main(url):
        from gateway.store.transaction import SqlTx

        reading = anyio.Event()

        async def next_deadline(self):  # a pass's first statement, run where the real one runs
            reading.set()
            await self.fetch(LONG_READ)
            return None

        SqlTx.next_deadline = next_deadline
        async with running_gateway(url, sweep_interval_ms=1):
            with anyio.fail_after(10):
                await reading.wait()
        print("gateway stopped", flush=True)

    asyncio.run(main(sys.argv[1]))
    print("process can exit", flush=True)
    """
)


# The child imports the gateway, starts it, waits for a sweep (at most 10 s) and stops it: seconds, more on a
# loaded machine. The hang this test looks for lasts for ever.
EXIT_WITHIN_S = 60


def test_the_process_exits_after_a_stop_that_interrupts_a_sweep(tmp_path: Path) -> None:
    db = tmp_path / "gateway.db"
    try:
        done = subprocess.run(
            [sys.executable, "-c", STOP_DURING_A_SWEEP, f"sqlite:///{db}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=EXIT_WITHIN_S,
        )
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout
        raise AssertionError(
            f"the process did not exit within {EXIT_WITHIN_S} s; it printed: {out!r}"
        ) from None
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["gateway stopped", "process can exit"]
