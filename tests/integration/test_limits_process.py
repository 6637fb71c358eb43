"""The limits against ``gateway serve`` as deployed (a subprocess, its own log, its own memory): what its
log shows of tokens and hang-ups, and the acceptance test of issue 9 (a flood of unfinished frames,
unfinished headers and slowloris connections costs less than 50 MiB while a normal client is served)."""

from __future__ import annotations

import re
import resource
import struct
from pathlib import Path

import anyio
import httpx
import orjson
import pytest
from websockets.asyncio.client import connect

from tests.support import bearer, http_client
from tests.support.processes import gateway_processes
from tests.support.rawsocket import RawWebSocket, read_until_closed, tcp

MIB = 1024 * 1024


async def create(client: httpx.AsyncClient, task_id: str) -> dict[str, str]:
    answer = await client.post("/v1/tasks", json={"id": task_id, "ttlMs": 600_000, "maxAttempts": 3})
    assert answer.status_code == 201, answer.text
    made: dict[str, str] = answer.json()
    return made


# --- logs ---------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_logs_carry_no_token_and_no_traceback_for_a_hang_up(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'gateway.db'}"
    async with gateway_processes(1, url, tmp_path) as (gw,):
        async with http_client(base_url=gw.url, timeout=10) as client:
            made = await create(client, "t")
            sub = made["subscribeToken"]
            # Tokens in query strings: a read route, a dashboard link, an encoded parameter name, a socket.
            await client.get(f"/v1/tasks/t?token={sub}")
            await client.get("/", params={"task": "t", "token": "page-link-token-abc"})
            await client.get("/v1/tasks/t/events?cursor=0&tok%65n=encoded-name-token-xyz")
            async with connect(f"{gw.ws_url}/v1/tasks/t/ws?cursor=0&token={sub}") as ws:
                assert orjson.loads(await ws.recv())["type"] == "caught-up"
            # Clients hanging up in the middle of a body.
            for _ in range(5):
                async with tcp(gw.port) as stream:
                    head = b"POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5000\r\n\r\n"
                    await stream.send(head + b'{"id": "x", "ttlMs": ')
            # The last line to wait for: everything above was logged before it.
            assert (await client.get("/healthz?last=1")).status_code == 200
        await gw.wait_for(re.compile(rb"GET /healthz\?last=1"))
        log = gw.output()
    for secret in (sub, "page-link-token-abc", "encoded-name-token-xyz"):
        assert secret not in log, log
    assert "token=[redacted]" in log and "tok%65n=[redacted]" in log
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log


@pytest.mark.anyio
async def test_an_api_key_sent_in_a_url_is_refused_and_kept_out_of_the_log(tmp_path: Path) -> None:
    """Issue 9 (6): an API key sent in ``?token`` appeared in access lines. It authenticates nothing there
    (401 on every route, read or management) and the log shows ``token=[redacted]`` instead of it."""
    key = "api-key-sent-in-a-url-0123456789"
    url = f"sqlite:///{tmp_path / 'gateway.db'}"
    async with gateway_processes(1, url, tmp_path, env={"GATEWAY_API_KEY": key}) as (gw,):
        async with http_client(base_url=gw.url, timeout=10) as client:
            answer = await client.post(
                "/v1/tasks", json={"id": "t", "ttlMs": 600_000, "maxAttempts": 3}, headers=bearer(key)
            )
            assert answer.status_code == 201, answer.text
            for method, path in [
                ("GET", "/v1/tasks"),
                ("GET", "/v1/tasks/t"),
                ("GET", "/v1/tasks/t/events"),
                ("POST", "/v1/tasks/t/callbacks"),
                ("POST", "/v1/notifications/drain"),
            ]:
                answer = await client.request(method, path, params={"token": key})
                assert answer.status_code == 401, (method, path, answer.text)
            assert (await client.get("/healthz?last=1")).status_code == 200
        await gw.wait_for(re.compile(rb"GET /healthz\?last=1"))
        log = gw.output()
    assert key not in log, log
    assert log.count("token=[redacted]") >= 5, log


# --- acceptance: a flood costs little and a normal client is served -----------------------------------


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


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
        made = await create(client, task_id)
        start = {"callbackId": f"cb-{task_id}", "event": {"type": "start", "worker": "w"}}
        headers = bearer(made["callbackToken"])
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


@pytest.mark.anyio
async def test_a_flood_of_unfinished_frames_headers_and_slowloris_costs_little(tmp_path: Path) -> None:
    """100 sockets with unfinished 15 MiB WebSocket frames, 100 unfinished 1 MiB headers and 500 slowloris
    connections from one address (the per-address limit raised for the flood, so that every other limit
    is what stops it): the gateway's RSS grows by less than 50 MiB and a normal client is served
    throughout. Loopback only; it ends by itself within about a minute."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 4096
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"needs {needed} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    url = f"sqlite:///{tmp_path / 'gateway.db'}"
    env = {"GATEWAY_MAX_CONNECTIONS_PER_ADDRESS": "2000"}
    async with (
        gateway_processes(1, url, tmp_path, env=env) as (gw,),
        http_client(base_url=gw.url, timeout=10) as client,
    ):
        until = anyio.Event()
        rounds: list[str] = []
        errors: list[str] = []
        payload = b"a" * (256 * 1024)
        for i in range(3):  # warm up (lazy imports, first connections), then the baseline
            await one_round(client, gw.ws_url, f"warm-{i}")
        baseline = rss_bytes(gw.pid)
        peak = baseline
        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                tg.start_soon(normal_client, client, gw.ws_url, rounds, errors, until)
                for _ in range(100):
                    tg.start_soon(unfinished_frame, gw.port, payload, until)
                    tg.start_soon(unfinished_header, gw.port, payload, until)
                for _ in range(500):
                    tg.start_soon(slowloris, gw.port, until)
                # Past the header timeout (10 s by default), so that every kind has been dealt with.
                flood_end = anyio.current_time() + 15
                while anyio.current_time() < flood_end:
                    peak = max(peak, rss_bytes(gw.pid))
                    await anyio.sleep(0.1)
                until.set()
        assert not errors, errors[:5]
        assert len(rounds) >= 10, rounds
        grown = peak - baseline
        print(f"RSS {baseline / MIB:.1f} MiB -> peak {peak / MIB:.1f} MiB; {len(rounds)} normal rounds")
        assert grown < 50 * MIB, f"the gateway grew by {grown / MIB:.1f} MiB (from {baseline / MIB:.1f} MiB)"
        # And it answers as before.
        async with tcp(gw.port) as stream:
            await stream.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert (await read_until_closed(stream)).startswith(b"HTTP/1.1 200")
