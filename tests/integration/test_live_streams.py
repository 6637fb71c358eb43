"""A task's streams live (protocol.md, Live: chunks and end) through a real server and real clients, on
SQLite and PostgreSQL: on the single-task socket, ``/v1/ws`` and SSE, ``chunks`` frames from each asked
offset after the resume frame, then live ones, a retry's replacing the failed attempt's, every chunk
before the terminal ``event`` frame and one ``end`` frame per stream after it; resumed from the offsets
held (SSE's ids carry them), with nothing missing or repeated, appends committed while a subscription
starts included; a socket whose live chunks pile up past ``GATEWAY_STREAM_BACKLOG_BYTES`` closed ``4008``."""

from __future__ import annotations

from typing import Any

import anyio
import orjson
import pytest
from websockets.asyncio.client import ClientConnection

from tests.integration.test_live_support import (
    closed_with,
    hold_resume_until_committed,
    live_gateway,
    recv_frame,
    socket,
    sse_frames,
    ws_url,
)
from tests.support import STEP_S, Running, bearer, create_task, post_callback
from tests.support.stream_text import StreamText

pytestmark = pytest.mark.anyio

START = {"type": "start", "worker": "w1"}
SUCCEED = {"type": "succeed", "resultRef": "s3://r", "resultHash": "sha256:1"}
RETRY = {"type": "fail", "error": "boom", "retryable": True}


class Producer:
    """A worker appending to a task's streams, each batch numbered per stream and attempt."""

    def __init__(self, gw: Running, task_id: str, token: str) -> None:
        self.gw, self.task_id, self.token = gw, task_id, token
        self.attempt = 1
        self.seqs: dict[str, int] = {}

    async def write(self, stream: str, *chunks: str) -> dict[str, Any]:
        seq = self.seqs.get(stream, 0)
        body = {"attempt": self.attempt, "seq": seq, "chunks": list(chunks)}
        answer = await self.gw.client.post(
            f"/v1/tasks/{self.task_id}/streams/{stream}", json=body, headers=bearer(self.token)
        )
        assert answer.status_code == 200, answer.text
        self.seqs[stream] = seq + 1
        return dict(answer.json())

    def retried(self) -> None:
        self.attempt += 1
        self.seqs.clear()


async def running_task(gw: Running, task_id: str, **kwargs: Any) -> tuple[Producer, str]:
    made = await create_task(gw, task_id, **kwargs)
    await post_callback(gw, task_id, made["callbackToken"], START)
    return Producer(gw, task_id, made["callbackToken"]), made["subscribeToken"]


async def text_of(gw: Running, task_id: str, stream: str) -> str:
    answer = await gw.client.get(f"/v1/tasks/{task_id}/streams/{stream}/text")
    assert answer.status_code == 200, answer.text
    return answer.text


async def frames_until(ws: ClientConnection, holder: StreamText, done: Any) -> list[dict[str, Any]]:
    """Frames until ``done(holder)``, each fed to ``holder``."""
    got: list[dict[str, Any]] = []
    while not done(holder):
        frame = await recv_frame(ws)
        holder.feed(frame)
        got.append(frame)
    return got


async def test_the_single_task_socket_sends_the_streams_from_their_offsets_then_live_then_ends_them(
    database_url: str,
) -> None:
    async with live_gateway(database_url) as gw:
        producer, token = await running_task(gw, "t")
        await producer.write("output", "Hel", "lo")
        await producer.write("output", ", ")
        await producer.write("log", "line 1\n")
        holder = StreamText("t", {"output": 1, "log": 0, "steps": 0})
        query = {"cursor": 1, "token": token, "streams": "output:1,log,steps:0"}
        with anyio.fail_after(STEP_S * 2):
            async with socket(ws_url(gw, "/v1/tasks/t/ws", **query)) as ws:
                first = await recv_frame(ws)
                assert first["type"] == "caught-up"
                holder.feed(first)
                await frames_until(ws, holder, lambda h: h.offsets == {"output": 3, "log": 1, "steps": 0})
                assert holder.texts == {"output": "lo, ", "log": "line 1\n", "steps": ""}
                # Live, as each append commits (the one before the subscription: once).
                await producer.write("output", "wörld")
                await producer.write("steps", "one")
                await frames_until(ws, holder, lambda h: h.offsets == {"output": 4, "log": 1, "steps": 1})
                await producer.write("output", "!")
                await post_callback(gw, "t", producer.token, SUCCEED, attempt=1)
                frames, code = await closed_with(ws)
        for frame in frames:
            holder.feed(frame)
        assert code == 1000
        kinds = [f["type"] for f in frames]
        assert kinds[-4:] == ["event", "end", "end", "end"], kinds
        assert {f["stream"]: f["offset"] for f in frames if f["type"] == "end"} == {
            "output": 5,
            "log": 1,
            "steps": 1,
        }
        assert holder.texts["output"] == "lo, wörld!"
        assert (await text_of(gw, "t", "output")) == "Hello, wörld!"


async def test_v1_ws_sends_streams_a_retrys_output_replaces_the_first_and_the_socket_stays_open(
    database_url: str,
) -> None:
    async with live_gateway(database_url) as gw:
        producer, token = await running_task(gw, "r", max_attempts=2)
        await producer.write("output", "first ", "try")
        holder = StreamText("r", {"output": 0})
        with anyio.fail_after(STEP_S * 2):
            async with socket(ws_url(gw, "/v1/ws")) as ws:
                subscribe = {"type": "subscribe", "taskId": "r", "cursor": 0, "token": token}
                await ws.send(orjson.dumps({**subscribe, "streams": {"output": 0}}).decode())
                await frames_until(ws, holder, lambda h: h.offsets == {"output": 2})
                assert holder.texts == {"output": "first try"}
                await post_callback(gw, "r", producer.token, RETRY, attempt=1)
                await post_callback(gw, "r", producer.token, START)
                producer.retried()
                await producer.write("output", "second")
                await frames_until(ws, holder, lambda h: h.offsets == {"output": 3})
                assert holder.texts == {"output": "second"}
                assert holder.streams["output"].restarts == [1, 2]
                await post_callback(gw, "r", producer.token, SUCCEED, attempt=2)
                await frames_until(ws, holder, lambda h: h.ended)
                await ws.send('{"type":"ping"}')
                assert await recv_frame(ws) == {"type": "pong"}
                # A subscription from an offset of the first attempt starts at the second's first chunk.
                again = StreamText("r", {"output": 1})
                await ws.send(orjson.dumps({**subscribe, "streams": {"output": 1}}).decode())
                await frames_until(ws, again, lambda h: h.ended)
                assert again.texts == {"output": "second"}
                assert ws.close_code is None
        assert (await text_of(gw, "r", "output")) == "second"


async def test_a_subscribe_with_bad_streams_is_refused_after_its_credential(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url) as gw:
        _, token = await running_task(gw, "b")
        with anyio.fail_after(STEP_S):
            async with socket(ws_url(gw, "/v1/ws")) as ws:
                for streams in ({"Bad": 0}, {"output": -1}, [1], {f"s{i}": 0 for i in range(9)}):
                    message = {"type": "subscribe", "taskId": "b", "token": token, "streams": streams}
                    await ws.send(orjson.dumps(message).decode())
                    frame = await recv_frame(ws)
                    assert (frame["type"], frame["code"]) == ("error", "invalid-request"), frame
                message = {"type": "subscribe", "taskId": "b", "token": "nope", "streams": {"Bad": 0}}
                await ws.send(orjson.dumps(message).decode())
                assert (await recv_frame(ws))["code"] == "unauthorized"
            for query in ("output:x", "Bad", ",".join(f"s{i}" for i in range(9))):
                async with socket(ws_url(gw, "/v1/tasks/b/ws", token=token, streams=query)) as ws:
                    frames, code = await closed_with(ws)
                assert [f["code"] for f in frames] == ["invalid-request"] and code == 4400, (query, frames)
            # Nine entries (a name twice) and an offset of 16 digits: as the OpenAPI document says, refused.
            for query in ("a,a,b,c,d,e,f,g,h", "output:1234567890123456", "x:1:2"):
                params = {"token": token, "streams": query}
                answer = await gw.client.get("/v1/tasks/b/stream", params=params)
                assert answer.status_code == 400, (query, answer.text)


async def test_sse_ids_carry_the_offsets_and_last_event_id_resumes_the_streams(database_url: str) -> None:
    async with live_gateway(database_url) as gw:
        producer, token = await running_task(gw, "s")
        epoch = (await gw.client.get("/v1/tasks/s")).json()["epoch"]
        await producer.write("output", "a", "b")
        holder = StreamText("s", {"output": 0})
        params = {"token": token, "streams": "output"}
        ids: list[str | None] = []
        with anyio.fail_after(STEP_S * 2):
            async with gw.client.stream("GET", "/v1/tasks/s/stream", params=params) as response:
                events = sse_frames(response)
                while holder.offsets != {"output": 2}:
                    name, ident, data = await anext(events)
                    assert name == data["type"]
                    holder.feed(data)
                    ids.append(ident)
                await events.aclose()
            assert ids == [f"1:{epoch};output:0", f"1:{epoch};output:2"]
            await producer.write("output", "c")  # while no one listens
            await post_callback(gw, "s", producer.token, SUCCEED, attempt=1)
            holder.resubscribed()
            ids.clear()
            headers = {"Last-Event-ID": f"1:{epoch};output:2"}
            async with gw.client.stream("GET", "/v1/tasks/s/stream", params=params, headers=headers) as r:
                async for _, ident, data in sse_frames(r):
                    holder.feed(data)
                    ids.append(ident)
            # The resume frame (the task ended since), the chunk it missed, the end.
            assert ids == [f"2:{epoch};output:2", f"2:{epoch};output:3", f"2:{epoch};output:3"]
            assert holder.ended and holder.texts == {"output": "abc"}
            # Its EventSource reconnects once more: it has it all.
            headers = {"Last-Event-ID": f"2:{epoch};output:3"}
            done = await gw.client.get("/v1/tasks/s/stream", params=params, headers=headers)
            assert done.status_code == 204
            # One that missed the end frames is not told it has it all.
            headers = {"Last-Event-ID": f"2:{epoch};output:2"}
            async with gw.client.stream("GET", "/v1/tasks/s/stream", params=params, headers=headers) as r:
                rest = [data async for _, _, data in sse_frames(r)]
            assert [f["type"] for f in rest] == ["caught-up", "chunks", "end"], rest


async def test_an_append_committed_while_the_subscription_starts_is_sent_once(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url) as gw:
        producer, token = await running_task(gw, "race")
        await producer.write("output", "a")
        await hold_resume_until_committed(gw, lambda: producer.write("output", "b", "c"))
        holder = StreamText("race", {"output": 0})
        with anyio.fail_after(STEP_S):
            async with socket(ws_url(gw, "/v1/tasks/race/ws", token=token, streams="output")) as ws:
                await frames_until(ws, holder, lambda h: h.offsets == {"output": 3})
                await producer.write("output", "d")
                await frames_until(ws, holder, lambda h: h.offsets == {"output": 4})
        assert holder.texts == {"output": "abcd"}


async def test_a_socket_behind_gets_chunks_merged_and_past_the_backlog_is_closed_4008_then_resumes(
    sqlite_url: str,
) -> None:
    settings = {"stream_backlog_bytes": 256 * 1024, "stream_max_bytes": 1 << 30, "write_timeout_ms": 120_000}
    async with live_gateway(sqlite_url, **settings) as gw:
        hub = gw.gateway.hub
        producer, token = await running_task(gw, "slow")
        big = ["y" * 1000] * 100  # 100 KB a batch: the socket fills after some dozens of these
        holder = StreamText("slow", {"output": 0})
        url = ws_url(gw, "/v1/tasks/slow/ws", token=token, streams="output")
        # As a phone that stops reading: its buffers fill, then the gateway's writes to it wait.
        options = {"max_queue": 1, "compression": None, "max_size": None, "ping_interval": None}
        appended = 0

        async def fill_until(done: Any) -> None:
            nonlocal appended
            for _ in range(1_000):  # bounded in count, each step by its client's timeout
                if done():
                    return
                appended = (await producer.write("output", *big))["nextOffset"]
            raise AssertionError("the socket never filled")

        async with socket(url, **options) as ws:
            holder.feed(await recv_frame(ws))
            await fill_until(lambda: hub.stats()["stream_backlog_max"] > 0)
            # Small batches while it is behind wait together, and go out merged.
            small = [(await producer.write("output", f"s{i}"))["offset"] for i in range(50)]
            with anyio.fail_after(STEP_S * 3):
                got = await frames_until(ws, holder, lambda h: h.offsets["output"] > small[-1])
            carrying = [f for f in got if f["offset"] + len(f["chunks"]) > small[0]]
            assert len(carrying) < len(small), len(carrying)
            # Behind again, past GATEWAY_STREAM_BACKLOG_BYTES: closed 4008, after what reached it.
            await fill_until(lambda: not hub.feeds)
            with anyio.fail_after(STEP_S * 3):
                rest, code = await closed_with(ws, STEP_S * 3)
        assert code == 4008
        for frame in rest:
            holder.feed(frame)
        # It resumes from the offset it holds, and ends with the text.
        await post_callback(gw, "slow", producer.token, SUCCEED, attempt=1)
        holder.resubscribed()
        query = {"token": token, "cursor": 1, "streams": f"output:{holder.offsets['output']}"}
        async with socket(ws_url(gw, "/v1/tasks/slow/ws", **query), max_size=None) as ws:
            frames, code = await closed_with(ws, STEP_S * 3)
        for frame in frames:
            holder.feed(frame)
        assert code == 1000 and holder.ended and holder.offsets == {"output": appended}
        assert holder.texts["output"] == await text_of(gw, "slow", "output")


async def test_a_catch_up_read_finding_no_database_closes_1013(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read the writer makes for a subscription (here a stream's catch-up page) past the database's
    deadline closes the socket ``1013`` (protocol.md: the database cannot be reached, try again later), not
    ``1011`` (an internal error)."""
    async with live_gateway(sqlite_url) as gw:
        producer, token = await running_task(gw, "no-db")
        await producer.write("output", "a")
        streams = gw.gateway.hub.streams
        assert streams is not None

        async def past_the_deadline(*args: Any, **kwargs: Any) -> Any:
            raise TimeoutError

        monkeypatch.setattr(streams, "page", past_the_deadline)
        async with socket(ws_url(gw, "/v1/tasks/no-db/ws", token=token, streams="output")) as ws:
            frames, code = await closed_with(ws)
        assert [f["type"] for f in frames] == ["delta"]  # the resume frame, then no page to send
        assert code == 1013
