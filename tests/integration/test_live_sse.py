"""Server-sent events (protocol.md, Server-sent events): the single-task socket's frames, each an SSE event
named by its frame type with ``id:`` its cursor (version and epoch); ``Last-Event-ID`` (or ``?cursor=``)
resumes without a gap, and the stream ends after the terminal frame."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from tests.integration.test_live_support import (
    StreamCheck,
    get_task,
    live_gateway,
    sse_frames,
)
from tests.support import Running, bearer, create_task, post_callback


def progress(p: int) -> dict[str, Any]:
    return {"type": "progress", "progress": p, "cursor": f"row-{p}"}


def feed(check: StreamCheck, name: str, ident: str | None, data: dict[str, Any]) -> None:
    """One SSE event: named by its frame's type, ``id`` its cursor (version and epoch), then the ordering
    check."""
    assert name == data["type"], (name, data)
    assert ident == f"{data['version']}:{data['task']['epoch']}", (ident, data)
    check.feed(data)


def stream(gw: Running, task_id: str, token: str, **kwargs: Any) -> Any:
    return gw.client.stream("GET", f"/v1/tasks/{task_id}/stream", params={"token": token}, **kwargs)


@pytest.mark.anyio
async def test_a_stream_resumed_with_last_event_id_continues_without_a_gap_and_ends_after_the_terminal_frame(
    database_url: str,
) -> None:
    async with live_gateway(database_url) as gw:
        hub = gw.gateway.hub
        made = await create_task(gw, "sse")
        token, sub = made["callbackToken"], made["subscribeToken"]
        await post_callback(gw, "sse", token, {"type": "start", "worker": "w1"})  # v1
        with anyio.fail_after(20):
            first = StreamCheck("sse", 0)
            async with stream(gw, "sse", sub) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                events = sse_frames(response)
                feed(first, *await anext(events))
                assert first.resume is not None and first.resume["type"] == "delta"
                for p in (10, 20, 30):  # v2..v4, each read live
                    await post_callback(gw, "sse", token, progress(p))
                    feed(first, *await anext(events))
                assert first.event_versions == [2, 3, 4]
                await events.aclose()
            # The client went away: the gateway lets go of its feed.
            await hub.idle()

            for p in (40, 50):  # v5, v6 while away
                await post_callback(gw, "sse", token, progress(p))
            resumed = StreamCheck("sse", first.version, base=first.task, retention=8)
            last_id = f"{first.version}:{made['task']['epoch']}"  # what an EventSource sends back
            async with stream(gw, "sse", sub, headers={"Last-Event-ID": last_id}) as response:
                assert response.status_code == 200
                events = sse_frames(response)
                feed(resumed, *await anext(events))
                assert resumed.resume is not None and resumed.resume["type"] == "delta"
                assert [e["version"] for e in resumed.resume["events"]] == [5, 6]
                await post_callback(gw, "sse", token, progress(60))  # v7
                done = {"type": "succeed", "resultRef": "s3://sse", "resultHash": "h"}
                await post_callback(gw, "sse", token, done)  # v8
                # The stream ends by itself after the terminal frame.
                async for name, ident, data in events:
                    feed(resumed, name, ident, data)
            assert resumed.event_versions == [7, 8]
            resumed.assert_final(await get_task(gw, "sse"))
            await hub.idle()


@pytest.mark.anyio
async def test_cursor_query_and_a_finished_task(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url) as gw:
        made = await create_task(gw, "done")
        token, sub = made["callbackToken"], made["subscribeToken"]
        await post_callback(gw, "done", token, {"type": "start", "worker": "w1"})
        await post_callback(gw, "done", token, progress(50))
        await post_callback(gw, "done", token, {"type": "fail", "error": "disk full", "retryable": False})
        final = await get_task(gw, "done")
        assert final["state"] == "failed" and final["version"] == 3
        with anyio.fail_after(10):
            for cursor, expected in ((1, "delta"), (3, "caught-up"), (9, "snapshot")):
                check = StreamCheck("done", cursor, retention=8)
                async with gw.client.stream(
                    "GET", "/v1/tasks/done/stream", params={"token": sub, "cursor": cursor}
                ) as response:
                    async for name, ident, data in sse_frames(response):
                        feed(check, name, ident, data)
                assert check.types == [expected], "a finished task: the resume frame, then the end"
                check.assert_final(final)


@pytest.mark.anyio
async def test_stream_refusals_are_http_errors(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url, api_key="live-key") as gw:
        made = await create_task(gw, "guarded", headers=bearer("live-key"))
        other = await create_task(gw, "other", headers=bearer("live-key"))
        cases = [
            ({}, 401, "unauthorized"),
            ({"token": other["subscribeToken"]}, 403, "forbidden"),
            ({"token": made["callbackToken"]}, 403, "forbidden"),
            ({"token": made["subscribeToken"], "cursor": "soon"}, 400, "invalid-request"),
        ]
        for params, status, code in cases:
            answer = await gw.client.get("/v1/tasks/guarded/stream", params=params)
            assert answer.status_code == status, (params, answer.text)
            assert answer.json()["error"]["code"] == code
        answer = await gw.client.get("/v1/tasks/nope/stream", headers=bearer("live-key"))
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "unknown-task"
        assert gw.gateway.hub.stats()["connections"] == 0
