"""Tag subscriptions on ``/v1/ws`` (protocol.md, Live: tags), against a real server and a real WebSocket
client, with an API key configured (so the tag token is checked).

A subscriber of a tag gets the ``tag`` frame (its tasks, newest first), each task's resume frame in that
order, then the events of all of them; a task created later with the tag is announced (``added``, then its
``snapshot`` ``new``) and streamed. After a drop it subscribes again with its cursors map and gets, per
task, exactly what it missed (``caught-up``, ``delta``, ``snapshot``), and ``snapshot`` ``new`` for the
tasks created while it was away: nothing lost, nothing twice. Refused messages get an ``error`` frame that
names the tag; a subscribe of 200 tasks costs two store queries.
"""

from __future__ import annotations

from typing import Any

import anyio
import orjson
import pytest

from gateway.store import pg_writer, sql
from tests.integration.test_live_support import (
    TagWatch,
    create_task,
    get_task,
    live_gateway,
    post_event,
    recv_frame,
    socket,
    tag_subscribe,
    ws_url,
)
from tests.support import bearer, issue_tag_token, mint_tag

pytestmark = pytest.mark.anyio

API_KEY = "tags-api-key"
TAG = "owner:u42"
OTHER = "owner:u7"


def key() -> dict[str, str]:
    return bearer(API_KEY)


def progress(p: int) -> dict[str, Any]:
    return {"type": "progress", "progress": p, "cursor": f"row-{p}"}


async def frames(ws: Any, watch: TagWatch, n: int) -> list[dict[str, Any]]:
    got = [await recv_frame(ws) for _ in range(n)]
    for frame in got:
        watch.feed(frame)
    return got


async def pong(ws: Any) -> None:
    """A ping answered: every frame queued before it has come (none was left out of what was read)."""
    await ws.send('{"type": "ping"}')
    assert await recv_frame(ws) == {"type": "pong"}


async def test_a_tag_subscriber_gets_its_tasks_and_new_ones_then_resumes_with_its_cursors(
    database_url: str,
) -> None:
    async with live_gateway(database_url, api_key=API_KEY) as gw:
        made = {name: await create_task(gw, name, tags=[TAG], headers=key()) for name in ("t1", "t2", "t3")}
        await create_task(gw, "other", tags=[OTHER], headers=key())
        token = await issue_tag_token(gw, TAG, headers=key())
        cb = {name: m.callback_token for name, m in made.items()}
        await post_event(gw, "t1", cb["t1"], {"type": "start", "worker": "w1"})
        watch = TagWatch(TAG)
        with anyio.fail_after(30):
            async with socket(ws_url(gw, "/v1/ws")) as ws:
                await ws.send(tag_subscribe(TAG, token))
                got = await frames(ws, watch, 4)
                assert got[0] == {"type": "tag", "tag": TAG, "taskIds": ["t3", "t2", "t1"], "more": False}
                assert [(f["taskId"], f["type"], f["reason"], f["version"]) for f in got[1:]] == [
                    ("t3", "snapshot", "new", 0),
                    ("t2", "snapshot", "new", 0),
                    ("t1", "snapshot", "new", 1),
                ]
                # A task created with the tag is announced, then streamed; one without it reaches no one.
                made["t4"] = await create_task(gw, "t4", tags=[TAG, "zone:eu"], headers=key())
                cb["t4"] = made["t4"].callback_token
                got = await frames(ws, watch, 2)
                assert got[0] == {"type": "added", "tag": TAG, "taskId": "t4"}
                assert got[1]["task"]["tags"] == [TAG, "zone:eu"]
                await post_event(gw, "t4", cb["t4"], {"type": "start", "worker": "w4"})
                await post_event(gw, "t2", cb["t2"], {"type": "start", "worker": "w2"})
                await frames(ws, watch, 2)
                await create_task(gw, "elsewhere", tags=[OTHER], headers=key())
                await pong(ws)
            assert watch.added == ["t4"]
            assert watch.cursors == {"t1": 1, "t2": 1, "t3": 0, "t4": 1}

            # Away: t1 moves on past the retention (8), t2 a little, t3 not at all; t5 is created.
            for p in range(10, 100, 10):
                await post_event(gw, "t1", cb["t1"], progress(p))
            await post_event(gw, "t2", cb["t2"], progress(50))
            done = {"type": "succeed", "resultRef": "s3://t4", "resultHash": "sha256:4"}
            await post_event(gw, "t4", cb["t4"], done)
            made["t5"] = await create_task(gw, "t5", tags=[TAG], headers=key())
            cursors, held = watch.cursors, watch.tasks
            again = TagWatch(TAG, cursors, held)
            async with socket(ws_url(gw, "/v1/ws")) as ws:
                await ws.send(tag_subscribe(TAG, token, cursors))
                got = await frames(ws, again, 6)
                assert got[0]["taskIds"] == ["t5", "t4", "t3", "t2", "t1"]
                assert [(f["taskId"], f["type"], f.get("reason"), f["version"]) for f in got[1:]] == [
                    ("t5", "snapshot", "new", 0),
                    ("t4", "delta", None, 2),
                    ("t3", "caught-up", None, 0),
                    ("t2", "delta", None, 2),
                    ("t1", "snapshot", "retention", 10),
                ]
                await post_event(gw, "t5", made["t5"].callback_token, {"type": "start", "worker": "w5"})
                await post_event(gw, "t3", cb["t3"], {"type": "start", "worker": "w3"})
                await frames(ws, again, 2)
                await pong(ws)
        assert again.added == []
        for task_id, check in again.checks.items():
            check.assert_final(await get_task(gw, task_id, token))


async def test_refused_tag_messages_get_an_error_frame_naming_the_tag(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url, api_key=API_KEY, tag_subscription_max=3, max_subscriptions=2) as gw:
        for i in range(5):
            await create_task(gw, f"t{i}", tags=[TAG], headers=key())
        task = await create_task(gw, "lone", headers=key())
        token = mint_tag(TAG)
        refused: list[tuple[dict[str, Any], str, str, str | None]] = [
            ({"tag": "owner u42"}, "invalid-request", "tag: 'owner u42' is not a tag", "owner u42"),
            ({"tag": 7}, "invalid-request", "tag: a tag must be a string", None),
            ({"tag": TAG, "taskId": "t0"}, "invalid-request", "a taskId or a tag, not both", TAG),
            ({"tag": TAG, "token": token, "cursors": ["t0"]}, "invalid-request", "cursors: must be", TAG),
            ({"tag": TAG, "token": token, "cursors": {"t0": -1}}, "invalid-request", "cursors['t0']", TAG),
            ({"tag": TAG, "token": token, "cursors": {"t0": True}}, "invalid-request", "cursors['t0']", TAG),
            (
                {"tag": TAG, "token": token, "cursors": {f"t{i}": 0 for i in range(4)}},
                "invalid-request",
                "at most 3 tasks (GATEWAY_TAG_SUBSCRIPTION_MAX)",
                TAG,
            ),
            ({"tag": TAG}, "unauthorized", "missing", TAG),
            ({"tag": TAG, "token": "not-a-jwt"}, "unauthorized", "token is malformed", TAG),
            ({"tag": TAG, "token": API_KEY}, "unauthorized", "never from a subscribe message", TAG),
            ({"tag": TAG, "token": task.subscribe_token}, "forbidden", "a task token cannot", TAG),
            ({"tag": TAG, "token": mint_tag(OTHER)}, "forbidden", "token is for another tag", TAG),
        ]
        with anyio.fail_after(30):
            async with socket(ws_url(gw, "/v1/ws")) as ws:
                # A valid subscription first, so that the refusals do not close the socket.
                await ws.send(tag_subscribe(TAG, token))
                watch = TagWatch(TAG)
                got = await frames(ws, watch, 4)
                assert got[0] == {"type": "tag", "tag": TAG, "taskIds": ["t4", "t3", "t2"], "more": True}
                metrics = (await gw.client.get("/metrics")).text.splitlines()
                assert "gateway_hub_tag_subscriptions 1.0" in metrics
                assert "gateway_hub_subscriptions 3.0" in metrics  # the tasks it streams
                for body, code, words, tag in refused:
                    await ws.send(orjson.dumps({"type": "subscribe", **body}).decode())
                    frame = await recv_frame(ws)
                    assert frame["type"] == "error" and frame["code"] == code, (body, frame)
                    assert words in frame["message"], (body, frame)
                    assert frame.get("tag") == tag and "taskId" not in frame, (body, frame)
                # The tag counts as one subscription (of 2), whatever it streams: one task more, not two.
                await ws.send(
                    orjson.dumps(
                        {"type": "subscribe", "taskId": "lone", "token": task.subscribe_token}
                    ).decode()
                )
                assert (await recv_frame(ws))["type"] == "caught-up"
                await ws.send(tag_subscribe(OTHER, mint_tag(OTHER)))
                frame = await recv_frame(ws)
                assert (frame["code"], frame["tag"]) == ("invalid-request", OTHER)
                assert "at most 2 subscriptions" in frame["message"]
                # Unsubscribing ends the tag's streams: no answer, and no frame of its tasks after.
                await ws.send(orjson.dumps({"type": "unsubscribe", "tag": TAG}).decode())
                await pong(ws)
                assert gw.gateway.hub.stats()["subscriptions"] == 1
                assert ws.close_code is None


async def test_a_task_unsubscribed_by_its_id_goes_on_streaming_in_the_tag_that_lists_it(
    sqlite_url: str,
) -> None:
    """A page follows a tag and, on the same socket, one of its tasks by its id (a detail view, as
    gateway-client.js shares one socket): closing the view unsubscribes the task, which ends the task's own
    subscription, not the tag's stream of it. An unsubscribe of a task the tag streams leaves it streaming
    too: the tag follows every task it lists."""
    async with live_gateway(sqlite_url, api_key=API_KEY) as gw:
        made = {name: await create_task(gw, name, tags=[TAG], headers=key()) for name in ("t1", "t2")}
        token = await issue_tag_token(gw, TAG, headers=key())
        with anyio.fail_after(30):
            async with socket(ws_url(gw, "/v1/ws")) as ws:
                await ws.send(tag_subscribe(TAG, token))
                got = [await recv_frame(ws) for _ in range(3)]
                assert [(f["type"], f.get("taskId")) for f in got] == [
                    ("tag", None),
                    ("snapshot", "t2"),
                    ("snapshot", "t1"),
                ]
                detail = {"type": "subscribe", "taskId": "t1", "token": made["t1"].subscribe_token}
                await ws.send(orjson.dumps(detail).decode())
                assert (await recv_frame(ws))["type"] == "caught-up"
                for name in ("t1", "t2"):
                    await ws.send(orjson.dumps({"type": "unsubscribe", "taskId": name}).decode())
                await pong(ws)
                for name in ("t1", "t2"):
                    await post_event(gw, name, made[name].callback_token, {"type": "start", "worker": "w"})
                got = [await recv_frame(ws) for _ in range(2)]
                assert sorted((f["type"], f["taskId"], f["version"]) for f in got) == [
                    ("event", "t1", 1),
                    ("event", "t2", 1),
                ]
                await pong(ws)


async def test_a_subscribe_to_a_tag_of_200_tasks_makes_two_store_queries(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with live_gateway(database_url, retain_finished_s=0, reconcile_interval_ms=600_000) as gw:
        for i in range(200):
            await create_task(gw, f"t{i:03d}", tags=[TAG])
        queries: list[str] = []
        for cls in (sql.SqliteReadTx, pg_writer.PgTx):
            fetch = cls.fetch

            async def counted(self: Any, query: str, *args: Any, _fetch: Any = fetch, **kwargs: Any) -> Any:
                queries.append(query)
                return await _fetch(self, query, *args, **kwargs)

            monkeypatch.setattr(cls, "fetch", counted)
        cursors = {f"t{i:03d}": 0 for i in range(0, 200, 2)}
        watch = TagWatch(TAG, cursors)
        with anyio.fail_after(30):
            async with socket(ws_url(gw, "/v1/ws")) as ws:
                await ws.send(tag_subscribe(TAG, cursors=cursors))
                got = await frames(ws, watch, 201)
        assert len(got[0]["taskIds"]) == 200 and got[0]["more"] is False
        assert len(queries) == 2, queries  # the listing, and every resume state in one statement
        print(f"\nstore queries for a tag subscribe of 200 tasks: {len(queries)}")
