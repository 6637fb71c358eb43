"""``/openapi.json``: every HTTP route of the app is in it with its methods and every path in it is a route;
it is a valid OpenAPI 3.1 document; and what a real server answers matches the schemas it names."""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema
import pytest
from openapi_spec_validator import validate
from starlette.routing import Mount, Route, WebSocketRoute

from tests.support import FakeClock, bearer, create_task, post_callback, running_gateway

pytestmark = pytest.mark.anyio

API_KEY = "k3y"
KEY = bearer(API_KEY)
# Pages rather than API: the dashboard, the API page, this document and the static files.
NOT_API = {"/", "/docs", "/openapi.json"}


async def test_the_document_lists_exactly_the_apps_routes_and_is_valid(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, sweep_interval_ms=0, api_key="openapi-key") as gw:
        answer = await gw.client.get("/openapi.json")
        assert answer.status_code == 200
        assert answer.headers["content-type"] == "application/json"
        doc = answer.json()

    validate(doc)  # the OpenAPI 3.1 schema, every $ref resolving

    routes: dict[str, set[str]] = {}
    sockets: set[str] = set()
    for route in gw.app.routes:
        if isinstance(route, WebSocketRoute):
            sockets.add(route.path)
        elif isinstance(route, Route) and route.path not in NOT_API:
            assert route.methods is not None
            routes.setdefault(route.path, set()).update(m.lower() for m in route.methods if m != "HEAD")
        else:
            assert isinstance(route, Mount | Route), route  # /static and the pages above
    documented = {path: set(methods) for path, methods in doc["paths"].items()}
    assert documented == routes
    assert {ws["path"] for ws in doc["x-websockets"]} == sockets

    schemes = doc["components"]["securitySchemes"]
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            for requirement in op["security"]:
                assert set(requirement) <= set(schemes), (path, method)
            for status, response in op["responses"].items():
                if int(status) >= 400:  # every error answer is the protocol's error shape
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorAnswer"}, (path, method, status)
    # Who may call what, as the protocol says.
    assert doc["paths"]["/v1/tasks"]["get"]["security"] == [{"apiKey": []}, {"tagToken": []}]
    assert doc["paths"]["/v1/tokens"]["post"]["security"] == [{"apiKey": []}]
    assert {"tagToken": []} in doc["paths"]["/v1/tasks/{task_id}/events"]["get"]["security"]
    assert doc["paths"]["/v1/tasks/{task_id}/callbacks"]["post"]["security"] == [{"callbackToken": []}]
    assert {"subscribeToken": []} in doc["paths"]["/v1/tasks/{task_id}"]["get"]["security"]
    assert doc["paths"]["/healthz"]["get"]["security"] == []
    # In open mode the served document asks for no API key: management routes take no credential, reads
    # a task token or none; a callback still its callback token.
    async with running_gateway(sqlite_url, sweep_interval_ms=0) as gw:
        open_doc = (await gw.client.get("/openapi.json")).json()
    validate(open_doc)
    assert "apiKey" not in open_doc["components"]["securitySchemes"]
    assert open_doc["paths"]["/v1/tasks"]["get"]["security"] == []
    assert open_doc["paths"]["/v1/tokens"]["post"]["security"] == []
    read = open_doc["paths"]["/v1/tasks/{task_id}"]["get"]["security"]
    assert {} in read and {"subscribeToken": []} in read
    assert open_doc["paths"]["/v1/tasks/{task_id}/callbacks"]["post"]["security"] == [{"callbackToken": []}]
    # A stream append takes the callback token or the API key; in open mode, none (or the callback token).
    appends = "/v1/tasks/{task_id}/streams/{name}"
    assert doc["paths"][appends]["post"]["security"] == [{"callbackToken": []}, {"apiKey": []}]
    assert open_doc["paths"][appends]["post"]["security"] == []
    assert {"tagToken": []} in doc["paths"][appends]["get"]["security"]
    reasons = doc["components"]["schemas"]["CallbackAnswer"]["properties"]["reason"]["enum"]
    assert "terminal-conflict" in reasons and "duplicate-callback" in reasons


def _checker(doc: dict[str, Any], path: str, method: str) -> Any:
    """Checks an answer against the schema the document gives for its status."""

    def check(answer: httpx.Response, status: int) -> None:
        assert answer.status_code == status, answer.text
        documented = doc["paths"][path][method]["responses"][str(status)]
        schema = documented["content"]["application/json"]["schema"]
        # Resolve the document's refs from its root: the schema beside the document's components.
        jsonschema.validate(answer.json(), {**schema, "components": doc["components"]})
        for name, header in documented.get("headers", {}).items():
            assert name in answer.headers, (path, method, status, name)
            jsonschema.validate(answer.headers[name], header["schema"])

    return check


async def test_every_answer_of_a_real_server_matches_its_schema(sqlite_url: str, clock: FakeClock) -> None:
    async with running_gateway(sqlite_url, clock=clock, api_key=API_KEY, sweep_interval_ms=0) as gw:
        doc = (await gw.client.get("/openapi.json")).json()
        c = gw.client
        task = "/v1/tasks/{task_id}"

        def check(path: str, method: str) -> Any:
            return _checker(doc, path, method)

        body = {"id": "r-1", "ttlMs": 60_000, "maxAttempts": 2}
        check("/v1/tasks", "post")(await c.post("/v1/tasks", json=body, headers=KEY), 201)
        check("/v1/tasks", "post")(await c.post("/v1/tasks", json=body, headers=KEY), 200)
        check("/v1/tasks", "post")(await c.post("/v1/tasks", json={**body, "ttlMs": 1}, headers=KEY), 409)
        check("/v1/tasks", "post")(await c.post("/v1/tasks", json={"ttlMs": "x"}, headers=KEY), 400)
        check("/v1/tasks", "post")(await c.post("/v1/tasks", json=body), 401)
        created = await create_task(gw, "r-2", headers=KEY)
        callbacks = task + "/callbacks"
        cb = bearer(created.callback_token)
        for event in (
            {"type": "start", "worker": "w"},
            {"type": "progress", "progress": 40, "cursor": "c"},
            {"type": "progress", "progress": 30, "cursor": "c"},
            {"type": "fail", "error": "boom", "retryable": True},
            {"type": "start", "worker": "w"},
            {"type": "succeed", "resultRef": "s3://r", "resultHash": "h"},
            {"type": "succeed", "resultRef": "s3://r", "resultHash": "h"},
        ):
            answer = await c.post("/v1/tasks/r-2/callbacks", json={"event": event}, headers=cb)
            check(callbacks, "post")(answer, 200)
        again = await create_task(gw, "r-1", ttl_ms=60_000, max_attempts=2, headers=KEY, expect=200)
        await post_callback(gw, "r-1", again.callback_token, {"type": "start", "worker": "w"})
        stale = {"attempt": 9, "event": {"type": "progress", "progress": 1, "cursor": "c"}}
        check(callbacks, "post")(await c.post("/v1/tasks/r-2/callbacks", json=stale, headers=cb), 409)
        check(callbacks, "post")(await c.post("/v1/tasks/r-2/callbacks", json={}, headers=cb), 400)
        check(callbacks, "post")(await c.post("/v1/tasks/r-2/callbacks", json={}, headers=KEY), 403)

        sub = bearer(created.subscribe_token)
        check(task, "get")(await c.get("/v1/tasks/r-2", headers=sub), 200)
        check(task, "get")(await c.get("/v1/tasks/nope", headers=KEY), 404)
        events = task + "/events"
        for cursor in (0, 3, 7, 99):  # snapshot (retention), delta, caught-up, snapshot (cursor-ahead)
            answer = await c.get("/v1/tasks/r-2/events", params={"cursor": cursor}, headers=sub)
            check(events, "get")(answer, 200)
        deliveries = task + "/deliveries"
        key = {**KEY, "Idempotency-Key": "d-1"}
        check(deliveries, "post")(await c.post("/v1/tasks/r-2/deliveries", headers=key), 200)
        check(deliveries, "post")(await c.post("/v1/tasks/r-2/deliveries", headers=key), 200)
        check(deliveries, "post")(await c.post("/v1/tasks/r-1/deliveries", headers=key), 409)
        cancels = task + "/cancel"
        await create_task(gw, "r-3", headers=KEY)
        reason = {"reason": "wrong export"}
        check(cancels, "post")(await c.post("/v1/tasks/r-3/cancel", json=reason, headers=KEY), 200)
        check(cancels, "post")(await c.post("/v1/tasks/r-3/cancel", headers=KEY), 200)  # terminal-conflict
        check(cancels, "post")(await c.post("/v1/tasks/r-3/cancel", json={"reason": 1}, headers=KEY), 400)
        check(cancels, "post")(await c.post("/v1/tasks/nope/cancel", headers=KEY), 404)
        check(cancels, "post")(await c.post("/v1/tasks/r-3/cancel"), 401)
        cancelled = await c.get("/v1/tasks/r-3/events", params={"cursor": 0}, headers=KEY)
        check(events, "get")(cancelled, 200)  # the history's cancel entry is in the schema
        assert cancelled.json()["events"][0]["event"]["type"] == "cancel"
        drain = "/v1/notifications/drain"
        drained = await c.post(drain, headers={**KEY, "Idempotency-Key": "n-1"}, params={"limit": 1})
        check(drain, "post")(drained, 200)
        assert drained.json() != []
        check(drain, "post")(await c.post(drain, headers={**KEY, "Idempotency-Key": "n-1"}), 200)
        check(drain, "post")(await c.post(drain, headers=KEY), 200)
        check(drain, "post")(await c.post(drain, headers=KEY, params={"limit": 0}), 400)
        check("/v1/tasks", "get")(await c.get("/v1/tasks", params={"limit": 1}, headers=KEY), 200)
        check("/v1/tasks", "get")(await c.get("/v1/tasks", params={"limit": 0}, headers=KEY), 400)
        check("/healthz", "get")(await c.get("/healthz"), 200)
        check("/readyz", "get")(await c.get("/readyz"), 200)
        check("/v1/demo", "get")(await c.get("/v1/demo"), 200)
        check("/v1/demo/tasks", "post")(await c.post("/v1/demo/tasks"), 404)
        # A task's streams: an append and its refusals, a page, the list, the text.
        appends = task + "/streams/{name}"
        await create_task(gw, "r-4", headers=KEY)
        running = await c.post(
            "/v1/tasks", json={"id": "r-4", "ttlMs": 600_000, "maxAttempts": 3}, headers=KEY
        )
        cb4 = bearer(running.json()["callbackToken"])
        await post_callback(gw, "r-4", running.json()["callbackToken"], {"type": "start", "worker": "w"})
        path4 = "/v1/tasks/r-4/streams/output"
        batch = {"attempt": 1, "seq": 0, "chunks": ["a", "b"]}
        check(appends, "post")(await c.post(path4, json=batch, headers=cb4), 200)
        check(appends, "post")(await c.post(path4, json=batch, headers=cb4), 200)  # a duplicate
        gap = await c.post(path4, json={**batch, "seq": 5}, headers=cb4)
        check(appends, "post")(gap, 409)
        assert gap.json()["expectedSeq"] == 1
        check(appends, "post")(await c.post(path4, json={**batch, "attempt": 0}, headers=cb4), 409)
        check(appends, "post")(await c.post("/v1/tasks/r-2/streams/output", json=batch, headers=cb), 409)
        check(appends, "post")(await c.post(path4, json={**batch, "chunks": []}, headers=cb4), 400)
        check(appends, "post")(await c.post(path4, json=batch), 401)
        check(appends, "get")(await c.get(path4, params={"offset": 1, "limit": 1}, headers=KEY), 200)
        check(appends, "get")(await c.get(path4, params={"offset": "x"}, headers=KEY), 400)
        check(task + "/streams", "get")(await c.get("/v1/tasks/r-4/streams", headers=KEY), 200)
        check(task + "/streams", "get")(await c.get("/v1/tasks/nope/streams", headers=KEY), 404)
        text = await c.get("/v1/tasks/r-4/streams/output/text", headers=KEY)
        assert (text.status_code, text.text) == (200, "ab")
        documented = doc["paths"][appends + "/text"]["get"]["responses"]["200"]
        assert list(documented["content"]) == ["text/plain; charset=utf-8"]
        for name, header in documented["headers"].items():
            jsonschema.validate(text.headers[name], header["schema"])
        tokens = "/v1/tokens"
        issued = await c.post(tokens, json={"tag": "owner:u42", "ttlS": 60}, headers=KEY)
        check(tokens, "post")(issued, 201)
        check(tokens, "post")(await c.post(tokens, json={"tag": "owner:u42"}, headers=KEY), 201)
        check(tokens, "post")(await c.post(tokens, json={"tag": "owner u42"}, headers=KEY), 400)
        check(tokens, "post")(await c.post(tokens, json={"tag": "owner:u42"}), 401)
        tag_token = bearer(issued.json()["token"])
        check(tokens, "post")(await c.post(tokens, json={"tag": "owner:u42"}, headers=tag_token), 403)
        check(task, "get")(await c.get("/v1/tasks/r-2", headers=tag_token), 403)  # r-2 has no tags
