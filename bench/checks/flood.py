"""**flood**: a flood of unfinished frames, unfinished headers and slowloris connections costs a gateway
little while a normal client is served (issue 9's acceptance line), on ``gateway serve`` (a SQLite file).

100 WebSockets announcing a 15 MiB frame and sending all of it but its last bytes, 100 requests whose
1 MiB header never ends and 500 requests sent a header line a second, all from one address (the
per-address limit raised to 2,000 for the flood, so that every other limit is what stops it), for 15 s
(past the header timeout, 10 s by default, so that every kind has been dealt with), while a normal client
creates a task, posts a callback and subscribes, round after round. Held to: the gateway's RSS grows by
less than 50 MiB over its baseline, the normal client's rounds all succeed (each within 10 s) and at least
10 of them are done.

The suite holds the behaviour without the bounds (tests/integration/test_limits_process.py: the same
flood, its header timeout a second, for two: the normal client served throughout, the gateway answering
after), with this module's flood.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import anyio
import httpx
import orjson
from websockets.asyncio.client import connect

from bench.lib import harness
from bench.lib.verdict import Figure
from tests.support.rawsocket import RawWebSocket, tcp

MIB = 1024 * 1024
SECONDS = 15.0
GROWTH_MIB = 50
ROUNDS = 10


@dataclass
class Flooded:
    rounds: list[str] = field(default_factory=list)  # the normal client's rounds, each a task
    errors: list[str] = field(default_factory=list)  # those that failed, and why
    baseline: int = 0  # the gateway's RSS before the flood, in bytes
    peak: int = 0  # its highest during the flood


async def unfinished_frame(port: int, payload: bytes, until: anyio.Event) -> None:
    """A WebSocket announcing a 15 MiB text frame and sending all of it but the last bytes."""
    async with tcp(port) as stream:
        ws = RawWebSocket(stream, "/v1/ws")
        await ws.open()
        size = 15 * MIB
        header = bytes([0x81, 0x80 | 127]) + struct.pack("!Q", size) + b"\0\0\0\0"
        sent = 0
        try:
            await stream.send(header)
            while sent + len(payload) < size and not until.is_set():
                await stream.send(payload)
                sent += len(payload)
        except OSError:
            pass  # closed by the gateway (1009): the rest of the frame goes nowhere
        await until.wait()


async def unfinished_header(port: int, payload: bytes, until: anyio.Event) -> None:
    """A request whose 1 MiB header never ends."""
    async with tcp(port) as stream:
        try:
            await stream.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
            sent = 0
            while sent < MIB and not until.is_set():
                await stream.send(payload[: 64 * 1024])
                sent += 64 * 1024
        except OSError:
            pass  # refused (431) and closed
        await until.wait()


async def slowloris(port: int, until: anyio.Event) -> None:
    """A request sent a header line at a time, one a second, never finished."""
    async with tcp(port) as stream:
        try:
            await stream.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            line = 0
            while not until.is_set():
                with anyio.move_on_after(1):
                    await until.wait()
                await stream.send(b"X-%d: slow\r\n" % line)
                line += 1
        except OSError:
            pass  # timed out (408) and closed


async def one_round(client: httpx.AsyncClient, ws_url: str, task_id: str) -> None:
    """Create a task, post a callback, subscribe and see it; within 10 s."""
    with anyio.fail_after(10):
        body = {"id": task_id, "ttlMs": 600_000, "maxAttempts": 3}
        made = (await client.post("/v1/tasks", json=body)).raise_for_status().json()
        start = {"callbackId": f"cb-{task_id}", "event": {"type": "start", "worker": "w"}}
        headers = {"Authorization": f"Bearer {made['callbackToken']}"}
        answer = await client.post(f"/v1/tasks/{task_id}/callbacks", json=start, headers=headers)
        assert answer.status_code == 200, answer.text
        async with connect(f"{ws_url}/v1/tasks/{task_id}/ws?token={made['subscribeToken']}") as ws:
            frame = orjson.loads(await ws.recv())
            assert frame["type"] == "delta" and frame["version"] == 1, frame


async def normal_client(
    client: httpx.AsyncClient, ws_url: str, rounds: list[str], errors: list[str], until: anyio.Event
) -> None:
    """Rounds of a normal client until the flood ends; each failure recorded."""
    while not until.is_set():
        task_id = f"normal-{len(rounds)}"
        try:
            await one_round(client, ws_url, task_id)
        except Exception as exc:
            errors.append(f"{task_id}: {exc!r}")
        rounds.append(task_id)
        with anyio.move_on_after(0.2):
            await until.wait()


async def flood(pid: int, port: int, client: httpx.AsyncClient, ws_url: str, seconds: float) -> Flooded:
    """The flood against the gateway process ``pid`` listening on ``port`` for ``seconds``, the normal
    client's rounds beside it, its RSS read every 0.1 s."""
    found = Flooded()
    until = anyio.Event()
    payload = b"a" * (256 * 1024)
    for i in range(3):  # warm up (lazy imports, first connections), then the baseline
        await one_round(client, ws_url, f"warm-{i}")
    found.baseline = found.peak = harness.rss_bytes(pid)
    with anyio.fail_after(seconds + 75):
        async with anyio.create_task_group() as tg:
            tg.start_soon(normal_client, client, ws_url, found.rounds, found.errors, until)
            for _ in range(100):
                tg.start_soon(unfinished_frame, port, payload, until)
                tg.start_soon(unfinished_header, port, payload, until)
            for _ in range(500):
                tg.start_soon(slowloris, port, until)
            flood_end = anyio.current_time() + seconds
            while anyio.current_time() < flood_end:
                found.peak = max(found.peak, harness.rss_bytes(pid))
                await anyio.sleep(0.1)
            until.set()
    return found


async def costs_little() -> list[Figure]:
    harness.raise_nofile(4096)
    env = {"GATEWAY_MAX_CONNECTIONS_PER_ADDRESS": "2000"}
    async with harness.gateway(env=env) as gw, httpx.AsyncClient(base_url=gw.http, timeout=10) as client:
        found = await flood(gw.pid, gw.port, client, gw.ws, SECONDS)
        healthy = (await client.get("/healthz")).status_code == 200
    check = "flood (SQLite)"
    grown = (found.peak - found.baseline) / MIB
    detail = (
        f"RSS {found.baseline / MIB:.1f} MiB -> peak {found.peak / MIB:.1f} MiB; {len(found.rounds)} normal "
        f"rounds, errors {found.errors[:3]}; /healthz after: {healthy}"
    )
    return [
        Figure(
            check,
            f"the gateway's RSS grown in {SECONDS:g} s of flood",
            grown,
            "MiB",
            GROWTH_MIB,
            digits=1,
            detail=detail,
        ),
        Figure(
            check,
            "the normal client's rounds done",
            len(found.rounds),
            "",
            ROUNDS,
            at_least=True,
            detail=detail,
        ),
        Figure(
            check, "the normal client's rounds failed (or over 10 s)", len(found.errors), "", 0, detail=detail
        ),
    ]
