"""**tag-across-processes**: a tag's subscriber on one gateway process sees a task created on another within
a second, and follows its changes as live (issue 18's acceptance line, whose browser test,
tests/browser/test_tag_scale_out.py, holds the page's behaviour without the bound).

Two ``gateway serve`` processes on one PostgreSQL database (its LISTEN/NOTIFY bus between them). A
``/v1/ws`` socket on the first holds a tag subscription (a tag token from ``POST /v1/tokens``); a task
with that tag is created on the second, then started and moved to 20% and 50% there. Held to: its
``added`` frame within 1 s of the create's request, each change's ``event`` frame within 1 s of the
callback's request (the request, its commit and the bus between the processes included).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Any

import anyio
import httpx
from websockets.asyncio.client import ClientConnection, connect

from bench.checks.under_load import database
from bench.lib import harness
from bench.lib.verdict import Figure

BOUND_S = 1.0


async def until_frame(ws: ClientConnection, wanted: dict[str, Any]) -> None:
    """Read ``ws`` until a frame holds every item of ``wanted`` (an event frame's version: ``version``)."""
    with anyio.fail_after(30):
        async for raw in ws:
            frame = json.loads(raw)
            assert frame["type"] != "error", frame
            if all(frame.get(key) == value for key, value in wanted.items()):
                return


async def seen() -> list[Figure]:
    tag = f"owner:u{uuid.uuid4().hex[:8]}"
    task_id = f"tagged-{uuid.uuid4().hex[:8]}"
    took: dict[str, float] = {}
    async with database("postgresql") as url, contextlib.AsyncExitStack() as stack:
        near = await stack.enter_async_context(harness.gateway(url))
        far = await stack.enter_async_context(harness.gateway(url))
        client = await stack.enter_async_context(httpx.AsyncClient(timeout=30))
        answer = await client.post(f"{near.http}/v1/tokens", json={"tag": tag, "ttlS": 3600})
        token = answer.raise_for_status().json()["token"]
        ws = await stack.enter_async_context(connect(f"{near.ws}/v1/ws"))
        await ws.send(json.dumps({"type": "subscribe", "tag": tag, "token": token, "cursors": {}}))
        await until_frame(ws, {"type": "tag", "tag": tag})

        body = {"id": task_id, "ttlMs": 600_000, "maxAttempts": 2, "tags": [tag]}
        sent = time.monotonic()
        made = (await client.post(f"{far.http}/v1/tasks", json=body)).raise_for_status().json()
        await until_frame(ws, {"type": "added", "taskId": task_id})
        took["created"] = time.monotonic() - sent
        headers = {"Authorization": f"Bearer {made['callbackToken']}"}
        events: list[tuple[str, dict[str, Any]]] = [("started", {"type": "start", "worker": "w"})]
        events += [(f"at {p}%", {"type": "progress", "progress": p, "cursor": f"p{p}"}) for p in (20, 50)]
        for version, (name, event) in enumerate(events, 1):
            sent = time.monotonic()
            callback = await client.post(
                f"{far.http}/v1/tasks/{task_id}/callbacks", json={"event": event}, headers=headers
            )
            callback.raise_for_status()
            await until_frame(ws, {"type": "event", "taskId": task_id, "version": version})
            took[name] = time.monotonic() - sent
    detail = ", ".join(f"{name} {seconds * 1000:.0f} ms" for name, seconds in took.items())
    check = "tag-across-processes (PostgreSQL)"
    return [
        Figure(
            check,
            "a task created on the other process, seen after",
            took["created"],
            "s",
            BOUND_S,
            digits=3,
            detail=detail,
        ),
        Figure(
            check,
            "its changes, the slowest seen after",
            max(v for k, v in took.items() if k != "created"),
            "s",
            BOUND_S,
            digits=3,
            detail=detail,
        ),
    ]
