"""Names and defaults a newcomer meets first (issue 32, item 10), through a real server: a create without
``maxAttempts`` gets ``Backend.create``'s default, a progress without ``cursor`` (the worker's bookmark, not
a subscriber's resume cursor) is taken with an empty one, the task list says where its credential goes when
it is sent as ``?token=``, and every JSON answer ends with a newline."""

from __future__ import annotations

import inspect
from typing import Any

import orjson
import pytest

from gateway.client import AsyncBackend, Backend
from tests.support import SECRET, bearer, create_task, error, mint_tag, post_callback, running_gateway

pytestmark = pytest.mark.anyio

API_KEY = "names-and-defaults-key-0123456789"


async def test_a_create_without_max_attempts_gets_the_python_clients_default(sqlite_url: str) -> None:
    for client in (Backend, AsyncBackend):
        assert inspect.signature(client.create).parameters["max_attempts"].default == 1
    async with running_gateway(sqlite_url) as gw:
        answer = await gw.client.post("/v1/tasks", json={"id": "no-attempts", "ttlMs": 60_000})
        assert answer.status_code == 201, answer.text
        assert answer.json()["task"]["maxAttempts"] == 1
        async with AsyncBackend(gw.url, api_key=None) as backend:
            made = await backend.create("by-backend", ttl_ms=60_000)
            # The same parameters as the HTTP create above: a repeat of it is the same task, not a 409.
            again = await backend.create("no-attempts", ttl_ms=60_000)
        assert made.task["maxAttempts"] == 1
        assert (again.created, again.task["maxAttempts"]) == (False, 1)


async def test_a_progress_without_cursor_is_taken_with_an_empty_one(sqlite_url: str) -> None:
    """The event in the history has every field of protocol.md's Shapes, ``cursor`` included: an empty string
    when the worker sent none. A callback id sent again with ``"cursor": ""`` is the same callback (the same
    event)."""
    async with running_gateway(sqlite_url) as gw:
        made = await create_task(gw, "bookmarks", max_attempts=1)
        cb = made["callbackToken"]
        await post_callback(gw, "bookmarks", cb, {"type": "start", "worker": "w1"})
        event: dict[str, Any] = {"type": "progress", "progress": 10}
        first = {"callbackId": "p10", "attempt": 1, "event": event}
        answer = await gw.client.post("/v1/tasks/bookmarks/callbacks", json=first, headers=bearer(cb))
        assert answer.status_code == 200, answer.text
        assert answer.json()["reason"] == "progress"
        same = {**first, "event": {**event, "cursor": ""}}
        repeat = await gw.client.post("/v1/tasks/bookmarks/callbacks", json=same, headers=bearer(cb))
        assert repeat.json()["reason"] == "duplicate-callback", repeat.text
        bookmarked = {"type": "progress", "progress": 20, "cursor": "row-200"}
        await post_callback(gw, "bookmarks", cb, bookmarked, attempt=1)
        history = (await gw.client.get("/v1/tasks/bookmarks/events", params={"cursor": 1})).json()
        assert [e["event"]["cursor"] for e in history["events"]] == ["", "row-200"]


async def test_the_task_list_says_its_credential_goes_in_the_authorization_header(sqlite_url: str) -> None:
    tag_token = mint_tag("owner:u42", secret=SECRET)
    async with running_gateway(sqlite_url, api_key=API_KEY) as gw:
        for token in (API_KEY, tag_token):
            answer = await gw.client.get("/v1/tasks", params={"tag": "owner:u42", "token": token})
            message = error(answer, 401, "unauthorized")
            assert "Authorization header" in message and "?token=" in message, message
        listed = await gw.client.get("/v1/tasks", params={"tag": "owner:u42"}, headers=bearer(tag_token))
        assert listed.status_code == 200, listed.text
    async with running_gateway(sqlite_url) as gw:  # open mode: the list takes no credential, and no ?token=
        message = error(await gw.client.get("/v1/tasks", params={"token": "x"}), 400, "invalid-request")
        assert message.startswith("token: ") and "Authorization header" in message, message


async def test_every_json_answer_ends_with_a_newline(sqlite_url: str) -> None:
    """As a text file does, so that ``curl`` leaves the prompt on a line of its own: answers, errors of the
    routes and of the connection itself (a header past the limit), the OpenAPI document."""
    async with running_gateway(sqlite_url, api_key=API_KEY) as gw:
        key = bearer(API_KEY)
        client = gw.client
        answers = {
            "create": await client.post("/v1/tasks", json={"id": "nl", "ttlMs": 60_000}, headers=key),
            "get": await client.get("/v1/tasks/nl", headers=key),
            "events": await client.get("/v1/tasks/nl/events", params={"cursor": 0}, headers=key),
            "list": await client.get("/v1/tasks", headers=key),
            "drain": await client.post("/v1/notifications/drain", headers={**key, "Idempotency-Key": "k"}),
            "400": await client.post("/v1/tasks", json={"ttlMs": 0}, headers=key),
            "401": await client.get("/v1/tasks"),
            "404": await client.get("/v1/nothing-here"),
            "405": await client.delete("/v1/tasks", headers=key),
            "healthz": await client.get("/healthz"),
            "openapi": await client.get("/openapi.json"),
            "431": await client.get("/healthz", headers={"X-Big": "x" * 64 * 1024}),
        }
    for name, answer in answers.items():
        assert answer.headers["content-type"].startswith("application/json"), name
        assert answer.content.endswith(b"\n") and not answer.content.endswith(b"\n\n"), (name, answer.content)
        orjson.loads(answer.content)
    assert [answers[n].status_code for n in ("400", "401", "404", "405", "431")] == [400, 401, 404, 405, 431]
