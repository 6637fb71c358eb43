"""Bad input through the HTTP API: each answers the protocol's status and code, with a message naming the
field, and changes nothing that is stored.

Type checks (JSON types, required and unknown fields) are the HTTP layer's; range checks are the state
machine's and happen in its order (protocol.md), so some "bad" values are a 200 with the reason of
protocol.md's task life. Shape-only checks run on SQLite; checks that go through a database transaction
(and must roll it back) run on both databases.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from tests.support import FakeClock, Running, bearer, create_task, error, post_callback, running_gateway
from tests.support.model import MACHINE_MESSAGE

pytestmark = pytest.mark.anyio

LIMIT = 64 * 1024
START = {"type": "start", "worker": "w1"}


@asynccontextmanager
async def gateway(url: str, clock: FakeClock, **overrides: Any) -> AsyncIterator[Running]:
    # The background sweeper is off: nothing here needs it.
    async with running_gateway(url, clock=clock, **{"sweep_interval_ms": 0, **overrides}) as gw:
        yield gw


async def running_task(gw: Running, task_id: str = "t") -> dict[str, str]:
    """A running task at version 1; returns its callback headers."""
    made = await create_task(gw, task_id, ttl_ms=60_000, max_attempts=2)
    started = await post_callback(gw, task_id, made.callback_token, START)
    assert started["reason"] == "started", started
    return bearer(made.callback_token)


async def queued_task(gw: Running, task_id: str) -> dict[str, str]:
    made = await create_task(gw, task_id, ttl_ms=60_000, max_attempts=2)
    return bearer(made.callback_token)


async def snapshot(gw: Running, task_id: str) -> tuple[dict[str, Any], list[Any]]:
    """The stored task and its whole history (open mode: no credential needed)."""
    task = await gw.client.get(f"/v1/tasks/{task_id}")
    assert task.status_code == 200, task.text
    history = await gw.client.get(f"/v1/tasks/{task_id}/events", params={"cursor": 0})
    assert history.status_code == 200, history.text
    return task.json(), history.json()["events"]


def raw(data: Any) -> bytes:
    # The standard library's encoder: it writes integers of any size, as a client may send them.
    return data if isinstance(data, bytes) else json.dumps(data).encode()


def progress(value: Any) -> dict[str, Any]:
    return {"event": {"type": "progress", "progress": value, "cursor": "c"}}


# Each: a callback body and the text its message must contain (the field it names).
CALLBACK_TYPE_ERRORS: list[tuple[Any, str]] = [
    (b'{"event": ', "JSON"),
    (b"", "JSON"),
    (b"{'event': {}}", "JSON"),
    (b"\xff\xfe", "JSON"),
    (b"[]", "body"),
    (b'"start"', "body"),
    (b"null", "body"),
    (b"5", "body"),
    (progress("5"), "event.progress"),
    (progress(True), "event.progress"),
    (progress(None), "event.progress"),
    (progress([5]), "event.progress"),
    ({"event": {"type": "fail", "error": "e", "retryable": "yes"}}, "event.retryable"),
    ({"event": {"type": "fail", "error": "e", "retryable": 1}}, "event.retryable"),
    ({"event": {"type": "fail", "error": 5, "retryable": True}}, "event.error"),
    ({"event": {"type": "start", "worker": 5}}, "event.worker"),
    ({"event": {"type": "progress", "progress": 5, "cursor": 5}}, "event.cursor"),
    ({"event": {"type": "succeed", "resultRef": 5, "resultHash": "h"}}, "event.resultRef"),
    ({"callbackId": 5, "event": START}, "callbackId"),
    ({"attempt": "1", **progress(5)}, "attempt"),
    ({"attempt": True, **progress(5)}, "attempt"),
    ({"attempt": 1.5, **progress(5)}, "attempt"),
    ({"attempt": -1, **progress(5)}, "attempt"),  # no task's attempts is below 0, nor past a BIGINT
    ({"attempt": 2**63, **progress(5)}, "attempt"),
    ({"event": START, "extra": 1}, "extra"),
    ({"event": {**START, "extra": 1}}, "event.extra"),
    ({"event": {"type": "progress", "progress": 5, "cursor": "c", "percent": 5}}, "event.percent"),
    ({}, "event"),
    ({"callbackId": "c"}, "event"),
    ({"event": {"worker": "w1"}}, "event.type"),
    ({"event": {"type": "start"}}, "event.worker"),
    ({"event": {"type": "fail", "error": "e"}}, "event.retryable"),
    ({"event": {"type": "succeed", "resultRef": "r"}}, "event.resultHash"),
    ({"event": {**START, "atMs": 5}}, "event.atMs"),
    ({"event": {"type": "succeed", "resultRef": "r", "resultHash": "h", "atMs": 1_700_000_000_000}}, "atMs"),
    ({"event": {"type": "expire"}}, "event.type"),
    ({"event": {"type": "explode"}}, "event.type"),
    ({"event": {"type": "START", "worker": "w"}}, "event.type"),
    ({"event": {"type": 5}}, "event"),
    ({"event": 5}, "event"),
    ({"event": [START]}, "event"),
    ({"event": START, "attempt": 1}, "attempt"),
]


async def test_callback_type_errors(sqlite_url: str, clock: FakeClock) -> None:
    async with gateway(sqlite_url, clock) as gw:
        cb = await running_task(gw)
        before = await snapshot(gw, "t")
        for body, field in CALLBACK_TYPE_ERRORS:
            answer = await gw.client.post(
                "/v1/tasks/t/callbacks", content=raw(body), headers={**cb, "Content-Type": "application/json"}
            )
            message = error(answer, 400, "invalid-request")
            assert field in message, (body, message)
        assert await snapshot(gw, "t") == before


async def test_machine_range_errors_through_http(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        cb = await running_task(gw)
        before = await snapshot(gw, "t")

        async def post(body: dict[str, Any]) -> httpx.Response:
            return await gw.client.post("/v1/tasks/t/callbacks", json=body, headers=cb)

        message = error(await post(progress(101)), 400, "invalid-request")
        assert message == "progress must not exceed 100"
        for value in (-1, 5.5):
            message = error(await post(progress(value)), 400, "invalid-request")
            assert message == "progress must be an integer >= 0"
        for event in (
            {"type": "succeed", "resultRef": "", "resultHash": "h"},
            {"type": "succeed", "resultRef": "  ", "resultHash": "h"},
            {"type": "succeed", "resultRef": "r", "resultHash": "\u3000"},
        ):
            message = error(await post({"event": event}), 400, "invalid-request")
            assert message == "resultRef and resultHash must not be blank"
        assert await snapshot(gw, "t") == before


async def test_range_checks_happen_in_the_machines_order(database_url: str, clock: FakeClock) -> None:
    """On a queued task, progress 101 and a blank resultRef are not-running (200), not errors."""
    async with gateway(database_url, clock) as gw:
        cb = await queued_task(gw, "q")
        task, history = await snapshot(gw, "q")
        for body in (
            progress(101),
            progress(-1),
            progress(5.5),
            {"event": {"type": "succeed", "resultRef": "", "resultHash": ""}},
        ):
            answer = await gw.client.post("/v1/tasks/q/callbacks", json=body, headers=cb)
            assert answer.status_code == 200, answer.text
            assert answer.json() == {
                "changed": False,
                "duplicate": False,
                "duplicateCallback": False,
                "notify": False,
                "reason": "not-running",
                "task": task,
            }
        assert await snapshot(gw, "q") == (task, history)


async def test_a_rejected_callback_does_not_remember_its_callback_id(
    database_url: str, clock: FakeClock
) -> None:
    async with gateway(database_url, clock) as gw:
        cb = await running_task(gw)

        async def post(body: dict[str, Any]) -> httpx.Response:
            return await gw.client.post("/v1/tasks/t/callbacks", json=body, headers=cb)

        # Rejected by the state machine (inside the transaction), then by the type checks.
        error(await post({"callbackId": "x1", **progress(101)}), 400, "invalid-request")
        error(await post({"callbackId": "x2", **progress("5")}), 400, "invalid-request")
        bad_result = {"type": "succeed", "resultRef": " ", "resultHash": "h"}
        error(await post({"callbackId": "x3", "event": bad_result}), 400, "invalid-request")
        for callback_id, body, reason in (
            ("x1", progress(10), "progress"),
            ("x2", progress(20), "progress"),
            ("x3", {"event": {"type": "succeed", "resultRef": "r", "resultHash": "h"}}, "succeeded"),
        ):
            answer = await post({"callbackId": callback_id, **body})
            assert answer.status_code == 200, answer.text
            assert (
                answer.json()["reason"],
                answer.json()["changed"],
                answer.json()["duplicateCallback"],
            ) == (reason, True, False)
        task, history = await snapshot(gw, "t")
        assert task["version"] == 4 and [e["version"] for e in history] == [1, 2, 3, 4]


# Each: a create body and the text its message must contain; ``bad-N`` ids must not exist afterwards.
CREATE_ERRORS: list[tuple[Any, str]] = [
    (b'{"ttlMs": 1', "JSON"),
    (b"", "JSON"),
    (b"[]", "body"),
    (b'"x"', "body"),
    ({"ttlMs": "100", "maxAttempts": 1}, "ttlMs"),
    ({"ttlMs": 1.5, "maxAttempts": 1}, "ttlMs"),
    ({"ttlMs": True, "maxAttempts": 1}, "ttlMs"),
    ({"ttlMs": None, "maxAttempts": 1}, "ttlMs"),
    ({"ttlMs": 2**64, "maxAttempts": 1}, "ttlMs"),
    ({"ttlMs": 1_000, "maxAttempts": "2"}, "maxAttempts"),
    ({"ttlMs": 1_000, "maxAttempts": True}, "maxAttempts"),
    ({"ttlMs": 1_000, "maxAttempts": 1, "name": "n"}, "name"),
    ({"maxAttempts": 1}, "ttlMs"),
    ({"id": 5, "ttlMs": 1_000, "maxAttempts": 1}, "id"),
    ({"id": "a/b", "ttlMs": 1_000, "maxAttempts": 1}, "id"),
    ({"id": "a\nb", "ttlMs": 1_000, "maxAttempts": 1}, "id"),
    ({"id": "x" * 129, "ttlMs": 1_000, "maxAttempts": 1}, "id"),
    ({"ttlMs": 0, "maxAttempts": 1}, "ttlMs must be a positive number"),
    ({"ttlMs": -5, "maxAttempts": 1}, "ttlMs must be a positive number"),
    ({"ttlMs": 1_000, "maxAttempts": 0}, "maxAttempts must be an integer >= 1"),
    ({"ttlMs": 1_000, "maxAttempts": 1.5}, "maxAttempts must be an integer >= 1"),
    ({"id": "  ", "ttlMs": 1_000, "maxAttempts": 1}, "id must not be blank"),
    ({"id": "", "ttlMs": 1_000, "maxAttempts": 1}, "id must not be blank"),
]


async def test_create_errors(sqlite_url: str, clock: FakeClock) -> None:
    async with gateway(sqlite_url, clock) as gw:
        for i, (body, field) in enumerate(CREATE_ERRORS):
            if isinstance(body, dict) and "id" not in body:
                body = {"id": f"bad-{i}", **body}
            answer = await gw.client.post(
                "/v1/tasks", content=raw(body), headers={"Content-Type": "application/json"}
            )
            message = error(answer, 400, "invalid-request")
            if MACHINE_MESSAGE.match(field):
                assert message == field, (body, message)
            else:
                assert field in message, (body, message)
        for i in range(len(CREATE_ERRORS)):
            error(await gw.client.get(f"/v1/tasks/bad-{i}"), 404, "unknown-task")
        error(await gw.client.get("/v1/tasks/%20%20"), 404, "unknown-task")
        assert (await gw.client.post("/v1/notifications/drain")).json() == []


async def test_an_unknown_field_is_named_even_when_it_is_a_misspelt_required_one(
    sqlite_url: str, clock: FakeClock
) -> None:
    """protocol.md: unknown fields are a type error (400). A misspelt field is both unknown and, under its
    right name, missing: the answer names what the client sent, and what it probably meant."""
    json_body = {"Content-Type": "application/json"}
    async with gateway(sqlite_url, clock) as gw:
        for body, expected in [
            (
                {"id": "u1", "ttlMs": 60_000, "max_attempts": 2},
                "max_attempts: unknown field (did you mean maxAttempts?)",
            ),
            ({"id": "u2", "ttl": 60_000, "maxAttempts": 2}, "ttl: unknown field (did you mean ttlMs?)"),
            ({"id": "u3", "ttlMs": 60_000, "maxAttempts": 2, "priority": 1}, "priority: unknown field"),
        ]:
            answer = await gw.client.post("/v1/tasks", json=body, headers=json_body)
            assert error(answer, 400, "invalid-request") == expected, body
        cb = await running_task(gw)
        body = {"event": {"type": "progress", "progress": 5, "curser": "row-5"}}
        answer = await gw.client.post("/v1/tasks/t/callbacks", json=body, headers=cb)
        assert error(answer, 400, "invalid-request") == "event.curser: unknown field (did you mean cursor?)"
        for task_id in ("u1", "u2", "u3"):
            error(await gw.client.get(f"/v1/tasks/{task_id}"), 404, "unknown-task")


def padded(body: dict[str, Any], size: int) -> bytes:
    """``body`` as JSON, padded with trailing whitespace to exactly ``size`` bytes."""
    data = orjson.dumps(body)
    assert len(data) <= size
    return data + b" " * (size - len(data))


async def chunks(data: bytes, size: int = 8 * 1024) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def test_body_over_the_limit(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        cb = await running_task(gw)
        before = await snapshot(gw, "t")
        json_type = {"Content-Type": "application/json"}
        over = padded(progress(50), LIMIT + 1)

        # With Content-Length.
        answer = await gw.client.post("/v1/tasks/t/callbacks", content=over, headers={**cb, **json_type})
        error(answer, 413, "payload-too-large")
        create_over = padded({"id": "big", "ttlMs": 1_000, "maxAttempts": 1}, LIMIT + 1)
        error(
            await gw.client.post("/v1/tasks", content=create_over, headers=json_type),
            413,
            "payload-too-large",
        )

        # Streamed (chunked transfer encoding, no Content-Length).
        request = gw.client.build_request(
            "POST", "/v1/tasks/t/callbacks", content=chunks(over), headers={**cb, **json_type}
        )
        assert "content-length" not in request.headers
        assert request.headers["transfer-encoding"] == "chunked"
        error(await gw.client.send(request), 413, "payload-too-large")
        request = gw.client.build_request("POST", "/v1/tasks", content=chunks(create_over), headers=json_type)
        assert "content-length" not in request.headers
        error(await gw.client.send(request), 413, "payload-too-large")

        assert await snapshot(gw, "t") == before
        error(await gw.client.get("/v1/tasks/big"), 404, "unknown-task")

        # Exactly the limit is accepted, either way.
        at_limit = padded(progress(50), LIMIT)
        answer = await gw.client.post("/v1/tasks/t/callbacks", content=at_limit, headers={**cb, **json_type})
        assert answer.status_code == 200 and answer.json()["reason"] == "progress", answer.text
        request = gw.client.build_request(
            "POST",
            "/v1/tasks/t/callbacks",
            content=chunks(padded(progress(60), LIMIT)),
            headers={**cb, **json_type},
        )
        answer = await gw.client.send(request)
        assert answer.status_code == 200 and answer.json()["reason"] == "progress", answer.text


async def test_idempotency_key_required(database_url: str, clock: FakeClock) -> None:
    async with gateway(database_url, clock) as gw:
        cb = await running_task(gw)
        succeed = {"event": {"type": "succeed", "resultRef": "r", "resultHash": "h"}}
        assert (await gw.client.post("/v1/tasks/t/callbacks", json=succeed, headers=cb)).status_code == 200
        message = error(await gw.client.post("/v1/tasks/t/deliveries"), 400, "invalid-request")
        assert "idempotency" in message.lower(), message
        # Empty, and U+00A0 (a JavaScript blank; HTTP strips spaces and tabs around a value itself).
        for blank in (b"", b"\xa0"):
            answer = await gw.client.post("/v1/tasks/t/deliveries", headers={b"Idempotency-Key": blank})
            message = error(answer, 400, "invalid-request")
            assert "idempotency" in message.lower(), message
        # A delivery takes no field: one is refused, as on every route (and delivers nothing).
        for body, says in [(b'{"x": 1}', "x: unknown field"), (b"[]", "body: must be a JSON object")]:
            answer = await gw.client.post(
                "/v1/tasks/t/deliveries", content=body, headers={"Idempotency-Key": "k"}
            )
            assert error(answer, 400, "invalid-request") == says, body
        # Nothing was delivered: the first real key gets a fresh receipt (with no body, or {}).
        answer = await gw.client.post("/v1/tasks/t/deliveries", json={}, headers={"Idempotency-Key": "k"})
        assert answer.status_code == 200, answer.text
        assert (answer.json()["reason"], answer.json()["duplicate"]) == ("delivered", False)


async def test_unknown_route_and_wrong_method(sqlite_url: str, clock: FakeClock) -> None:
    async with gateway(sqlite_url, clock) as gw:
        await running_task(gw)
        before = await snapshot(gw, "t")
        for method, path in (
            ("GET", "/v1/nope"),
            ("POST", "/v1/nope"),
            ("GET", "/v2/tasks/t"),
            ("GET", "/v1/tasks/t/nope"),
            ("POST", "/v1/tasks/t/callbacks/extra"),
            ("GET", "/v1/tasks/t/events/1"),
            ("GET", "/healthz/x"),
        ):
            error(await gw.client.request(method, path), 404, "not-found")
        # A WebSocket handshake to no socket route is answered 404 not-found too, not a bare 403 that
        # reads as a credential problem (a client given a wrong --url says so).
        for path in ("/v1/nope", "/api/v1/ws", "/v1/tasks/t/ws/extra"):
            with pytest.raises(InvalidStatus) as refused:
                async with connect(gw.url.replace("http", "ws", 1) + path):
                    pass
            response = refused.value.response
            assert response.status_code == 404, path
            assert orjson.loads(response.body)["error"]["code"] == "not-found"
        for method, path in (
            ("DELETE", "/v1/tasks"),
            ("PUT", "/v1/tasks"),
            ("DELETE", "/v1/tasks/t"),
            ("POST", "/v1/tasks/t"),
            ("PATCH", "/v1/tasks/t"),
            ("GET", "/v1/tasks/t/callbacks"),
            ("PUT", "/v1/tasks/t/callbacks"),
            ("GET", "/v1/tasks/t/deliveries"),
            ("POST", "/v1/tasks/t/events"),
            ("GET", "/v1/notifications/drain"),
            ("POST", "/healthz"),
            ("DELETE", "/metrics"),
        ):
            error(await gw.client.request(method, path), 405, "method-not-allowed")
        assert await snapshot(gw, "t") == before


async def test_numbers_and_strings_at_the_edges_are_not_server_errors(
    sqlite_url: str, clock: FakeClock
) -> None:
    """A client never sees a 500 for anything it sent."""
    async with gateway(sqlite_url, clock) as gw:
        cb = await running_task(gw)
        before = await snapshot(gw, "t")
        json_type = {"Content-Type": "application/json"}
        for body in (
            b"[" * 5_000 + b"]" * 5_000,
            b'{"event": {"type": "start", "worker": "\\ud800"}}',
            b'{"event": {"type": "progress", "progress": 1e400, "cursor": "c"}}',
            b'{"event": {"type": "progress", "progress": NaN, "cursor": "c"}}',
            raw(progress(2**64)),
            raw(progress(-(2**64))),
            raw({"attempt": 2**64, **progress(5)}),
            raw({"callbackId": "c" * 10_000, "event": START}),
        ):
            answer = await gw.client.post("/v1/tasks/t/callbacks", content=body, headers={**cb, **json_type})
            error(answer, 400, "invalid-request")
        for create in (
            {"ttlMs": 2**53, "maxAttempts": 1},
            {"ttlMs": 2**63, "maxAttempts": 1},
            {"ttlMs": 1_000, "maxAttempts": 1e300},
            {"ttlMs": 1_000, "maxAttempts": 2**64},
        ):
            error(await gw.client.post("/v1/tasks", json=create), 400, "invalid-request")
        for cursor in ("9" * 30, "-" + "9" * 30, "1 ", "0x10"):
            answer = await gw.client.get("/v1/tasks/t/events", params={"cursor": cursor})
            assert answer.status_code in (200, 400), answer.text
        # A cursor given twice is refused, not read as whichever came last.
        for pair in ((("cursor", "junk"), ("cursor", "")), (("cursor", "1"), ("cursor", "2"))):
            error(await gw.client.get("/v1/tasks/t/events", params=pair), 400, "invalid-request")
        assert await snapshot(gw, "t") == before


NUL_CASES = ["path id", "callbackId", "fail error", "resultRef"]


@pytest.mark.parametrize("case", NUL_CASES)
async def test_nul_characters_are_refused_not_a_server_error(
    database_url: str, clock: FakeClock, case: str
) -> None:
    """JSON may carry U+0000 in any string, and a URL path may carry %00; PostgreSQL text cannot hold it,
    so the gateway refuses it on every backend: 400 for a body, 404 for a path id, never a 500."""
    async with gateway(database_url, clock) as gw:
        cb = await running_task(gw)
        before = await snapshot(gw, "t")
        if case == "path id":
            answer = await gw.client.get("/v1/tasks/a%00b")
            error(answer, 404, "unknown-task")
            return
        event = {
            "callbackId": {"callbackId": "a\u0000b", **progress(10)},
            "fail error": {"event": {"type": "fail", "error": "e\u0000", "retryable": False}},
            "resultRef": {"event": {"type": "succeed", "resultRef": "r\u0000", "resultHash": "h"}},
        }[case]
        answer = await gw.client.post("/v1/tasks/t/callbacks", json=event, headers=cb)
        error(answer, 400, "invalid-request")
        assert "NUL" in answer.json()["error"]["message"]
        assert await snapshot(gw, "t") == before
