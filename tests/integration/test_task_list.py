"""The operators' task list, ``GET /v1/tasks`` (docs/protocol.md): the API key, a state filter and an
opaque cursor whose pages cover every task once; bad input is a 400 with the protocol's code."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import FakeClock, bearer, create_task, error, post_callback, running_gateway

pytestmark = pytest.mark.anyio

API_KEY = "k3y"
KEY = bearer(API_KEY)


async def pages(client: Any, query: dict[str, Any], headers: dict[str, str]) -> list[list[dict[str, Any]]]:
    """Every page of the list, following nextCursor to the end."""
    found: list[list[dict[str, Any]]] = []
    cursor = None
    for _ in range(100):
        params = dict(query) if cursor is None else {**query, "cursor": cursor}
        answer = await client.get("/v1/tasks", params=params, headers=headers)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert set(body) == {"tasks", "nextCursor"}, body
        found.append(body["tasks"])
        cursor = body["nextCursor"]
        if cursor is None:
            return found
    raise AssertionError("the list never ended")


async def test_pages_cover_every_task_once_and_the_state_filter_keeps_its_own(
    sqlite_url: str, clock: FakeClock
) -> None:
    async with running_gateway(sqlite_url, clock=clock, api_key=API_KEY, sweep_interval_ms=0) as gw:
        ids = [f"job-{n}" for n in (7, 3, 0, 5, 1, 6, 2, 4)]
        created = {i: await create_task(gw, i, headers=KEY) for i in ids}
        for task_id in ("job-2", "job-5"):
            answer = await post_callback(
                gw, task_id, created[task_id].callback_token, {"type": "start", "worker": "w"}
            )
            assert answer["reason"] == "started"

        every = await pages(gw.client, {"limit": 3}, KEY)
        assert [len(p) for p in every] == [3, 3, 2]
        listed = [t["id"] for p in every for t in p]
        assert listed == sorted(ids)  # each once, in id order
        by_id = {t["id"]: t for p in every for t in p}
        for task_id in ids:  # each as GET /v1/tasks/{id} shows it
            one = await gw.client.get(f"/v1/tasks/{task_id}", headers=KEY)
            assert by_id[task_id] == one.json()

        running = await pages(gw.client, {"state": "running", "limit": 1}, KEY)
        assert [t["id"] for p in running for t in p] == ["job-2", "job-5"]
        assert await pages(gw.client, {"state": "failed"}, KEY) == [[]]
        whole = await pages(gw.client, {}, KEY)  # the default page holds all eight
        assert len(whole) == 1 and len(whole[0]) == 8


async def test_order_newest_pages_newest_first_and_a_task_created_meanwhile_waits_for_the_next_listing(
    database_url: str, clock: FakeClock
) -> None:
    """``order=newest``: by creation time, newest first, whatever the ids; a page at a time, each task
    once, a task created between two pages left to the next listing; the state filter within it. A list by
    tag is newest first whether asked or not; no other order is taken."""
    async with running_gateway(database_url, clock=clock, api_key=API_KEY, sweep_interval_ms=0) as gw:
        ids = ["job-b", "job-z", "job-a", "job-y", "job-c"]  # created in this order, a second apart
        created = {}
        for task_id in ids:
            created[task_id] = await create_task(gw, task_id, headers=KEY)
            clock.advance(1_000)
        await post_callback(gw, "job-a", created["job-a"].callback_token, {"type": "start", "worker": "w"})

        newest: dict[str, Any] = {"order": "newest", "limit": 2}
        first = await gw.client.get("/v1/tasks", params=newest, headers=KEY)
        assert [t["id"] for t in first.json()["tasks"]] == ["job-c", "job-y"]
        await create_task(gw, "job-0", headers=KEY)  # the newest now: on the next listing, not this one
        rest = await pages(gw.client, {**newest, "cursor": first.json()["nextCursor"]}, KEY)
        assert [t["id"] for p in rest for t in p] == ["job-a", "job-z", "job-b"]
        listed = await pages(gw.client, newest, KEY)
        assert [t["id"] for p in listed for t in p] == ["job-0", *reversed(ids)]
        assert [t["createdAtMs"] for p in listed for t in p] == sorted(
            (t["createdAtMs"] for p in listed for t in p), reverse=True
        )
        running = await pages(gw.client, {"order": "newest", "state": "running"}, KEY)
        assert [t["id"] for p in running for t in p] == ["job-a"]
        # With a tag the list is newest first whether asked or not.
        tagged = await create_task(gw, "job-t", tags=["owner:u42"], headers=KEY)
        assert tagged.task["tags"] == ["owner:u42"]
        for query in ({"tag": "owner:u42"}, {"tag": "owner:u42", "order": "newest"}):
            assert [t["id"] for p in await pages(gw.client, query, KEY) for t in p] == ["job-t"]
        error(await gw.client.get("/v1/tasks", params={"order": "id"}, headers=KEY), 400, "invalid-request")


async def test_the_list_needs_the_api_key(sqlite_url: str, clock: FakeClock) -> None:
    async with running_gateway(sqlite_url, clock=clock, api_key=API_KEY, sweep_interval_ms=0) as gw:
        created = await create_task(gw, "job-1", headers=KEY)
        error(await gw.client.get("/v1/tasks"), 401, "unauthorized")
        error(await gw.client.get("/v1/tasks", headers=bearer("nope")), 401, "unauthorized")
        subscribe = bearer(created.subscribe_token)
        error(await gw.client.get("/v1/tasks", headers=subscribe), 403, "forbidden")
        # The API key is never taken from the URL.
        error(await gw.client.get("/v1/tasks", params={"token": API_KEY}), 401, "unauthorized")
        assert (await gw.client.get("/v1/tasks", headers=KEY)).status_code == 200


async def test_bad_state_cursor_or_limit_is_a_400(sqlite_url: str, clock: FakeClock) -> None:
    async with running_gateway(sqlite_url, clock=clock, sweep_interval_ms=0) as gw:  # open mode
        await create_task(gw, "job-1")
        for params, field in [
            ({"state": "done"}, "state"),
            ({"cursor": "not a cursor"}, "cursor"),
            ({"cursor": "am9iLTE"}, "cursor"),  # base64 of "job-1": not one the list gave out
            ({"limit": "0"}, "limit"),
            ({"limit": "501"}, "limit"),
            ({"limit": "ten"}, "limit"),
            ({"limit": "2.5"}, "limit"),
            ({"sort": "id"}, "sort"),
        ]:
            answer = await gw.client.get("/v1/tasks", params=params)
            message = error(answer, 400, "invalid-request")
            assert message.startswith(f"{field}:"), (params, message)
        # The one task is still there, unharmed.
        body = (await gw.client.get("/v1/tasks")).json()
        assert [t["id"] for t in body["tasks"]] == ["job-1"] and body["nextCursor"] is None
        error(await gw.client.delete("/v1/tasks"), 405, "method-not-allowed")
