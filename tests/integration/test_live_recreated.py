"""A task id made again after retention deleted its task (protocol.md, Resuming: the epoch), against a real
server over SQLite and PostgreSQL: the new task is another history under the same id, and no subscriber is
left on the old one's state. A live tag subscriber is told of it (``added``, its ``snapshot``, its events)
however well it knew the old one (across processes: test_scale_out_tags.py); a cursor of the old task
(version and epoch) gets a ``snapshot`` with ``reason: "recreated"`` on every channel: the task socket,
``/v1/ws``, SSE's ``Last-Event-ID``, the HTTP resume and a tag's cursors map; the Python clients replace
what they held. A bare version (a client that sends no epoch) is taken as a version of the task the id
names now, as before epochs.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import anyio
import orjson
import pytest

from gateway.client import watch, watch_tag
from gateway.jobs.retention import Retention
from tests.integration.test_live_support import (
    STEP_S,
    get_task,
    live_gateway,
    recv_frame,
    socket,
    sse_frames,
    tag_subscribe,
    ws_url,
)
from tests.support import (
    Created,
    Running,
    create_task,
    drain_all,
    error,
    eventually,
    post_callback,
    wait_until,
)

pytestmark = pytest.mark.anyio

TAG = "re:X"
TASK = "job-X"
START: dict[str, Any] = {"type": "start", "worker": "w1"}
DONE: dict[str, Any] = {"type": "succeed", "resultRef": "s3://x", "resultHash": "sha256:x"}
PROGRESS_40: dict[str, Any] = {"type": "progress", "progress": 40, "cursor": "row-40"}


async def run_to_success(gw: Running, made: Created) -> None:
    """Start (v1) and succeed (v2) the task."""
    await post_callback(gw, TASK, made.callback_token, START, callback_id="old-start")
    await post_callback(gw, TASK, made.callback_token, DONE, callback_id="old-done", attempt=1)


async def recreate_and_report_40(gw: Running) -> dict[str, Any]:
    """``POST /v1/tasks`` with the freed id (201), started (v1) and at progress 40 (v2): the store's
    ``running v2``, as the old task's last state was ``succeeded v2``. Returns the new task."""
    made = await create_task(gw, TASK, tags=[TAG])
    await post_callback(gw, TASK, made.callback_token, START, callback_id="new-start")
    await post_callback(gw, TASK, made.callback_token, PROGRESS_40, callback_id="new-p40", attempt=1)
    task = await get_task(gw, TASK)
    assert (task["state"], task["version"], task.get("epoch")) == ("running", 2, made.task.get("epoch"))
    return task


async def test_a_live_tag_subscriber_is_told_of_a_task_made_again_under_a_deleted_ones_id(
    database_url: str,
) -> None:
    """The issue's scenario: the subscriber followed the old ``job-X`` to ``succeeded v2``; retention
    deletes it (``GATEWAY_RETAIN_FINISHED_S=1``); the new one is announced and streamed to it, and it ends
    holding the store's ``running v2``."""
    async with live_gateway(database_url, retain_finished_s=1) as gw:
        with anyio.fail_after(60):
            async with socket(ws_url(gw, "/v1/ws")) as ws:
                await ws.send(tag_subscribe(TAG))
                assert (await recv_frame(ws))["taskIds"] == []
                old = await create_task(gw, TASK, tags=[TAG])
                assert await recv_frame(ws) == {"type": "added", "tag": TAG, "taskId": TASK}
                assert (await recv_frame(ws))["reason"] == "new"
                await run_to_success(gw, old)
                last = [await recv_frame(ws) for _ in range(2)][-1]
                assert (last["type"], last["version"], last["task"]["state"]) == ("event", 2, "succeeded")
                assert [n["taskId"] for n in await drain_all(gw, 1)] == [TASK]
                gone = await eventually(
                    lambda: gw.client.get(f"/v1/tasks/{TASK}"), lambda a: a.status_code == 404, "deleted"
                )
                error(gone, 404, "unknown-task")

                stored = await recreate_and_report_40(gw)
                got = [await recv_frame(ws) for _ in range(2)]
                assert got[0] == {"type": "added", "tag": TAG, "taskId": TASK}
                assert (got[1]["type"], got[1]["reason"]) == ("snapshot", "new")
                held = got[1]["task"]
                assert held["epoch"] == stored["epoch"] != old.task["epoch"]
                while held["version"] < 2:
                    frame = await recv_frame(ws)
                    assert frame["type"] == "event" and frame["version"] == held["version"] + 1, frame
                    held = frame["task"]
        assert held == stored


# --- a cursor of the deleted task, on each channel ----------------------------------------------------------


async def made_again(gw: Running, *, run_first: bool = True) -> dict[str, Any]:
    """``job-X`` run to ``succeeded v2`` (unless it has ended already: ``run_first`` False), its notification
    drained, deleted by a pass of retention, and its id made again and run to ``running v2``: the new task."""
    if run_first:
        await run_to_success(gw, await create_task(gw, TASK, tags=[TAG]))
    await drain_all(gw, 1)
    retention = Retention(gw.gateway.store, lambda: 10**15, 1, relay=False)
    assert await retention.sweep() == 1
    return await recreate_and_report_40(gw)


Recreated = tuple[Running, str, dict[str, Any]]


@pytest.fixture
async def recreated(database_url: str) -> AsyncGenerator[Recreated]:
    """A gateway where ``job-X`` ran to success and was made again (:func:`made_again`): the gateway, the
    epoch of the task that had the id first, and the new task."""
    async with live_gateway(database_url) as gw:
        old = await create_task(gw, TASK, tags=[TAG])
        await run_to_success(gw, old)
        yield gw, old.task["epoch"], await made_again(gw, run_first=False)


def at(epoch: str, version: int = 2) -> str:
    return f"{version}:{epoch}"


async def test_the_task_socket_answers_a_cursor_of_the_deleted_task_with_a_snapshot(
    recreated: Recreated,
) -> None:
    gw, old, new = recreated
    async with socket(ws_url(gw, f"/v1/tasks/{TASK}/ws", cursor=at(old))) as ws:
        frame = await recv_frame(ws)
        assert (frame["type"], frame["reason"], frame["version"]) == ("snapshot", "recreated", 2)
        assert frame["task"] == new
        await post_callback(gw, TASK, await token(gw), {**PROGRESS_40, "progress": 50}, attempt=1)
        frame = await recv_frame(ws)
        assert (frame["type"], frame["version"], frame["task"]["epoch"]) == ("event", 3, new["epoch"])
    # Its own epoch resumes by version; a bare version is taken as one of the task the id names now.
    for cursor in (at(new["epoch"], 3), "3"):
        async with socket(ws_url(gw, f"/v1/tasks/{TASK}/ws", cursor=cursor)) as ws:
            assert (await recv_frame(ws))["type"] == "caught-up"


async def token(gw: Running) -> str:
    """A callback token of ``job-X`` (the create again, same parameters: 200, fresh tokens)."""
    return (await create_task(gw, TASK, tags=[TAG], expect=200)).callback_token


async def test_a_subscribe_on_v1_ws_with_a_cursor_of_the_deleted_task_gets_a_snapshot(
    recreated: Recreated,
) -> None:
    gw, old, new = recreated
    async with socket(ws_url(gw, "/v1/ws")) as ws:
        answers = []
        for cursor in (at(old), at(new["epoch"]), 2, "1:" + new["epoch"], "2:", -1):
            await ws.send(orjson.dumps({"type": "subscribe", "taskId": TASK, "cursor": cursor}).decode())
            frame = await recv_frame(ws)
            answers.append((frame["type"], frame.get("reason") or frame.get("code")))
        assert answers == [
            ("snapshot", "recreated"),
            ("caught-up", None),
            ("caught-up", None),
            ("delta", None),
            ("error", "invalid-request"),
            ("error", "invalid-request"),
        ]


async def test_an_sse_stream_resumed_with_a_last_event_id_of_the_deleted_task_starts_with_a_snapshot(
    recreated: Recreated,
) -> None:
    gw, old, new = recreated
    headers = {"Last-Event-ID": at(old)}
    with anyio.fail_after(STEP_S):
        async with gw.client.stream("GET", f"/v1/tasks/{TASK}/stream", headers=headers) as response:
            assert response.status_code == 200
            name, ident, data = await anext(sse_frames(response))
    assert (name, data["reason"], data["task"]) == ("snapshot", "recreated", new)
    assert ident == at(new["epoch"])  # what the EventSource sends back if it reconnects


async def test_the_http_resume_answers_a_cursor_of_the_deleted_task_with_a_snapshot(
    recreated: Recreated,
) -> None:
    gw, old, new = recreated
    answers = []
    for cursor in (at(old), at(old, 0), at(new["epoch"]), at(new["epoch"], 1), "2"):
        answer = await gw.client.get(f"/v1/tasks/{TASK}/events", params={"cursor": cursor})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["task"] == new
        answers.append((body["mode"], body.get("reason"), len(body["events"])))
    assert answers == [
        ("snapshot", "recreated", 0),
        ("snapshot", "recreated", 0),
        ("caught-up", None, 0),
        ("delta", None, 1),
        ("caught-up", None, 0),  # a bare version: of the task the id names now
    ]
    for bad in ("2:", "2:no such", ":ab12", "2.5:ab12"):
        answer = await gw.client.get(f"/v1/tasks/{TASK}/events", params={"cursor": bad})
        assert "cursor: must be a version" in error(answer, 400, "invalid-request")


async def test_a_tags_cursors_map_with_a_cursor_of_the_deleted_task_gets_a_snapshot(
    recreated: Recreated,
) -> None:
    gw, old, new = recreated
    async with socket(ws_url(gw, "/v1/ws")) as ws:
        await ws.send(tag_subscribe(TAG, None, {TASK: at(old)}))
        assert (await recv_frame(ws))["taskIds"] == [TASK]
        frame = await recv_frame(ws)
        assert (frame["type"], frame["reason"], frame["task"]) == ("snapshot", "recreated", new)
        await ws.send(tag_subscribe(TAG, None, {TASK: at(new["epoch"], 1)}))
        assert (await recv_frame(ws))["taskIds"] == [TASK]
        assert (await recv_frame(ws))["type"] == "delta"
        await ws.send(tag_subscribe(TAG, None, {TASK: "2:"}))
        refused = await recv_frame(ws)
        assert (refused["code"], refused["tag"]) == ("invalid-request", TAG)
        assert refused["message"].startswith("cursors['job-X']: must be a version"), refused


# --- the Python clients -------------------------------------------------------------------------------------


async def test_the_python_clients_replace_a_task_made_again_while_they_follow_and_while_away(
    database_url: str,
) -> None:
    """``watch_tag`` keeps each task's epoch beside its version (the caller's maps, kept up to date): the id
    made again while it follows comes as ``added`` then the new task's snapshot, which replaces what it held;
    made again while it was away, a later run with the saved maps gets a ``recreated`` snapshot, and so does
    ``watch`` given the cursor and epoch of a task it saw."""
    async with live_gateway(database_url) as gw:
        cursors: dict[str, int] = {}
        epochs: dict[str, str] = {}
        handed: list[dict[str, Any]] = []

        async def follow() -> None:
            async for frame in watch_tag(gw.url, TAG, cursors=cursors, epochs=epochs, on_status=None):
                handed.append(frame)

        def holding(epoch: str, version: int) -> Callable[[], bool]:
            return lambda: (epochs.get(TASK), cursors.get(TASK)) == (epoch, version)

        def seen() -> list[tuple[Any, ...]]:
            """Each frame handed on (but the tag's listings) as (type, version, reason, epoch)."""
            got = [
                (f["type"], f.get("version"), f.get("reason"), f.get("task", {}).get("epoch")) for f in handed
            ]
            handed.clear()
            return [frame for frame in got if frame[0] != "tag"]

        with anyio.fail_after(STEP_S * 3):
            async with anyio.create_task_group() as tg:
                tg.start_soon(follow)
                await wait_until(lambda: bool(handed), "the tag's listing")
                old = await create_task(gw, TASK, tags=[TAG])
                first = old.task["epoch"]
                await wait_until(holding(first, 0), "following the first task")
                await run_to_success(gw, old)
                await wait_until(holding(first, 2), "the first task's end")
                second = (await made_again(gw, run_first=False))["epoch"]
                await wait_until(holding(second, 2), "the task made again, followed")
                tg.cancel_scope.cancel()
        assert seen() == [
            ("added", None, None, None),
            ("snapshot", 0, "new", first),
            ("event", 1, None, first),
            ("event", 2, None, first),
            ("added", None, None, None),
            ("snapshot", 0, "new", second),
            ("event", 1, None, second),
            ("event", 2, None, second),
        ]

        # Away: the task ends, is deleted, and its id made again.
        await post_callback(gw, TASK, await token(gw), DONE, callback_id="second-done", attempt=1)
        third = (await made_again(gw, run_first=False))["epoch"]
        with anyio.fail_after(STEP_S * 3):
            async with anyio.create_task_group() as tg:
                tg.start_soon(follow)
                await wait_until(holding(third, 2), "the task made again while away")
                tg.cancel_scope.cancel()
        assert seen() == [("snapshot", 2, "recreated", third)]
        frames = watch(gw.url, {TASK: None}, cursors={TASK: 2}, epochs={TASK: second}, on_status=None)
        assert isinstance(frames, AsyncGenerator)
        with anyio.fail_after(STEP_S):
            frame = await anext(frames)
        await frames.aclose()
        assert (frame["type"], frame["reason"], frame["task"]) == (
            "snapshot",
            "recreated",
            await get_task(gw, TASK),
        )
