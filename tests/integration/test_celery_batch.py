"""Celery's canvas on the gateway (issue 34), with a real prefork worker: a ``group`` of 20 jobs is one parent
task whose ``children`` counts equal its 20 children's states, each child with its own title and status
line, the parent's progress moved by its children and its end by the worker whose job ended the group,
followed live to those exact counts; ``update_state(state="PROGRESS", meta=...)`` moves a task's progress
and metadata; a ``chord``'s body is a child that ends its parent, and a group with a job that fails for
good ends its parent failed.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from celery import chord, group

from gateway.client import watch
from gateway.integrations.celery import uninstall
from gateway.machine import TERMINAL
from tests.jobs.celery_batch import COUNT, TITLE, child_title, publish_batch
from tests.jobs.celery_tasks import make_app
from tests.support import bearer, eventually, http_client, mint
from tests.support.celery_processes import (
    API_KEY,
    celery_worker,
    keyed_gateway,
    publishing_app,
    rabbitmq_broker,
    read_history,
    read_task,
    redis_broker,
)
from tests.support.processes import SECRET

# Every job of a scenario at its end (a loaded machine included).
SCENARIO_S = 120.0
STATES = ("queued", "running", "succeeded", "failed", "expired")


def counted(tasks: list[dict[str, Any]]) -> dict[str, int]:
    """The ``children`` counts the states of ``tasks`` make (a cancelled child is ``failed``)."""
    states = Counter(task["state"] for task in tasks)
    return {"total": len(tasks), **{state: states.get(state, 0) for state in STATES}}


async def ended(client: httpx.AsyncClient, task_id: str) -> dict[str, Any]:
    task: dict[str, Any] = await eventually(
        lambda: read_task(client, task_id),
        lambda task: task["state"] in TERMINAL,
        f"task {task_id} at its end",
        SCENARIO_S,
        poll_s=0.2,
    )
    return task


async def followed(base_url: str, task_id: str, seen: list[dict[str, Any]]) -> None:
    """Every frame of the task until its end, from version 0 (its subscribe token), into ``seen``."""
    async for frame in watch(base_url, {task_id: mint(task_id, secret=SECRET)}, on_status=None):
        seen.append(frame)


def last_counts(frames: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The children counts a client that applied ``frames`` in order holds (the newest revision wins)."""
    held: tuple[int, dict[str, Any]] | None = None
    for frame in frames:
        carrier = frame if frame["type"] == "children" else frame.get("task", {})
        children, revision = carrier.get("children"), carrier.get("revision")
        if isinstance(children, dict) and isinstance(revision, int) and (held is None or revision >= held[0]):
            held = (revision, children)
    return None if held is None else held[1]


@pytest.mark.anyio
async def test_a_celery_group_is_one_parent_whose_counts_are_its_childrens_states(tmp_path: Path) -> None:
    tag = f"batch:{uuid.uuid4().hex[:12]}"
    shared = tmp_path / "shared"
    shared.mkdir()
    with rabbitmq_broker() as broker:
        async with (
            keyed_gateway(tmp_path) as gw,
            http_client(base_url=gw.url, headers=bearer(API_KEY), timeout=30) as client,
        ):
            app = publishing_app(broker, gw.url, shared)
            try:
                parent_id, child_ids = await anyio.to_thread.run_sync(
                    lambda: publish_batch(app, pause_s=0.05, tags=(tag,))
                )
                sheets_id = str(
                    (await anyio.to_thread.run_sync(lambda: app.signature("tg.sheets").apply_async((4,)))).id
                )
                parent = await read_task(client, parent_id)
                assert (parent["title"], parent["state"], parent["tags"]) == (TITLE, "running", [tag])
                assert parent["progressFromChildren"] is True
                assert parent["children"] == {**counted([]), "total": COUNT, "queued": COUNT}
                frames: list[dict[str, Any]] = []
                async with anyio.create_task_group() as tg:
                    tg.start_soon(followed, gw.url, parent_id, frames)
                    async with celery_worker(broker, gw.url, shared):
                        parent = await ended(client, parent_id)
                        sheets = await ended(client, sheets_id)
            finally:
                uninstall(app)
                app.close()

            children = [await read_task(client, child_id) for child_id in child_ids]
            assert parent["state"] == "succeeded", parent
            assert parent["children"] == counted(children) == {**counted([]), "total": 20, "succeeded": 20}
            for index, child in enumerate(children):
                assert child["parent"] == parent_id and child["title"] == child_title(index), child
                assert child["metadata"] == {"message": f"Item {index}: step 5 of 5"}, child
                assert child["state"] == "succeeded" and child["progress"] == 100, child
            listed = (await client.get("/v1/tasks", params={"parent": parent_id, "limit": 100})).json()
            assert sorted(task["id"] for task in listed["tasks"]) == sorted(child_ids)
            # The parent's progress, the gateway's as its children ended (rising to 100), then its end, as
            # its subscriber saw them (the history keeps fewer entries than the parent has).
            events = [frame["event"] for frame in frames if frame["type"] == "event"]
            assert events[-1]["type"] == "succeed" and parent["progress"] == 100
            values = [e["progress"] for e in events if e["type"] == "progress"]
            assert values == sorted(set(values)) and values[-1] == 100, events
            assert {e["cursor"] for e in events if e["type"] == "progress"} >= {"children:20/20"}
            # Its subscriber ends on the exact counts, and saw them move.
            assert frames[-1]["task"]["state"] == "succeeded"
            assert last_counts(frames) == parent["children"]
            assert any(frame["type"] == "children" for frame in frames)
            # Celery's update_state: progress current * 100 / total, the meta merged into the metadata.
            assert sheets["state"] == "succeeded" and sheets["title"] == "sheets(4)", sheets
            assert sheets["metadata"] == {"current": 4, "total": 4, "message": "Sheet 4 of 4"}, sheets
            sheet_events = [entry["event"] for entry in (await read_history(client, sheets_id))["events"]]
            progress = [e["progress"] for e in sheet_events if e["type"] == "progress"]
            assert progress == sorted(set(progress)) and progress[-1] == 100, sheet_events


@pytest.mark.anyio
async def test_a_chords_body_ends_its_parent_and_a_failed_job_fails_its_group(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    with redis_broker() as broker:
        async with (
            keyed_gateway(tmp_path) as gw,
            http_client(base_url=gw.url, headers=bearer(API_KEY), timeout=30) as client,
        ):
            # A chord needs a result backend where it is published: the workers' Redis.
            app = make_app(
                broker=broker.url,
                backend=broker.backend,
                queue=broker.queue,
                prefix=broker.prefix,
                gateway=gw.url,
                api_key=API_KEY,
                shared=shared,
            )
            try:
                header = [app.signature("tg.batch_item", args=(index, 2)) for index in range(3)]
                made = await anyio.to_thread.run_sync(lambda: chord(header)(app.signature("tg.merge")))
                body_id, chord_id = str(made.id), str(made.parent.id)
                jobs = [app.signature("tg.batch_item", args=(0, 2)), app.signature("tg.broken", args=(1,))]
                failing = await anyio.to_thread.run_sync(lambda: group(jobs).apply_async())
                failing_id = str(failing.id)
                async with celery_worker(broker, gw.url, shared):
                    chorded = await ended(client, chord_id)
                    failed = await ended(client, failing_id)
            finally:
                uninstall(app)
                app.close()

            body = await read_task(client, body_id)
            assert (body["parent"], body["state"], body["resultRef"]) == (
                chord_id,
                "succeeded",
                "s3://merged/3",
            )
            assert chorded["title"] == "batch_item: 3 jobs, then merge", chorded
            assert (chorded["state"], chorded["resultRef"]) == ("succeeded", "s3://merged/3"), chorded
            assert chorded["children"] == {**counted([]), "total": 4, "succeeded": 4}, chorded
            assert failed["title"] == "batch_item, broken: 2 jobs", failed
            assert failed["state"] == "failed" and failed["error"] == "1 of 2 jobs did not succeed", failed
            assert failed["children"] == {**counted([]), "total": 2, "succeeded": 1, "failed": 1}, failed
