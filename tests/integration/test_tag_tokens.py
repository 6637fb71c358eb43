"""Tag tokens through a real server (protocol.md, Credentials and ``POST /v1/tokens``): the API key issues
them, validated as every body is; they carry ``tag``, ``scope: subscribe`` and ``exp`` and no ``sub``; a tag
token reads and follows every task carrying its tag (HTTP, SSE, the single-task socket, a ``/v1/ws``
subscribe) and lists them with its tag among ``tag=``; on a task that does not carry its tag, or on no task
at all, it is the same ``403`` everywhere, so it cannot probe ids.

Authentication is HTTP-layer behaviour, so these run on SQLite only.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import jwt
import orjson
import pytest
from websockets.asyncio.client import connect

from tests.integration.test_live_support import (
    StreamCheck,
    closed_with,
    get_task,
    live_gateway,
    recv_frame,
    socket,
    sse_frames,
    tag_subscribe,
    ws_url,
)
from tests.support import (
    SECRET,
    STEP_S,
    Running,
    bearer,
    create_task,
    error,
    issue_tag_token,
    mint,
    mint_tag,
    post_callback,
)

pytestmark = pytest.mark.anyio

API_KEY = "tag-token-api-key"
KEY = bearer(API_KEY)
NOT_CARRIED = "the task does not carry this token's tag"


async def test_the_api_key_issues_a_tag_token_for_a_tag_and_a_time(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url, api_key=API_KEY) as gw:
        before = time.time()
        answer = await gw.client.post("/v1/tokens", json={"tag": "owner:u42", "ttlS": 120}, headers=KEY)
        after = time.time()
        assert answer.status_code == 201, answer.text
        body = answer.json()
        assert set(body) == {"token", "expiresAtMs"}
        claims = jwt.decode(body["token"], SECRET, algorithms=["HS256"])
        assert set(claims) == {"tag", "scope", "exp"}  # no sub: never taken for a task token
        assert claims["tag"] == "owner:u42" and claims["scope"] == "subscribe"
        assert int(before) + 120 <= claims["exp"] <= after + 120  # the wall clock, no grace added
        assert body["expiresAtMs"] == claims["exp"] * 1000

        # ttlS: an hour when absent; a whole number (60.0 is one) from 1 to a year.
        for ttl_s, lasts_s in ((None, 3600), (60.0, 60), (31_536_000, 31_536_000)):
            asked: dict[str, Any] = {"tag": "a.b_c@d-e:f"} if ttl_s is None else {"tag": "x", "ttlS": ttl_s}
            made = await gw.client.post("/v1/tokens", json=asked, headers=KEY)
            assert made.status_code == 201, made.text
            exp = jwt.decode(made.json()["token"], SECRET, algorithms=["HS256"])["exp"]
            assert int(before) + lasts_s <= exp <= time.time() + lasts_s


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "tag: required field is missing"),
        ({"tag": ""}, "tag: '' is not a tag: a tag is 1 to 128 characters of A-Z, a-z, 0-9 and : . _ @ -"),
        ({"tag": "owner u42"}, "tag: 'owner u42' is not a tag: a tag is 1 to 128 characters"),
        ({"tag": "t" * 129}, "tag: 'tttttttttt"),
        ({"tag": ["owner:u42"]}, "tag: a tag must be a string"),
        ({"tag": "x", "ttlS": 0}, "ttlS: must be a whole number of seconds from 1 to 31536000 (a year)"),
        ({"tag": "x", "ttlS": 31_536_001}, "ttlS: must be a whole number of seconds from 1 to 31536000"),
        ({"tag": "x", "ttlS": 1.5}, "ttlS: must be a whole number of seconds"),
        ({"tag": "x", "ttlS": True}, "ttlS: must be a whole number of seconds"),
        ({"tag": "x", "ttlS": "3600"}, "ttlS: must be a whole number of seconds"),
        ({"tag": "x", "ttl": 60}, "ttl: unknown field"),
        ({"tags": ["x"]}, "tags: unknown field (did you mean tag?)"),
    ],
)
async def test_a_bad_token_request_is_400_naming_the_field(
    sqlite_url: str, body: dict[str, Any], message: str
) -> None:
    async with live_gateway(sqlite_url, api_key=API_KEY) as gw:
        answer = await gw.client.post("/v1/tokens", json=body, headers=KEY)
        assert error(answer, 400, "invalid-request").startswith(message)
        malformed = await gw.client.post("/v1/tokens", content=b"[", headers=KEY)
        error(malformed, 400, "invalid-request")


async def test_only_the_api_key_issues_tag_tokens(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url, api_key=API_KEY) as gw:
        task = await create_task(gw, "t-1", headers=KEY)
        tag_token = await issue_tag_token(gw, "owner:u42", headers=KEY)
        asked = {"tag": "owner:u42"}
        error(await gw.client.post("/v1/tokens", json=asked), 401, "unauthorized")
        refused = await gw.client.post("/v1/tokens", json=asked, headers=bearer(task.subscribe_token))
        assert (
            error(refused, 403, "forbidden")
            == "a task token cannot be used here; this route needs the API key"
        )
        refused = await gw.client.post("/v1/tokens", json=asked, headers=bearer(tag_token))
        assert (
            error(refused, 403, "forbidden")
            == "a tag token cannot be used here; this route needs the API key"
        )
    # Open mode: no credential, as every management route.
    async with live_gateway(sqlite_url) as gw:
        assert jwt.decode(await issue_tag_token(gw, "owner:u42"), SECRET, algorithms=["HS256"])["tag"]


async def socket_refusal(gw: Running, task_id: str, token: str) -> tuple[list[dict[str, Any]], int | None]:
    """The single-task socket's frames and close code, with ``token``."""
    async with connect(ws_url(gw, f"/v1/tasks/{task_id}/ws", token=token), open_timeout=STEP_S) as ws:
        return await closed_with(ws)


async def test_a_tag_token_on_a_task_without_its_tag_or_on_no_task_is_one_403_everywhere(
    sqlite_url: str,
) -> None:
    async with live_gateway(sqlite_url, api_key=API_KEY) as gw:
        await create_task(gw, "untagged", headers=KEY)
        tag_token = await issue_tag_token(gw, "owner:u42", headers=KEY)
        for task_id in ("untagged", "ghost"):
            for path in (
                f"/v1/tasks/{task_id}",
                f"/v1/tasks/{task_id}/events",
                f"/v1/tasks/{task_id}/stream",
            ):
                for how in ({"headers": bearer(tag_token)}, {"params": {"token": tag_token}}):
                    answer = await gw.client.get(path, **how)  # type: ignore[arg-type]
                    assert error(answer, 403, "forbidden") == NOT_CARRIED, (path, how)
            # An EventSource reconnecting (Last-Event-ID) is refused the same, before its 204 is decided.
            answer = await gw.client.get(
                f"/v1/tasks/{task_id}/stream", headers={**bearer(tag_token), "Last-Event-ID": "0"}
            )
            assert error(answer, 403, "forbidden") == NOT_CARRIED
            frames, close = await socket_refusal(gw, task_id, tag_token)
            assert frames == [
                {"type": "error", "code": "forbidden", "message": NOT_CARRIED, "taskId": task_id}
            ]
            assert close == 4403
        # /v1/ws: an error frame per subscribe, and the socket stays open.
        async with connect(ws_url(gw, "/v1/ws"), open_timeout=STEP_S) as ws:
            with anyio.fail_after(STEP_S):
                for task_id in ("untagged", "ghost"):
                    await ws.send(orjson.dumps({"type": "subscribe", "taskId": task_id, "token": tag_token}))
                    frame = orjson.loads(await ws.recv())
                    assert frame == {
                        "type": "error",
                        "code": "forbidden",
                        "message": NOT_CARRIED,
                        "taskId": task_id,
                    }
                await ws.send('{"type": "ping"}')
                assert orjson.loads(await ws.recv()) == {"type": "pong"}
        # The same tag token opens no management route, callback or heartbeat.
        for method, path in (
            ("POST", "/v1/tasks/untagged/callbacks"),
            ("POST", "/v1/tasks/untagged/heartbeat"),
            ("POST", "/v1/tasks/untagged/cancel"),
            ("POST", "/v1/notifications/drain"),
            ("GET", "/v1/tasks"),
        ):
            answer = await gw.client.request(method, path, headers=bearer(tag_token), json={"attempt": 0})
            error(answer, 403, "forbidden")


async def test_a_tag_token_reads_and_follows_every_task_carrying_its_tag(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url, api_key=API_KEY) as gw:
        mine = await create_task(gw, "mine", tags=["project:7", "owner:u42"], headers=KEY)
        await create_task(gw, "also-mine", tags=["owner:u42"], headers=KEY)
        await create_task(gw, "theirs", tags=["owner:u7"], headers=KEY)
        owner = await issue_tag_token(gw, "owner:u42", headers=KEY)
        project = await issue_tag_token(gw, "project:7", headers=KEY)  # any tag of the task will do

        for token in (owner, project):
            for how in ({"headers": bearer(token)}, {"params": {"token": token}}):
                answer = await gw.client.get("/v1/tasks/mine", **how)  # type: ignore[arg-type]
                assert answer.status_code == 200 and answer.json() == mine.task, answer.text
                answer = await gw.client.get("/v1/tasks/mine/events", **how)  # type: ignore[arg-type]
                assert answer.status_code == 200 and answer.json()["mode"] == "caught-up", answer.text
        answer = await gw.client.get("/v1/tasks/theirs", headers=bearer(owner))
        assert error(answer, 403, "forbidden") == NOT_CARRIED
        answer = await gw.client.get("/v1/tasks/also-mine", headers=bearer(project))
        assert error(answer, 403, "forbidden") == NOT_CARRIED

        # Live, on the three channels at once, from version 0 to the terminal frame.
        single_url = ws_url(gw, "/v1/tasks/mine/ws", token=owner)
        async with (
            connect(single_url, open_timeout=STEP_S) as single,
            connect(ws_url(gw, "/v1/ws"), open_timeout=STEP_S) as multi,
            gw.client.stream("GET", "/v1/tasks/mine/stream", params={"token": owner}) as sse,
        ):
            assert sse.status_code == 200
            sse_events = sse_frames(sse)
            await multi.send(orjson.dumps({"type": "subscribe", "taskId": "mine", "token": owner}).decode())
            checks = [StreamCheck("mine", 0) for _ in range(3)]
            with anyio.fail_after(STEP_S):

                async def next_frames() -> None:
                    checks[0].feed(await recv_frame(single))
                    checks[1].feed(await recv_frame(multi))
                    checks[2].feed((await anext(sse_events))[2])

                await next_frames()  # the resume frames
                worker = mine.callback_token
                await post_callback(gw, "mine", worker, {"type": "start", "worker": "w"})
                await next_frames()
                done = {"type": "succeed", "resultRef": "r", "resultHash": "h"}
                await post_callback(gw, "mine", worker, done)
                await next_frames()
                assert await closed_with(single) == ([], 1000)  # the single-task stream is complete
            final = await get_task(gw, "mine", owner)
            for check in checks:
                assert check.resume is not None and check.resume["type"] == "caught-up"
                assert check.event_versions == [1, 2]
                check.assert_final(final)

        # The list: with its tag among tag= (others narrow it), and only so.
        listed = await gw.client.get("/v1/tasks", params={"tag": "owner:u42"}, headers=bearer(owner))
        assert listed.status_code == 200, listed.text
        assert {task["id"] for task in listed.json()["tasks"]} == {"mine", "also-mine"}
        narrowed = {"tag": ["project:7", "owner:u42"]}
        listed = await gw.client.get("/v1/tasks", params=narrowed, headers=bearer(owner))
        assert [task["id"] for task in listed.json()["tasks"]] == ["mine"]
        for params in ({"tag": "owner:u7"}, {}, {"state": "succeeded"}):
            refused = await gw.client.get("/v1/tasks", params=params, headers=bearer(owner))
            assert "lists only the tasks carrying its tag: add tag=owner:u42" in error(
                refused, 403, "forbidden"
            )


async def test_a_live_subscription_ends_when_its_token_expires_and_a_new_token_resumes_it(
    sqlite_url: str,
) -> None:
    """protocol.md, Credentials: a subscription lasts no longer than the token that authorized it, as an HTTP
    read with that token is refused from then on (Centrifugo and Ably cut a connection whose token expired
    too). On ``/v1/ws`` a tag's subscription (its tasks' streams with it) and a task's end with an
    ``unauthorized`` error frame, the socket open for the others; the single-task socket closes ``4401``; an
    SSE stream ends and its reconnect is ``401``. A new token and the cursors held resume: nothing lost."""
    async with live_gateway(sqlite_url, api_key=API_KEY) as gw:
        tag = "owner:soon"
        a = await create_task(gw, "a", tags=[tag], headers=KEY)
        b = await create_task(gw, "b", headers=KEY)
        c = await create_task(gw, "c", headers=KEY)
        exp = int(time.time()) + 2  # from 1 to 2 seconds from now
        short_tag = mint_tag(tag, exp=exp)
        short_b = mint("b", exp=exp)
        async with (
            socket(ws_url(gw, "/v1/ws")) as multi,
            socket(ws_url(gw, "/v1/tasks/b/ws", token=short_b)) as single,
            gw.client.stream("GET", "/v1/tasks/b/stream", params={"token": short_b}) as sse,
        ):
            assert sse.status_code == 200
            sse_events = sse_frames(sse)
            assert (await anext(sse_events))[0] == "caught-up"
            assert (await recv_frame(single))["type"] == "caught-up"
            await multi.send(tag_subscribe(tag, short_tag))
            assert [(await recv_frame(multi))["type"] for _ in range(2)] == ["tag", "snapshot"]  # "a"
            for task_id, token in (("b", short_b), ("c", c.subscribe_token)):
                await multi.send(
                    orjson.dumps({"type": "subscribe", "taskId": task_id, "token": token}).decode()
                )
                assert (await recv_frame(multi))["taskId"] == task_id

            # The tokens expire: both subscriptions they authorized end, not the socket.
            ended = [await recv_frame(multi) for _ in range(2)]
            assert sorted((f["type"], f["code"], f.get("taskId") or f.get("tag")) for f in ended) == [
                ("error", "unauthorized", "b"),
                ("error", "unauthorized", tag),
            ], ended
            assert all(f["message"].startswith("token has expired") for f in ended)
            frames, code = await closed_with(single)
            assert ([f["code"] for f in frames], code) == (["unauthorized"], 4401)
            with anyio.fail_after(STEP_S):
                assert [event async for event in sse_events] == []  # the stream ended
            reconnect = {"token": short_b}
            answer = await gw.client.get(
                "/v1/tasks/b/stream", params=reconnect, headers={"Last-Event-ID": "0"}
            )
            assert error(answer, 401, "unauthorized") == "token has expired"

            # Only "c" streams on: its event is the first frame after a start of each task.
            for task_id, made in (("a", a), ("b", b), ("c", c)):
                await post_callback(gw, task_id, made.callback_token, {"type": "start", "worker": "w"})
            frame = await recv_frame(multi)
            assert (frame["type"], frame["taskId"], frame["version"]) == ("event", "c", 1)

            # A new token, with the cursors held: what was missed comes as a delta.
            fresh = await issue_tag_token(gw, tag, headers=KEY)
            await multi.send(tag_subscribe(tag, fresh, {"a": 0}))
            resumed = [await recv_frame(multi) for _ in range(2)]
            assert [(f["type"], f.get("taskId")) for f in resumed] == [("tag", None), ("delta", "a")]
            await multi.send(
                orjson.dumps({"type": "subscribe", "taskId": "b", "token": b.subscribe_token}).decode()
            )
            frame = await recv_frame(multi)
            assert (frame["type"], frame["taskId"], frame["version"]) == ("delta", "b", 1)
