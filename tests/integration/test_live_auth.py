"""Who may subscribe (protocol.md, Close codes and Tokens), with an API key configured.

On the single-task socket the server accepts the handshake, sends an ``error`` frame with the code, then
closes with the matching close code, so that browsers see why. On ``/v1/ws`` each of these is an
``error`` frame for that subscription and the socket stays open (while it holds a subscription). A
disallowed ``Origin`` is refused.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest

from tests.integration.test_live_support import (
    closed_with,
    live_gateway,
    recv_frame,
    socket,
    ws_url,
)
from tests.support import Running, bearer, create_task, mint

API_KEY = "live-api-key"
APP = "https://app.example"


async def two_tasks(gw: Running) -> tuple[dict[str, Any], dict[str, Any]]:
    mine = await create_task(gw, "mine", headers=bearer(API_KEY))
    theirs = await create_task(gw, "theirs", headers=bearer(API_KEY))
    return mine, theirs


def refusals(mine: dict[str, Any], theirs: dict[str, Any]) -> list[tuple[str, str, dict[str, Any], str, int]]:
    """(case, task id, query, expected code, expected close code)."""
    return [
        ("no token", "mine", {}, "unauthorized", 4401),
        ("garbage token", "mine", {"token": "not-a-jwt"}, "unauthorized", 4401),
        ("expired token", "mine", {"token": mint("mine", exp_in_s=-3600)}, "unauthorized", 4401),
        (
            "token signed with another secret",
            "mine",
            {"token": mint("mine", secret="x" * 32)},
            "unauthorized",
            4401,
        ),
        ("token for another task", "mine", {"token": theirs["subscribeToken"]}, "forbidden", 4403),
        ("callback token", "mine", {"token": mine["callbackToken"]}, "forbidden", 4403),
        (
            "another task's token, no such task",
            "ghost",
            {"token": theirs["subscribeToken"]},
            "forbidden",
            4403,
        ),
        ("valid token, no such task", "ghost", {"token": mint("ghost")}, "unknown-task", 4404),
        (
            "cursor not a number",
            "mine",
            {"token": mine["subscribeToken"], "cursor": "abc"},
            "invalid-request",
            4400,
        ),
        (
            "negative cursor",
            "mine",
            {"token": mine["subscribeToken"], "cursor": "-1"},
            "invalid-request",
            4400,
        ),
    ]


@pytest.mark.anyio
async def test_single_task_socket_refusals_send_an_error_frame_then_the_close_code(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url, api_key=API_KEY, allowed_origins=(APP,)) as gw:
        mine, theirs = await two_tasks(gw)
        cases = refusals(mine, theirs)
        cases.append(("origin not allowed", "mine", {"token": mine["subscribeToken"]}, "forbidden", 4403))
        with anyio.fail_after(20):
            for case, task_id, query, code, close_code in cases:
                origin = "https://evil.example" if case == "origin not allowed" else None
                async with socket(ws_url(gw, f"/v1/tasks/{task_id}/ws", **query), origin=origin) as ws:
                    frames, closed = await closed_with(ws)
                assert [f["type"] for f in frames] == ["error"], (case, frames)
                assert frames[0]["code"] == code, (case, frames)
                assert frames[0].get("taskId") == task_id, (case, frames)
                assert closed == close_code, (case, closed)
            await gw.gateway.hub.idle()


@pytest.mark.anyio
async def test_allowed_origins_api_key_and_subscribe_token_are_let_in(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url, api_key=API_KEY, allowed_origins=(APP,)) as gw:
        mine, _ = await two_tasks(gw)
        with anyio.fail_after(20):
            for origin, token in (
                (APP, mine["subscribeToken"]),
                (None, mine["subscribeToken"]),
            ):
                url = ws_url(gw, "/v1/tasks/mine/ws", token=token)
                async with socket(url, origin=origin) as ws:
                    frame = await recv_frame(ws)
                    assert frame["type"] == "caught-up" and frame["version"] == 0, frame
                    await ws.send('{"type":"ping"}')
                    assert (await recv_frame(ws))["type"] == "pong"
            # Bearer in the handshake's Authorization header works as well as ?token=, and the API key is
            # taken only from there (a URL ends up in access logs).
            for bearer in (mine["subscribeToken"], API_KEY):
                headers = {"Authorization": f"Bearer {bearer}"}
                async with socket(ws_url(gw, "/v1/tasks/mine/ws"), additional_headers=headers) as ws:
                    assert (await recv_frame(ws))["type"] == "caught-up"
            # As on every route: a key in a URL authenticates nothing (401, as on the management routes).
            async with socket(ws_url(gw, "/v1/tasks/mine/ws", token=API_KEY), origin=APP) as ws:
                frames, closed = await closed_with(ws)
            assert [(f["type"], f["code"]) for f in frames] == [("error", "unauthorized")]
            assert closed == 4401
            # A disallowed origin is refused on the many-task socket too.
            async with socket(ws_url(gw, "/v1/ws"), origin="https://evil.example") as ws:
                frames, closed = await closed_with(ws)
            assert [(f["type"], f["code"]) for f in frames] == [("error", "forbidden")]
            assert closed == 4403


@pytest.mark.anyio
async def test_on_the_many_task_socket_each_refusal_is_an_error_frame_and_the_socket_stays_open(
    sqlite_url: str,
) -> None:
    async with live_gateway(sqlite_url, api_key=API_KEY, allowed_origins=(APP,)) as gw:
        mine, theirs = await two_tasks(gw)
        with anyio.fail_after(20):
            async with socket(ws_url(gw, "/v1/ws"), origin=APP) as ws:
                # Holding a subscription (one that holds none is closed at its 5th refusal: test_live_idle).
                valid = {"type": "subscribe", "taskId": "theirs", "token": theirs["subscribeToken"]}
                await ws.send(json.dumps(valid))
                assert (await recv_frame(ws))["type"] == "caught-up"
                for case, task_id, query, code, _ in refusals(mine, theirs):
                    message: dict[str, Any] = {"type": "subscribe", "taskId": task_id}
                    if "token" in query:
                        message["token"] = query["token"]
                    if "cursor" in query:
                        cursor = query["cursor"]
                        message["cursor"] = int(cursor) if cursor.lstrip("-").isdigit() else cursor
                    await ws.send(json.dumps(message))
                    frame = await recv_frame(ws)
                    assert frame["type"] == "error", (case, frame)
                    assert frame["code"] == code, (case, frame)
                    assert frame["taskId"] == task_id, (case, frame)
                # Still open, and a valid subscription on it works.
                valid = {"type": "subscribe", "taskId": "mine", "cursor": 0, "token": mine["subscribeToken"]}
                await ws.send(json.dumps(valid))
                frame = await recv_frame(ws)
                assert (frame["type"], frame["taskId"], frame["version"]) == ("caught-up", "mine", 0)
                await ws.send('{"type":"ping"}')
                assert (await recv_frame(ws))["type"] == "pong"
                assert ws.close_code is None
