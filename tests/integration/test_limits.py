"""The limits (docs/configuration.md, Limits): what a stranger, a broken client or a runaway worker can
hold, and the answer each gets when it reaches a limit. Raw sockets send what client libraries would not."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import socket
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import anyio
import httpx
import orjson
import pytest

from gateway.web.app import GatewayApp
from gateway.web.rate import RateLimiter
from tests.integration.test_live_support import STEP_S, live_gateway, wait_until
from tests.support import (
    Running,
    bearer,
    create_task,
    error,
    issue_tag_token,
    post_callback,
    running_gateway,
)
from tests.support.rawsocket import RawStream, RawWebSocket, http_error, read_until_closed, tcp


async def first_bytes(stream: RawStream) -> bytes:
    """The first bytes the gateway sends (an answer's head), within ``STEP_S``."""
    with anyio.fail_after(STEP_S):
        return await stream.receive()


def port(gw: Running) -> int:
    found = urlsplit(gw.url).port
    assert found is not None
    return found


# --- headers ------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_request_headers_past_their_size_or_count_are_431(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, max_header_bytes=16 * 1024, max_header_count=50) as gw:
        # A header that never ends: refused once it passes the limit, without waiting for the rest.
        async with tcp(port(gw)) as stream:
            await stream.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 64 * 1024)
            status, body = http_error(await read_until_closed(stream))
        assert status == 431 and body["error"]["code"] == "headers-too-large", body
        # The same, whole (its end too) in one write, which the gateway may read in one piece: refused all
        # the same (it was served when one read held the whole request).
        async with tcp(port(gw)) as stream:
            whole = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 20 * 1024 + b"\r\n\r\n"
            await stream.send(whole)
            status, body = http_error(await read_until_closed(stream))
        assert status == 431 and body["error"]["code"] == "headers-too-large", body
        many = b"".join(b"X-H%d: v\r\n" % i for i in range(60))
        async with tcp(port(gw)) as stream:
            await stream.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n" + many + b"\r\n")
            status, body = http_error(await read_until_closed(stream))
        assert status == 431 and "headers" in body["error"]["message"], body
        # Headers within both limits are served.
        fine = await gw.client.get("/healthz", headers={f"X-H{i}": "v" * 100 for i in range(40)})
        assert fine.status_code == 200


# --- slowloris ----------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_unfinished_headers_and_bodies_and_idle_connections_are_timed_out(sqlite_url: str) -> None:
    async with running_gateway(
        sqlite_url, header_timeout_ms=300, body_timeout_ms=300, idle_timeout_ms=300
    ) as gw:
        # Headers sent a few bytes at a time, never finished: 408, whatever keeps trickling in.
        async with tcp(port(gw)) as stream:
            await stream.send(b"GET /healthz HTTP/1.1\r\n")
            received = b""
            with anyio.fail_after(10):
                while not received:
                    await stream.send(b"X")
                    with anyio.move_on_after(0.05):
                        received = await stream.receive()
            received += await read_until_closed(stream)
        status, body = http_error(received)
        assert status == 408 and body["error"]["code"] == "request-timeout", body
        # A body that never finishes, on a route that reads it: 408, then the connection is closed.
        async with tcp(port(gw)) as stream:
            head = b"POST /v1/tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n"
            await stream.send(head + b'{"ttlMs": 1')
            status, body = http_error(await read_until_closed(stream))
        assert status == 408 and body["error"]["code"] == "request-timeout", body
        # A body that a route answers without reading, still trickling in: the connection is closed.
        async with tcp(port(gw)) as stream:
            await stream.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
            received = await read_until_closed(stream)
        assert received.startswith(b"HTTP/1.1 200")
        # Answered before its body is in (a bad token: 401), then the body completes: idle, then closed.
        async with tcp(port(gw)) as stream:
            head = b"POST /v1/tasks/t/callbacks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10\r\n"
            await stream.send(head + b"Authorization: Bearer nope\r\n\r\n{")
            answer = await first_bytes(stream)
            assert answer.startswith(b"HTTP/1.1 401"), answer
            await stream.send(b'"a": 1}  ')
            assert await read_until_closed(stream) == b""
        # A connection that sends nothing, and one kept alive after its answer: closed when idle.
        async with tcp(port(gw)) as stream:
            assert await read_until_closed(stream) == b""
        async with tcp(port(gw)) as stream:
            await stream.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert (await read_until_closed(stream)).startswith(b"HTTP/1.1 200")
        # A client that keeps its requests coming is served on one connection.
        for _ in range(3):
            assert (await gw.client.get("/healthz")).status_code == 200


async def read_answer(stream: RawStream) -> bytes:
    """One whole HTTP answer with a Content-Length (``anyio.EndOfStream`` if the connection ends first)."""
    received = b""
    with anyio.fail_after(10):
        while True:
            received += await stream.receive()
            head, sep, body = received.partition(b"\r\n\r\n")
            if sep:
                length = re.search(rb"(?im)^content-length: *(\d+)", head)
                assert length is not None, head
                if len(body) >= int(length.group(1)):
                    return received


# uvloop (which ``gateway serve`` runs on) runs the timers that are due before it reads the sockets.
@pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {"use_uvloop": True}), "asyncio"], ids=["uvloop", "asyncio"]
)
@pytest.mark.anyio
async def test_a_request_received_before_the_idle_deadline_is_answered_however_late_it_is_read(
    database_url: str,
) -> None:
    """A kept-alive connection whose next request reached the gateway's host before the idle deadline,
    while the gateway was busy past that deadline (a loop iteration of many callbacks, a pause): the
    request is answered. (It used to be reset unanswered: the idle timer ran before the socket was read,
    so the client saw its request hang as long as the gateway was busy, then the connection end.)"""
    request = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    # The next requests must reach the gateway's host within this of the answers: room for a loaded machine.
    idle_s = 1.0
    async with (
        running_gateway(database_url, idle_timeout_ms=int(idle_s * 1000)) as gw,
        tcp(port(gw)) as first,
        tcp(port(gw)) as second,
    ):
        for stream in (first, second):
            await stream.send(request)
            assert (await read_answer(stream)).startswith(b"HTTP/1.1 200")
        answered = time.monotonic()  # after both answers were sent: both deadlines are before answered + idle
        # The next requests are sent before the idle deadlines, from a callback of the gateway's loop reading
        # a socket, which then blocks the loop until both deadlines have passed (the gateway busy reading
        # other connections).
        loop = asyncio.get_running_loop()
        wake, woken = socket.socketpair()
        busy_done = anyio.Event()

        def busy() -> None:
            loop.remove_reader(woken)
            for stream in (first, second):
                stream.sock.send(request)
            time.sleep(max(0.0, answered + idle_s + 0.3 - time.monotonic()))
            busy_done.set()

        with wake, woken:
            loop.add_reader(woken, busy)
            wake.send(b"x")
            with anyio.fail_after(10):
                await busy_done.wait()
        for stream in (first, second):
            assert (await read_answer(stream)).startswith(b"HTTP/1.1 200")
        # Idle again: closed at the deadline, as before.
        for stream in (first, second):
            assert await read_until_closed(stream, within_s=5) == b""


# --- WebSocket messages -------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_websocket_messages_are_small_until_a_subscription_is_authorized(sqlite_url: str) -> None:
    async with live_gateway(
        sqlite_url, api_key="k", ws_max_message_bytes_before_auth=4096, ws_max_message_bytes=32 * 1024
    ) as gw:
        made = await create_task(gw, "t", headers=bearer("k"))
        # Before any subscription: a frame announcing 64 KiB is refused from its header (1009), its
        # payload never buffered.
        async with tcp(port(gw)) as stream:
            ws = RawWebSocket(stream, "/v1/ws")
            await ws.open()
            frame = ws.frame("x" * 64 * 1024)
            await stream.send(frame[:1024])  # the header and the first bytes: the rest never comes
            assert await ws.close_code() == 1009
        # A subscription authorized: larger messages are read (and answered), up to the second limit.
        async with tcp(port(gw)) as stream:
            ws = RawWebSocket(stream, "/v1/ws")
            await ws.open()
            await ws.send(orjson.dumps({"type": "subscribe", "taskId": "t", "token": made.subscribe_token}))
            assert (await ws.recv() or {}).get("type") == "caught-up"
            await ws.send('{"type": "ping", "pad": "' + "x" * 16 * 1024 + '"}')
            assert await ws.recv() == {"type": "pong"}
            await ws.send("x" * 64 * 1024)
            assert await ws.close_code() == 1009
        # A refused subscription does not raise the limit.
        async with tcp(port(gw)) as stream:
            ws = RawWebSocket(stream, "/v1/ws")
            await ws.open()
            await ws.send(orjson.dumps({"type": "subscribe", "taskId": "t", "token": "nope"}))
            assert (await ws.recv() or {}).get("code") == "unauthorized"
            await ws.send('{"type": "ping", "pad": "' + "x" * 16 * 1024 + '"}')
            assert await ws.close_code() == 1009


@pytest.mark.anyio
async def test_a_subscribe_and_a_large_message_sent_together_are_read_one_after_the_other(
    sqlite_url: str,
) -> None:
    """A client reconnecting with a task's subscribe and, at once in the same write, a tag's subscribe with
    a cursors map over the limit before authorization: the map is read after the subscribe was authorized,
    under the larger limit, and both are served. (It used to be judged while the subscribe was still
    unanswered, closed 1009, and a client reconnecting the same way looped.) Behind a refused subscribe, the
    same message is still over the limit."""
    async with live_gateway(
        sqlite_url, api_key="k", ws_max_message_bytes_before_auth=4096, ws_max_message_bytes=32 * 1024
    ) as gw:
        made = await create_task(gw, "t", tags=["owner:u"], headers=bearer("k"))
        tag_token = await issue_tag_token(gw, "owner:u", headers=bearer("k"))
        cursors = {f"gone-{i:04d}": 1 for i in range(300)} | {"t": 0}  # tasks the client knew, most deleted
        task = {"type": "subscribe", "taskId": "t", "token": made.subscribe_token}
        tag = {"type": "subscribe", "tag": "owner:u", "token": tag_token, "cursors": cursors}
        assert 4096 < len(orjson.dumps(tag)) < 32 * 1024
        for _ in range(2):  # and again, as a client reconnecting the same way
            async with tcp(port(gw)) as stream:
                ws = RawWebSocket(stream, "/v1/ws")
                await ws.open()
                await ws.send(orjson.dumps(task), orjson.dumps(tag))
                frames = [await ws.recv() or {} for _ in range(3)]
                assert [(f.get("type"), f.get("taskId") or f.get("tag")) for f in frames] == [
                    ("caught-up", "t"),
                    ("tag", "owner:u"),
                    ("caught-up", "t"),  # the tag streams the task now (the socket streams it once)
                ], frames
        async with tcp(port(gw)) as stream:
            ws = RawWebSocket(stream, "/v1/ws")
            await ws.open()
            await ws.send(orjson.dumps({**task, "token": "nope"}), orjson.dumps(tag))
            assert await ws.close_code() == 1009  # (the subscribe's error frame may not have gone out)


# --- connections per address --------------------------------------------------------------------------


HOST = "127.0.0.3"


@pytest.mark.anyio
async def test_connections_past_the_limit_of_one_address_are_429(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url, max_connections_per_address=3) as gw:
        await create_task(gw, "t")  # (the test's client, on 127.0.0.1, is counted apart)
        async with tcp(port(gw), local_host=HOST) as a, tcp(port(gw), local_host=HOST) as b:
            ws = RawWebSocket(a, "/v1/tasks/t/ws")
            await ws.open()  # a WebSocket counts as long as it is open
            assert (await ws.recv() or {}).get("type") == "caught-up"
            await b.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert (await first_bytes(b)).startswith(b"HTTP/1.1 200")
            async with tcp(port(gw), local_host=HOST) as c:  # the third
                await c.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert (await first_bytes(c)).startswith(b"HTTP/1.1 200")
                async with tcp(port(gw), local_host=HOST) as d:  # the fourth: refused at once
                    status, body = http_error(await read_until_closed(d))
                    assert status == 429 and body["error"]["code"] == "too-many-connections", body
                # Another address is counted apart.
                transport = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
                async with httpx.AsyncClient(transport=transport) as other:
                    assert (await other.get(gw.url + "/healthz")).status_code == 200
            # One closed: a new one is let in.
            async with tcp(port(gw), local_host=HOST) as e:
                await e.send(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert (await first_bytes(e)).startswith(b"HTTP/1.1 200")


# --- callbacks per second, history length -------------------------------------------------------------


@pytest.mark.anyio
async def test_callbacks_past_the_rate_of_a_task_are_429_with_retry_after(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, callback_rate_per_s=5) as gw:
        # The gateway's limit, on a clock that stands still: no bucket refills while the test runs, however
        # slow the machine (on the real clock one callback more passed every 200 ms, the fresh token's below
        # among them when the requests took that long). The refill is tests/unit/test_limits.py's.
        app = gw.app
        assert isinstance(app, GatewayApp)
        limiter = app.context.callback_rate
        assert limiter.rate == 5
        still = RateLimiter(limiter.rate, clock=lambda: 0.0)
        app.context = dataclasses.replace(app.context, callback_rate=still)
        first = await create_task(gw, "first")
        other = await create_task(gw, "other")
        await post_callback(gw, "first", first.callback_token, {"type": "start", "worker": "w"})
        answers = [
            await post_callback(
                gw,
                "first",
                first.callback_token,
                {"type": "progress", "progress": 1, "cursor": f"{i}"},
                expect=None,
            )
            for i in range(20)
        ]
        limited = [a for a in answers if a.status_code == 429]
        assert limited and all(a.status_code in (200, 429) for a in answers)
        error(limited[0], 429, "rate-limited")
        assert int(limited[0].headers["retry-after"]) >= 1
        # Fresh tokens for the same task share its limit; another task has its own.
        again = await create_task(gw, "first", expect=200)
        progress = {"type": "progress", "progress": 1, "cursor": "x"}
        error(
            await post_callback(gw, "first", again.callback_token, progress, expect=None), 429, "rate-limited"
        )
        await post_callback(gw, "other", other.callback_token, {"type": "start", "worker": "w"})


@pytest.mark.anyio
async def test_a_task_at_its_history_limit_takes_only_the_callback_that_ends_it(database_url: str) -> None:
    async with running_gateway(database_url, max_history_versions=3) as gw:
        made = await create_task(gw, "t", max_attempts=5)
        token = made.callback_token
        await post_callback(gw, "t", token, {"type": "start", "worker": "w"})
        for p in (10, 20):
            await post_callback(gw, "t", token, {"type": "progress", "progress": p, "cursor": ""})
        refused = await post_callback(
            gw, "t", token, {"type": "progress", "progress": 30, "cursor": ""}, expect=None
        )
        assert "history" in error(refused, 409, "history-full")
        retry = {"type": "fail", "error": "again", "retryable": True}  # would requeue: not an end
        error(await post_callback(gw, "t", token, retry, expect=None), 409, "history-full")
        done = {"type": "succeed", "resultRef": "r", "resultHash": "h"}
        answer = await post_callback(gw, "t", token, done)
        assert answer["task"]["state"] == "succeeded" and answer["task"]["version"] == 4
        events = (await gw.client.get("/v1/tasks/t/events")).json()
        assert events["version"] == 4


# --- bad numbers, ids, content types ------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("progress", [2**64, 2**70, -(2**63) - 1, -(2**64)])
async def test_a_progress_past_64_bits_with_a_callback_id_is_400_not_500(
    sqlite_url: str, progress: int
) -> None:
    async with running_gateway(sqlite_url) as gw:
        made = await create_task(gw, "t")
        token = made.callback_token
        await post_callback(gw, "t", token, {"type": "start", "worker": "w"})
        event = {"type": "progress", "progress": progress, "cursor": "c"}
        answer = await post_callback(gw, "t", token, event, callback_id="big", expect=None)
        assert "progress" in error(answer, 400, "invalid-request")
        # A huge float is a number the machine judges (over 100): not a 500 either.
        huge = {"type": "progress", "progress": 1e300, "cursor": "c"}
        answer = await post_callback(gw, "t", token, huge, callback_id="huge", expect=None)
        error(answer, 400, "invalid-request")
        # Nothing was stored, and the largest 64-bit integers are still a question for the machine.
        assert (await gw.client.get("/v1/tasks/t")).json()["version"] == 1
        edge = {"type": "progress", "progress": 2**63 - 1, "cursor": "c"}
        error(
            await post_callback(gw, "t", token, edge, callback_id="edge", expect=None), 400, "invalid-request"
        )


@pytest.mark.anyio
async def test_task_ids_dot_and_dot_dot_are_refused(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        for task_id in (".", ".."):
            answer = await create_task(gw, task_id, expect=None)
            assert task_id in error(answer, 400, "invalid-request")
        await create_task(gw, "...")  # not a path segment of its own: fine


@pytest.mark.anyio
async def test_a_body_declared_as_anything_but_json_is_415(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        body = b'{"id": "t", "ttlMs": 60000, "maxAttempts": 1}'
        for declared in (
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
        ):
            answer = await gw.client.post("/v1/tasks", content=body, headers={"Content-Type": declared})
            assert "application/json" in error(answer, 415, "unsupported-media-type")
        for declared in ("application/json", "application/json; charset=utf-8", "Application/JSON"):
            answer = await gw.client.post("/v1/tasks", content=body, headers={"Content-Type": declared})
            assert answer.status_code in (200, 201), answer.text
        # No Content-Type at all is taken as JSON.
        answer = await gw.client.post("/v1/tasks", content=body)
        assert answer.status_code == 200, answer.text
        made = answer.json()
        start = b'{"event": {"type": "start", "worker": "w"}}'
        headers = {**bearer(made["callbackToken"]), "Content-Type": "text/plain"}
        error(
            await gw.client.post("/v1/tasks/t/callbacks", content=start, headers=headers),
            415,
            "unsupported-media-type",
        )


# --- open mode: Host and Origin -----------------------------------------------------------------------


@pytest.mark.anyio
async def test_loopback_host_names_are_compared_without_case_or_final_dot(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        for host in ("LOCALHOST", "localhost.", f"Localhost.:{port(gw)}", "127.0.0.1"):
            answer = await gw.client.get("/healthz", headers={"Host": host})
            assert answer.status_code == 200, (host, answer.text)
        error(await gw.client.get("/healthz", headers={"Host": "localhost.evil.example"}), 403, "forbidden")


@pytest.mark.anyio
@pytest.mark.parametrize("api_key", [None, "k"], ids=["open-mode", "api-key"])
async def test_http_and_websockets_share_one_rule_for_loopback_origins(
    sqlite_url: str, api_key: str | None
) -> None:
    async with live_gateway(sqlite_url, api_key=api_key) as gw:
        key = bearer(api_key) if api_key else None
        made = await create_task(gw, "t", headers=key)
        for origin, allowed in (("http://localhost:3000", True), ("http://evil.example", False)):
            if api_key is None:  # the HTTP guard of open mode
                answer = await gw.client.post("/v1/notifications/drain", headers={"Origin": origin})
                assert (answer.status_code == 200) is allowed, (origin, answer.text)
            async with tcp(port(gw)) as stream:
                ws = RawWebSocket(stream, f"/v1/tasks/t/ws?token={made.subscribe_token}")
                try:
                    await ws.open(Origin=origin)
                except AssertionError:
                    assert not allowed and api_key is None  # open mode refuses the handshake itself
                    continue
                first = await ws.recv()
                if allowed:
                    assert first is not None and first["type"] == "caught-up", first
                else:
                    assert first is not None and first["code"] == "forbidden", first
                    assert await ws.close_code() == 4403


# --- the many-task socket -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_unknown_message_type_is_named_as_such(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url) as gw, tcp(port(gw)) as stream:
        ws = RawWebSocket(stream, "/v1/ws")
        await ws.open()
        for message in ('{"type": "PING"}', '{"type": "subscribe-all", "taskId": "t"}', "{}"):
            await ws.send(message)
            frame = await ws.recv()
            assert frame is not None and frame["code"] == "invalid-request", frame
            assert frame["message"].startswith("type:"), frame


@pytest.mark.anyio
async def test_a_pong_does_not_overtake_the_resume_frame_of_an_earlier_subscribe(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url) as gw:
        made = await create_task(gw, "t")
        async with tcp(port(gw)) as stream:
            ws = RawWebSocket(stream, "/v1/ws")
            await ws.open()
            subscribe = orjson.dumps({"type": "subscribe", "taskId": "t", "token": made.subscribe_token})
            await ws.send(subscribe, '{"type": "ping"}')  # one write: read together
            assert [(await ws.recv() or {}).get("type") for _ in range(2)] == ["caught-up", "pong"]


@pytest.mark.anyio
async def test_many_pipelined_bad_messages_from_a_reading_client_are_all_answered(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url) as gw, tcp(port(gw)) as stream:
        await create_task(gw, "t")
        ws = RawWebSocket(stream, "/v1/ws")
        await ws.open()
        count = 1000
        # Holding a subscription (a socket that holds none is closed at its 5th refusal: test_live_idle).
        await ws.send('{"type": "subscribe", "taskId": "t"}', *["not json"] * count, '{"type": "ping"}')
        resumed = await ws.recv()
        assert resumed is not None and resumed["type"] == "caught-up", resumed
        answers = [await ws.recv() for _ in range(count + 1)]
        assert all(a is not None and a["code"] == "invalid-request" for a in answers[:count])
        assert answers[-1] == {"type": "pong"}  # and the socket is still open
        assert gw.gateway.hub.stats()["connections"] == 1


# --- a peer that never reads --------------------------------------------------------------------------


async def flood(
    gw: Running,
    task_id: str,
    token: str,
    count: int,
    pad: int = 60_000,
    *,
    until: Callable[[], bool] | None = None,
) -> None:
    """``count`` progress entries of about ``pad`` bytes each (a retry every 100, progress rises within an
    attempt): more than the kernel buffers between a gateway and a peer that does not read. With ``until``,
    it stops as soon as that holds."""
    start = {"type": "start", "worker": "w"}
    await post_callback(gw, task_id, token, start)
    for i in range(count):
        if until is not None and until():
            return
        if i and i % 100 == 0:
            await post_callback(gw, task_id, token, {"type": "fail", "error": "e", "retryable": True})
            await post_callback(gw, task_id, token, start)
        progress = {"type": "progress", "progress": i % 100, "cursor": f"{i}-" + "c" * pad}
        await post_callback(gw, task_id, token, progress)


def hub_stats(gw: Running) -> dict[str, int]:
    stats: dict[str, int] = gw.gateway.hub.stats()
    return stats


def server_side_open(server_port: int, client_port: int) -> bool:
    """Whether the gateway still holds its end of this client's TCP connection (``/proc/net/tcp``)."""
    wanted = (f"0100007F:{server_port:04X}", f"0100007F:{client_port:04X}")
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            local, remote = line.split()[1:3]
            if (local, remote) == wanted:
                return True
    return False


@pytest.mark.anyio
async def test_a_websocket_that_never_reads_is_dropped_when_the_grace_ends(sqlite_url: str) -> None:
    settings = {"write_timeout_ms": 500, "slow_close_grace_ms": 1000, "callback_rate_per_s": 0}
    async with live_gateway(sqlite_url, **settings) as gw:
        made = await create_task(gw, "t", max_attempts=10)
        async with tcp(port(gw), receive_buffer=4096) as stream:
            client_port = stream.local_port
            ws = RawWebSocket(stream, f"/v1/tasks/t/ws?token={made.subscribe_token}")
            await ws.open()
            await flood(gw, "t", made.callback_token, 150)
            # Cut for not reading (its subscriptions let go at once) ...
            await wait_until(lambda: hub_stats(gw)["connections"] == 0, lambda: f"the cut: {hub_stats(gw)}")
            # ... then, never having read, its socket and buffers are dropped when the grace ends.
            await wait_until(
                lambda: not server_side_open(port(gw), client_port), "its TCP connection dropped at the grace"
            )


@pytest.mark.anyio
async def test_a_websocket_that_reads_only_after_its_keepalive_ping_was_due_is_told_4008(
    sqlite_url: str,
) -> None:
    """The peer of issue 9 (5): it stops reading, is cut for it (4008), and reads again only after the
    server's keep-alive ping to it would have gone unanswered past its deadline, within the grace. It is
    still told 4008 (it used to get 1011, the ping's timeout, or lose the connection without a close frame).
    As by default, the ping's interval (and timeout) is longer than the write timeout, so the cut comes
    first."""
    ping_s = 3.0
    settings = {
        "write_timeout_ms": 500,
        "callback_rate_per_s": 0,
        "ws_ping_interval_ms": int(ping_s * 1000),
        "max_body_bytes": 1 << 20,  # room for the flood's entries of a megabyte
    }
    async with live_gateway(sqlite_url, **settings) as gw:
        made = await create_task(gw, "t", max_attempts=10)
        async with tcp(port(gw), receive_buffer=4096) as stream:
            ws = RawWebSocket(stream, f"/v1/tasks/t/ws?token={made.subscribe_token}")
            await ws.open()
            opened = anyio.current_time()
            # Only until the cut: a flood that goes on past it would only delay the check below. Entries of
            # a megabyte fill the gateway's buffers in a score of callbacks (of 60 KB it took some 70, over
            # 2 to 2.7 s beside two CPU burners: past the first ping now and then).
            await flood(
                gw,
                "t",
                made.callback_token,
                150,
                pad=1_000_000,
                until=lambda: hub_stats(gw)["connections"] == 0,
            )
            await wait_until(lambda: hub_stats(gw)["connections"] == 0, lambda: f"the cut: {hub_stats(gw)}")
            assert anyio.current_time() - opened < ping_s, "cut after the first ping: no test of it"
            # The peer's own behaviour under test: it goes on not reading past the first ping's deadline
            # (an interval, then as long again for the pong) and a little more, well within the grace (30 s).
            await anyio.sleep(opened + 2 * ping_s + 1 - anyio.current_time())
            assert await ws.close_code(within_s=30) == 4008


@pytest.mark.anyio
async def test_an_sse_stream_that_is_not_read_is_dropped(sqlite_url: str) -> None:
    settings = {"write_timeout_ms": 500, "callback_rate_per_s": 0}
    async with live_gateway(sqlite_url, **settings) as gw:
        made = await create_task(gw, "t", max_attempts=10)
        async with tcp(port(gw), receive_buffer=4096) as stream:
            client_port = stream.local_port
            await stream.send(b"GET /v1/tasks/t/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            await wait_until(lambda: hub_stats(gw)["subscriptions"] == 1, "the stream subscribed")
            await flood(gw, "t", made.callback_token, 150)
            await wait_until(lambda: hub_stats(gw)["connections"] == 0, lambda: f"the cut: {hub_stats(gw)}")
            await wait_until(
                lambda: not server_side_open(port(gw), client_port), "its TCP connection dropped"
            )
