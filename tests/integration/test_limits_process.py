"""The limits against ``gateway serve`` as deployed (a subprocess, its own log, its own memory): what its
log shows of tokens and hang-ups, and issue 9's flood of unfinished frames, unfinished headers and slowloris
connections while a normal client is served (what it costs is the bench check ``flood``)."""

from __future__ import annotations

import re
import resource
from pathlib import Path

import httpx
import orjson
import pytest
from websockets.asyncio.client import connect

from bench.checks.flood import flood
from tests.support import bearer, eventually, http_client
from tests.support.processes import gateway_processes
from tests.support.rawsocket import read_until_closed, tcp


async def create(client: httpx.AsyncClient, task_id: str) -> dict[str, str]:
    answer = await client.post("/v1/tasks", json={"id": task_id, "ttlMs": 600_000, "maxAttempts": 3})
    assert answer.status_code == 201, answer.text
    made: dict[str, str] = answer.json()
    return made


# --- logs ---------------------------------------------------------------------------------------------

# The gateway's count of answers to the five hang-ups below (the create before them is a 201).
HUNG_UP_ANSWERED = 'gateway_http_requests_total{method="POST",status="400"} 5.0'


async def answered_posts(client: httpx.AsyncClient) -> list[str]:
    """The lines of ``/metrics`` counting the POSTs answered, by status."""
    lines = (await client.get("/metrics")).text.splitlines()
    return [line for line in lines if line.startswith('gateway_http_requests_total{method="POST"')]


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
            # A hang-up has no access line (its answer has nobody to go to), and the gateway may handle it
            # after a later request: wait until it has counted the answer it made to each, so that whatever
            # their handling logs is in the log before it is read (a traceback would be, or a 500 counted
            # instead).
            await eventually(
                lambda: answered_posts(client),
                lambda counts: HUNG_UP_ANSWERED in counts,
                "the five hang-ups answered (400) by the gateway",
            )
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


@pytest.mark.anyio
async def test_a_flood_of_unfinished_frames_headers_and_slowloris_leaves_a_normal_client_served(
    tmp_path: Path,
) -> None:
    """Issue 9's flood (bench/checks/flood.py): 100 unfinished 15 MiB frames, 100 never-ending 1 MiB headers
    and 500 slowloris connections from one address (the per-address limit raised for the flood, so that
    every other limit is what stops it), past the header timeout (a second here): a normal client is served
    throughout, every round of it, and the gateway answers after. What the flood costs (under 50 MiB of RSS
    over 15 s) and how many rounds it leaves the client (10 or more) is no test, a loaded machine can miss
    it: it is the bench check ``flood``. Loopback only; it ends by itself within seconds."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 4096
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"needs {needed} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    url = f"sqlite:///{tmp_path / 'gateway.db'}"
    env = {"GATEWAY_MAX_CONNECTIONS_PER_ADDRESS": "2000", "GATEWAY_HEADER_TIMEOUT_MS": "1000"}
    async with (
        gateway_processes(1, url, tmp_path, env=env) as (gw,),
        http_client(base_url=gw.url, timeout=10) as client,
    ):
        found = await flood(gw.pid, gw.port, client, gw.ws_url, seconds=2.0)
        assert not found.errors, found.errors[:5]
        assert found.rounds, "no round of the normal client during the flood"
        # And it answers as before.
        async with tcp(gw.port) as stream:
            await stream.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert (await read_until_closed(stream)).startswith(b"HTTP/1.1 200")
