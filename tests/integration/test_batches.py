"""Titles, live metadata and batches through a real server and real clients (issue 34; protocol.md, Shapes,
Metadata and Batches), on SQLite and PostgreSQL: a create's new fields and their refusals, metadata patches
by a worker (fenced, rate-limited, renewing its lease) and by a backend, ``metadata`` frames on the
single-task socket, ``/v1/ws`` and SSE, resume frames with the current metadata, a parent's ``children``
counts and frames, its children listed, a title found."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import orjson
import pytest

from tests.integration.test_live_support import live_gateway, recv_frame, socket, sse_frames, ws_url
from tests.support import STEP_S, Running, bearer, error, post_callback

pytestmark = pytest.mark.anyio

API_KEY = "batches-api-key-0123456789"
KEY = bearer(API_KEY)
START = {"type": "start", "worker": "w1"}
SUCCEED = {"type": "succeed", "resultRef": "s3://r", "resultHash": "sha256:1"}


async def create(gw: Running, task_id: str, expect: int = 201, **fields: Any) -> dict[str, Any]:
    answer = await gw.client.post("/v1/tasks", json={"id": task_id, "ttlMs": 600_000, **fields}, headers=KEY)
    assert answer.status_code == expect, answer.text
    return dict(answer.json())


async def patch(
    gw: Running, task_id: str, body: Any, headers: dict[str, str], expect: int = 200
) -> httpx.Response:
    answer = await gw.client.post(f"/v1/tasks/{task_id}/metadata", json=body, headers=headers)
    assert answer.status_code == expect, answer.text
    return answer


async def task_of(gw: Running, task_id: str) -> dict[str, Any]:
    answer = await gw.client.get(f"/v1/tasks/{task_id}", headers=KEY)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


async def test_a_create_takes_a_title_metadata_and_a_parent_and_refuses_them_clearly(
    database_url: str,
) -> None:
    async with live_gateway(database_url, api_key=API_KEY) as gw:
        made = (await create(gw, "export", title="Monthly sales export", metadata={"customer": "ACME"}))[
            "task"
        ]
        assert (made["title"], made["metadata"], made["revision"]) == (
            "Monthly sales export",
            {"customer": "ACME"},
            0,
        )
        assert "parent" not in made and "children" not in made
        for body, field in (
            ({"title": ""}, "title"),
            ({"title": " \t"}, "title"),
            ({"title": "x" * 201}, "title"),
            ({"title": "two\nlines"}, "title"),
            ({"title": 7}, "title"),
            ({"metadata": [1]}, "metadata"),
            ({"metadata": "text"}, "metadata"),
            ({"progressFromChildren": "yes"}, "progressFromChildren"),
            ({"parent": 3}, "parent"),
        ):
            answer = await gw.client.post("/v1/tasks", json={"id": "bad", "ttlMs": 1000, **body}, headers=KEY)
            assert error(answer, 400, "invalid-request").startswith(field), (body, answer.text)
        big = {"k": "x" * 8200}
        answer = await gw.client.post(
            "/v1/tasks", json={"id": "big", "ttlMs": 1000, "metadata": big}, headers=KEY
        )
        error(answer, 413, "metadata-too-large")
        answer = await gw.client.post(
            "/v1/tasks", json={"id": "c", "ttlMs": 1000, "parent": "nobody"}, headers=KEY
        )
        error(answer, 404, "unknown-task")
        assert (await gw.client.get("/v1/tasks/c", headers=KEY)).status_code == 404  # nothing made
        # A retried create: its title, parent and progressFromChildren count, its metadata is not compared.
        again = await create(gw, "export", 200, title="Monthly sales export", metadata={"other": 1})
        assert again["task"]["metadata"] == {"customer": "ACME"}
        answer = await gw.client.post(
            "/v1/tasks", json={"id": "export", "ttlMs": 600_000, "title": "Weekly"}, headers=KEY
        )
        error(answer, 409, "task-exists")
        ended = await create(gw, "ended")
        await gw.client.post("/v1/tasks/ended/cancel", headers=KEY)
        answer = await gw.client.post(
            "/v1/tasks", json={"id": "c", "ttlMs": 1000, "parent": "ended"}, headers=KEY
        )
        error(answer, 409, "parent-ended")
        assert answer.json()["task"]["id"] == "ended" and ended


async def test_a_workers_patch_is_fenced_and_a_backends_reaches_any_task(database_url: str) -> None:
    async with live_gateway(database_url, api_key=API_KEY) as gw:
        made = await create(gw, "t", metadata={"a": {"b": 1}, "keep": True}, heartbeatMs=60_000)
        worker = bearer(made["callbackToken"])
        # Not running yet: the worker's attempt is not one.
        error(await patch(gw, "t", {"attempt": 0, "patch": {}}, worker, 409), 409, "not-running")
        await post_callback(gw, "t", made["callbackToken"], START)
        error(await patch(gw, "t", {"patch": {"x": 1}}, worker, 400), 400, "invalid-request")
        error(await patch(gw, "t", {"attempt": 2, "patch": {"x": 1}}, worker, 409), 409, "stale-attempt")
        answer = await patch(
            gw, "t", {"attempt": 1, "patch": {"a": {"b": None, "c": 2}, "message": "page 3"}}, worker
        )
        task = answer.json()["task"]
        assert task["metadata"] == {"a": {"c": 2}, "keep": True, "message": "page 3"}
        assert (task["revision"], task["version"]) == (1, 1)  # beside the history: no entry
        # A patch that changes nothing: 200, no revision.
        same = await patch(gw, "t", {"attempt": 1, "patch": {"message": "page 3"}}, worker)
        assert same.json()["task"]["revision"] == 1
        for body in ({"attempt": 1, "patch": [1]}, {"attempt": 1}, {"attempt": 1, "patch": {}, "x": 1}):
            error(await patch(gw, "t", body, worker, 400), 400, "invalid-request")
        error(
            await patch(gw, "t", {"attempt": 1, "patch": {"k": "x" * 8200}}, worker, 413),
            413,
            "metadata-too-large",
        )
        other = await create(gw, "other")
        error(
            await patch(gw, "t", {"attempt": 1, "patch": {}}, bearer(other["callbackToken"]), 403),
            403,
            "forbidden",
        )
        error(
            await patch(gw, "t", {"attempt": 1, "patch": {}}, bearer(made["subscribeToken"]), 403),
            403,
            "forbidden",
        )
        error(await patch(gw, "nope", {"patch": {}}, KEY, 404), 404, "unknown-task")
        await post_callback(gw, "t", made["callbackToken"], SUCCEED)
        error(await patch(gw, "t", {"attempt": 1, "patch": {"late": 1}}, worker, 409), 409, "not-running")
        # The backend's: on an ended task too, fenced only when it gives an attempt.
        done = await patch(gw, "t", {"patch": {"message": "Exported 12 pages"}}, KEY)
        assert done.json()["task"]["metadata"]["message"] == "Exported 12 pages"
        error(await patch(gw, "t", {"attempt": 0, "patch": {}}, KEY, 409), 409, "stale-attempt")
        history = await gw.client.get("/v1/tasks/t/events", params={"cursor": 0}, headers=KEY)
        assert [e["event"]["type"] for e in history.json()["events"]] == ["start", "succeed"]


async def test_metadata_frames_reach_every_channel_and_resume_frames_carry_it(database_url: str) -> None:
    async with live_gateway(database_url, api_key=API_KEY) as gw:
        made = await create(gw, "t", tags=["owner:u1"])
        token = made["subscribeToken"]
        await post_callback(gw, "t", made["callbackToken"], START)
        async with (
            socket(ws_url(gw, "/v1/tasks/t/ws", cursor=1, token=token)) as single,
            socket(ws_url(gw, "/v1/ws")) as multi,
            gw.client.stream("GET", "/v1/tasks/t/stream", params={"cursor": 1}, headers=KEY) as sse,
        ):
            await multi.send(orjson.dumps({"type": "subscribe", "taskId": "t", "cursor": 1, "token": token}))
            events = sse_frames(sse)
            for ws in (single, multi):
                assert (await recv_frame(ws))["type"] == "caught-up"
            with anyio.fail_after(STEP_S):
                assert (await anext(events))[0] == "caught-up"
            for n in range(1, 4):
                await patch(gw, "t", {"patch": {"message": f"page {n} of 3"}}, KEY)
            expected = {
                "type": "metadata",
                "taskId": "t",
                "revision": 3,
                "metadata": {"message": "page 3 of 3"},
            }
            for ws in (single, multi):
                frame = await recv_frame(ws)
                while frame["revision"] < 3:  # merged or not: none older than the last, and the last comes
                    assert frame["type"] == "metadata"
                    frame = await recv_frame(ws)
                assert frame == expected
            with anyio.fail_after(STEP_S):
                name, ident, data = await anext(events)
                while data["revision"] < 3:
                    name, ident, data = await anext(events)
            assert (name, ident, data) == ("metadata", "1:" + made["task"]["epoch"], expected)
        async with socket(ws_url(gw, "/v1/tasks/t/ws", cursor=0, token=token)) as late:
            resumed = await recv_frame(late)
            assert (
                resumed["task"]["metadata"] == {"message": "page 3 of 3"} and resumed["task"]["revision"] == 3
            )


async def test_a_parent_counts_its_children_pushes_them_and_lists_them(database_url: str) -> None:
    async with live_gateway(database_url, api_key=API_KEY) as gw:
        parent = await create(gw, "p", title="Import of 3 files", progressFromChildren=True)
        await post_callback(gw, "p", parent["callbackToken"], START)
        async with socket(ws_url(gw, "/v1/tasks/p/ws", cursor=1, token=parent["subscribeToken"])) as ws:
            assert (await recv_frame(ws))["type"] == "caught-up"
            children = [await create(gw, f"c{n}", parent="p", title=f"file_{n}.csv") for n in range(3)]
            assert children[0]["task"]["parent"] == "p"
            await post_callback(gw, "c0", children[0]["callbackToken"], START)
            await post_callback(gw, "c0", children[0]["callbackToken"], SUCCEED)
            await gw.client.post("/v1/tasks/c1/cancel", headers=KEY)
            want = {"total": 3, "queued": 1, "running": 0, "succeeded": 1, "failed": 1, "expired": 0}
            progress: list[int] = []
            counts: dict[str, int] = {}
            with anyio.fail_after(STEP_S):
                while counts != want or not progress or progress[-1] < 66:  # in no order with each other
                    frame = await recv_frame(ws)
                    if frame["type"] == "event":
                        progress.append(frame["event"]["progress"])
                        assert frame["event"]["cursor"] == f"children:{round(progress[-1] * 3 / 100)}/3"
                    elif frame["type"] == "children":
                        counts = frame["children"]
            assert progress == [33, 66]  # only upward, as each child ended
        stored = await task_of(gw, "p")
        assert (stored["children"], stored["progress"], stored["version"]) == (want, 66, 3)
        listed = await gw.client.get("/v1/tasks", params={"parent": "p"}, headers=KEY)
        assert [t["id"] for t in listed.json()["tasks"]] == ["c2", "c1", "c0"]
        page = await gw.client.get(
            "/v1/tasks", params={"parent": "p", "limit": 2, "state": "queued"}, headers=KEY
        )
        assert [t["id"] for t in page.json()["tasks"]] == ["c2"]
        found = await gw.client.get("/v1/tasks", params={"title": "FILE_1"}, headers=KEY)
        assert [t["id"] for t in found.json()["tasks"]] == ["c1"]
        c0 = await task_of(gw, "c0")
        assert (c0["worker"], c0["startedAtMs"] <= c0["endedAtMs"]) == ("w1", True)


async def test_one_subscription_with_the_parents_token_follows_the_whole_batch(database_url: str) -> None:
    async with live_gateway(database_url, api_key=API_KEY) as gw:
        parent = await create(gw, "p", title="Report of 2 sections")
        first = await create(gw, "c1", parent="p")
        other = await create(gw, "other")
        async with socket(ws_url(gw, "/v1/ws")) as ws:
            refused = {"type": "subscribe", "parent": "p", "token": other["subscribeToken"]}
            await ws.send(orjson.dumps(refused))
            frame = await recv_frame(ws)
            assert (frame["type"], frame["code"], frame["parent"]) == ("error", "forbidden", "p")
            await ws.send(
                orjson.dumps({"type": "subscribe", "parent": "p", "token": parent["subscribeToken"]})
            )
            assert await recv_frame(ws) == {
                "type": "batch",
                "parent": "p",
                "taskIds": ["p", "c1"],
                "more": False,
            }
            resumed = [await recv_frame(ws) for _ in range(2)]
            assert [(f["type"], f["reason"], f["taskId"]) for f in resumed] == [
                ("snapshot", "new", "p"),
                ("snapshot", "new", "c1"),
            ]
            assert resumed[0]["task"]["children"]["total"] == 1
            second = await create(gw, "c2", parent="p", title="Section 2")
            await post_callback(gw, "c1", first["callbackToken"], START)
            await patch(
                gw,
                "c1",
                {"attempt": 1, "patch": {"message": "Rendering page 3 of 12"}},
                bearer(first["callbackToken"]),
            )
            seen: dict[str, list[dict[str, Any]]] = {}
            with anyio.fail_after(STEP_S):
                while not (
                    any(f["type"] == "metadata" for f in seen.get("c1", ()))
                    and any(
                        f["type"] == "children" and f["children"]["running"] == 1 for f in seen.get("p", ())
                    )
                    and any(f["type"] == "snapshot" for f in seen.get("c2", ()))
                ):
                    frame = await recv_frame(ws)
                    seen.setdefault(frame.get("taskId", ""), []).append(frame)
            assert seen["c2"][0] == {"type": "added", "parent": "p", "taskId": "c2"}
            assert seen["c2"][1]["task"]["title"] == "Section 2" and second
            assert [f["type"] for f in seen["c1"]] == ["event", "metadata"]
            await ws.send(orjson.dumps({"type": "unsubscribe", "parent": "p"}))
            await ws.send(orjson.dumps({"type": "ping"}))
            while (frame := await recv_frame(ws))["type"] != "pong":
                assert frame["type"] in ("children", "metadata", "event"), (
                    frame
                )  # sent before the unsubscribe
