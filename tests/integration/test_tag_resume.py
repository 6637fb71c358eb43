"""A tag's client that knows many tasks reconnects as the contract says: on a fresh ``/v1/ws`` socket it sends
one subscribe with its whole cursors map (every task it knows, up to ``GATEWAY_TAG_SUBSCRIPTION_MAX``), and
gets the listing, then a resume frame for each task from its cursor."""

from __future__ import annotations

import uuid

import orjson
import pytest
from websockets.exceptions import ConnectionClosed

from tests.integration.test_live_support import live_gateway, recv_frame, socket, ws_url
from tests.tagged import create_tagged, tag_token

pytestmark = pytest.mark.anyio

TASKS = 200  # ids as a backend makes them (UUIDs): a cursors map of about 9 KB


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason=(
        "the issue's contract takes up to GATEWAY_TAG_SUBSCRIPTION_MAX cursors; the gateway holds a socket's "
        "first message to GATEWAY_WS_MAX_MESSAGE_BYTES_BEFORE_AUTH (4 KiB) and closes this one with 1009, "
        "as protocol.md now says (Reconnecting: a client sends the cursors of its newest tasks that fit)"
    ),
)
async def test_a_fresh_socket_takes_a_tag_subscribe_with_the_cursors_of_many_tasks(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url) as gw:
        tag = "owner:many"
        ids = [str(uuid.UUID(int=i + 1)) for i in range(TASKS)]
        for task_id in ids:
            await create_tagged(gw, task_id, [tag])
        message = {
            "type": "subscribe",
            "tag": tag,
            "token": await tag_token(gw, tag),
            "cursors": dict.fromkeys(ids, 0),
        }
        closed: ConnectionClosed | None = None
        async with socket(ws_url(gw, "/v1/ws")) as ws:
            await ws.send(orjson.dumps(message).decode())
            try:
                listing = await recv_frame(ws)
                resumed = [await recv_frame(ws) for _ in ids]
            except ConnectionClosed as exc:
                closed = exc
    assert closed is None, f"the subscribe ({len(orjson.dumps(message))} bytes) was answered: {closed}"
    assert listing["type"] == "tag" and sorted(listing["taskIds"]) == ids, listing
    assert [(f["type"], f["taskId"], f["version"]) for f in resumed] == [
        ("caught-up", task_id, 0) for task_id in listing["taskIds"]
    ]
