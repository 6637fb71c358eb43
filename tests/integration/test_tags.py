"""Tags over HTTP (docs/protocol.md, Create and List), on a real server over SQLite and PostgreSQL: a task
is created with its tags (sorted) and the gateway's clock as ``createdAtMs``, both fixed for its life; a
repeated create must name the same tags; ``GET /v1/tasks?tag=`` lists a tag's tasks newest first, a page
at a time, every tag given matching, with ``state=``; bad tags are a 400 that says what a tag is; a page
by tag is one range of the tag index; retention deletes a task's tags with it.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import asyncpg  # type: ignore[import-untyped]
import httpx
import pytest
from sqlalchemy import text

from gateway.store import Database
from gateway.store import queries as q
from gateway.store.sql import SqlStore
from gateway.web.tags import MAX_TAGS
from tests.support import (
    FakeClock,
    Running,
    bearer,
    error,
    eventually,
    opened,
    post_callback,
    running_gateway,
)

pytestmark = pytest.mark.anyio

API_KEY = "tags-api-key"
KEY = bearer(API_KEY)
TTL = 600_000
OWNER, PROJECT = "owner:u42", "project:7"


async def create(gw: Running, task_id: str, tags: Any = None, **extra: Any) -> httpx.Response:
    """``POST /v1/tasks`` with these tags (``None``: the body names none), as the API key."""
    body: dict[str, Any] = {"id": task_id, "ttlMs": TTL, "maxAttempts": 2, **extra}
    if tags is not None:
        body["tags"] = tags
    return await gw.client.post("/v1/tasks", json=body, headers=KEY)


async def test_a_task_keeps_the_tags_and_creation_time_it_was_made_with(database_url: str) -> None:
    clock = FakeClock()
    async with running_gateway(database_url, clock=clock, api_key=API_KEY, sweep_interval_ms=0) as gw:
        made_at = clock.now
        answer = await create(gw, "t1", [PROJECT, OWNER])
        assert answer.status_code == 201, answer.text
        task = answer.json()["task"]
        assert (task["tags"], task["createdAtMs"]) == ([OWNER, PROJECT], made_at)  # sorted
        assert (await gw.client.get("/v1/tasks/t1", headers=KEY)).json() == task

        # Later, the same create (tags in another order): the task as it was made, its creation time too.
        clock.advance(5_000)
        again = await create(gw, "t1", [OWNER, PROJECT])
        assert again.status_code == 200, again.text
        assert again.json()["task"] == task
        # Other tags, fewer, more, or none: another task's parameters.
        for other in ([OWNER, "project:8"], [OWNER], [OWNER, PROJECT, "team:x"], [], None):
            message = error(await create(gw, "t1", other), 409, "task-exists")
            assert f'tags ["{OWNER}","{PROJECT}"]' in message, message

        # A task made without tags has none, and its own creation time.
        plain = await create(gw, "t2")
        assert plain.status_code == 201, plain.text
        assert (plain.json()["task"]["tags"], plain.json()["task"]["createdAtMs"]) == ([], clock.now)
        assert (await create(gw, "t2", [])).status_code == 200

        # No transition changes them: every answer and read carries them as they were made.
        token = answer.json()["callbackToken"]
        started = await post_callback(gw, "t1", token, {"type": "start", "worker": "w1"})
        done = {"type": "succeed", "resultRef": "s3://r", "resultHash": "sha256:1"}
        succeeded = await post_callback(gw, "t1", token, done, attempt=1)
        for body in (started, succeeded):
            assert (body["task"]["tags"], body["task"]["createdAtMs"]) == ([OWNER, PROJECT], made_at)
        events = await gw.client.get("/v1/tasks/t1/events", params={"cursor": 0}, headers=KEY)
        assert (events.json()["task"]["tags"], events.json()["task"]["createdAtMs"]) == (
            [OWNER, PROJECT],
            made_at,
        )


async def test_tags_that_break_the_rule_are_a_400_that_says_why(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, api_key=API_KEY, sweep_interval_ms=0) as gw:
        cases: list[tuple[Any, str]] = [
            ([OWNER, PROJECT, OWNER], f"tags: '{OWNER}' is given more than once (each tag once)"),
            ([f"t{n}" for n in range(MAX_TAGS + 1)], f"tags: at most {MAX_TAGS} tags per task, got 17"),
            (
                ["a b"],
                "tags: 'a b' is not a tag: a tag is 1 to 128 characters of A-Z, a-z, 0-9 and : . _ @ -",
            ),
            ([""], "tags: '' is not a tag"),
            (["x" * 129], "tags: 'xxxxxxxxxx"),
            (["café"], "tags: 'café' is not a tag"),
            (["a/b"], "tags: 'a/b' is not a tag"),
            ([7], "tags: a tag must be a string"),
            (OWNER, "tags: must be an array of tags"),
            ({"tag": OWNER}, "tags: must be an array of tags"),
        ]
        for tags, expected in cases:
            message = error(await create(gw, "t", tags), 400, "invalid-request")
            assert message.startswith(expected), (tags, message)
        body = {"id": "t", "ttlMs": TTL, "maxAttempts": 2, "tags": None}  # null is not "none"
        error(await gw.client.post("/v1/tasks", json=body, headers=KEY), 400, "invalid-request")
        error(await gw.client.get("/v1/tasks/t", headers=KEY), 404, "unknown-task")  # nothing was made
        # The limits themselves are taken.
        widest = sorted([f"t-{n:02d}" for n in range(MAX_TAGS - 1)] + ["A" * 128])
        answer = await create(gw, "t", ["A" * 128, *reversed(widest[1:])])
        assert answer.status_code == 201, answer.text
        assert answer.json()["task"]["tags"] == widest
        assert (await create(gw, "u", ["Az09:._@-"])).status_code == 201


async def pages(gw: Running, query: list[tuple[str, Any]], limit: int) -> list[list[str]]:
    """Every page of ``GET /v1/tasks`` with this query (``tag`` may repeat), following nextCursor; the ids."""
    found: list[list[str]] = []
    cursor = None
    for _ in range(50):
        params = [*query, ("limit", limit)] + ([] if cursor is None else [("cursor", cursor)])
        answer = await gw.client.get("/v1/tasks", params=params, headers=KEY)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert set(body) == {"tasks", "nextCursor"}, body
        found.append([t["id"] for t in body["tasks"]])
        cursor = body["nextCursor"]
        if cursor is None:
            return found
    raise AssertionError("the list never ended")


async def test_the_list_by_tag_is_newest_first_a_page_at_a_time_every_tag_matching(database_url: str) -> None:
    clock = FakeClock()
    start = clock.now
    async with running_gateway(database_url, clock=clock, api_key=API_KEY, sweep_interval_ms=0) as gw:
        # Made at these times (ms after start): the id order is not the time order; a and d at one time.
        made: dict[str, Any] = {}
        for task_id, at, tags in [
            ("e", 0, [OWNER]),
            ("a", 10, [OWNER, PROJECT]),
            ("d", 10, [OWNER]),
            ("c", 20, [PROJECT]),
            ("b", 30, [PROJECT, OWNER]),
            ("f", 40, []),
        ]:
            clock.now = start + at
            answer = await create(gw, task_id, tags)
            assert answer.status_code == 201, answer.text
            made[task_id] = answer.json()
        await post_callback(gw, "a", made["a"]["callbackToken"], {"type": "start", "worker": "w1"})

        # Newest first (createdAtMs, then id, descending), each once, whatever the page size.
        assert await pages(gw, [("tag", OWNER)], 2) == [["b", "d"], ["a", "e"]]
        assert await pages(gw, [("tag", OWNER)], 50) == [["b", "d", "a", "e"]]
        assert await pages(gw, [("tag", PROJECT)], 1) == [["b"], ["c"], ["a"]]
        # Every tag given must match; the order of the tags, or one given twice, changes nothing.
        assert await pages(gw, [("tag", OWNER), ("tag", PROJECT)], 1) == [["b"], ["a"]]
        assert await pages(gw, [("tag", PROJECT), ("tag", OWNER), ("tag", PROJECT)], 5) == [["b", "a"]]
        assert await pages(gw, [("tag", OWNER), ("tag", "nobody")], 5) == [[]]
        # With state=.
        assert await pages(gw, [("tag", OWNER), ("state", "running")], 5) == [["a"]]
        assert await pages(gw, [("tag", OWNER), ("state", "queued")], 2) == [["b", "d"], ["e"]]
        # Each task as GET /v1/tasks/{id} shows it.
        listed = await gw.client.get("/v1/tasks", params={"tag": OWNER}, headers=KEY)
        for task in listed.json()["tasks"]:
            assert task == (await gw.client.get(f"/v1/tasks/{task['id']}", headers=KEY)).json()
        # The same list in the book's reads (what a tag subscription starts from).
        assert await gw.gateway.tag_reads.list(OWNER, 2) == (["b", "d"], True)

        # Tasks made while a listing goes on are newer than its first page: they are not in the rest of it.
        first = await gw.client.get("/v1/tasks", params={"tag": OWNER, "limit": 2}, headers=KEY)
        clock.now = start + 50
        assert (await create(gw, "g", [OWNER])).status_code == 201
        rest = await gw.client.get(
            "/v1/tasks", params={"tag": OWNER, "limit": 2, "cursor": first.json()["nextCursor"]}, headers=KEY
        )
        assert [t["id"] for t in rest.json()["tasks"]] == ["a", "e"] and rest.json()["nextCursor"] is None
        # A cursor of the id order names no place in this one: the list ends.
        by_id = await gw.client.get("/v1/tasks", params={"limit": 1}, headers=KEY)
        elsewhere = {"tag": OWNER, "cursor": by_id.json()["nextCursor"]}
        assert (await gw.client.get("/v1/tasks", params=elsewhere, headers=KEY)).json() == {
            "tasks": [],
            "nextCursor": None,
        }


async def test_the_list_by_tag_needs_the_api_key_and_a_tag(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, api_key=API_KEY, sweep_interval_ms=0) as gw:
        made = await create(gw, "t1", [OWNER])
        assert made.status_code == 201, made.text
        query = {"tag": OWNER}
        error(await gw.client.get("/v1/tasks", params=query), 401, "unauthorized")
        subscribe = bearer(made.json()["subscribeToken"])
        error(await gw.client.get("/v1/tasks", params=query, headers=subscribe), 403, "forbidden")
        bad: list[tuple[list[tuple[str, Any]], str]] = [
            ([("tag", "a b")], "tag: 'a b' is not a tag: a tag is 1 to 128 characters"),
            ([("tag", "")], "tag: '' is not a tag"),
            ([("tag", OWNER), ("tag", "x" * 129)], "tag: 'xxxx"),
            ([("tag", f"t{n}") for n in range(MAX_TAGS + 1)], f"tag: at most {MAX_TAGS} tag parameters"),
            ([("tag", OWNER), ("cursor", "not a cursor")], "cursor: not a cursor from this list"),
        ]
        for params, expected in bad:
            answer = await gw.client.get("/v1/tasks", params=params, headers=KEY)
            message = error(answer, 400, "invalid-request")
            assert message.startswith(expected), (params, message)


async def test_a_page_by_tag_is_one_range_of_the_tag_index_in_its_order(database_url: str) -> None:
    """The page's query, as the database plans it: the tag index read in the list's order (no sort of a
    tag's tasks, however many carry it), the other tags and the state checked per task."""
    query = q.tagged_tasks(others=1, by_state=True, before=True)
    params = (OWNER, 1_700_000_000_000, "t-9", PROJECT, "queued", 51)
    async with opened(SqlStore(Database(database_url))):  # migrated
        if database_url.startswith("sqlite"):
            with sqlite3.connect(database_url.removeprefix("sqlite:///")) as conn:
                rows = conn.execute(f"EXPLAIN QUERY PLAN {query}", params).fetchall()
            plan = " | ".join(str(r[3]) for r in rows)
            assert "USING COVERING INDEX ix_task_tags_tag (tag=? AND" in plan, plan
            assert "TEMP B-TREE" not in plan, plan
        else:
            conn = await asyncpg.connect(database_url)
            try:
                async with conn.transaction():
                    # Whatever the table's size: could the index give the order, the plan has no Sort.
                    await conn.execute("SET LOCAL enable_seqscan = off")
                    await conn.execute("SET LOCAL enable_bitmapscan = off")
                    rows = await conn.fetch(f"EXPLAIN {q.numbered(query)}", *params)
            finally:
                await conn.close()
            plan = " | ".join(r[0] for r in rows)
            assert "Index Only Scan Backward using ix_task_tags_tag" in plan, plan
            assert "Sort" not in plan, plan


async def test_retention_deletes_a_tasks_tags_with_it(database_url: str) -> None:
    clock = FakeClock()
    async with running_gateway(database_url, clock=clock, retain_finished_s=10, sweep_interval_ms=0) as gw:
        gone = await create(gw, "gone", [OWNER, PROJECT])
        assert gone.status_code == 201, gone.text
        clock.advance(1)
        assert (await create(gw, "kept", [OWNER])).status_code == 201
        token = gone.json()["callbackToken"]
        await post_callback(gw, "gone", token, {"type": "start", "worker": "w1"})
        done = {"type": "succeed", "resultRef": "s3://r", "resultHash": "sha256:1"}
        await post_callback(gw, "gone", token, done, attempt=1)
        drained = await gw.client.post("/v1/notifications/drain")
        assert [n["taskId"] for n in drained.json()] == ["gone"]
        clock.advance(10_000)
        await eventually(
            lambda: gw.client.get("/v1/tasks/gone"), lambda a: a.status_code == 404, "gone deleted"
        )
        async with gw.gateway.db.read() as conn:
            rows = (await conn.execute(text("SELECT task_id, tag FROM task_tags ORDER BY tag"))).all()
        assert [tuple(r) for r in rows] == [("kept", OWNER)]
        listed = await gw.client.get("/v1/tasks", params={"tag": OWNER})
        assert [t["id"] for t in listed.json()["tasks"]] == ["kept"]
        # The id is free again: a new task of that name has tags of its own.
        again = await create(gw, "gone", [PROJECT])
        assert again.status_code == 201, again.text
        assert again.json()["task"]["tags"] == [PROJECT]
