"""Requests of a client that sends again what got no answer, through a lossy proxy or across processes that
come and go (the scale-out chaos tests): a lost request is sent again as it was (the same seq, the same
callbackId), so that the gateway's dedup is what keeps it once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import httpx

from tests.support import bearer

# Transient answers a client sends its request again after (no answer at all is one too).
RETRY_STATUSES = (502, 503, 504)


async def until_answered(
    client: httpx.AsyncClient,
    at: Callable[[], str],
    path: str,
    body: dict[str, Any],
    token: str | None = None,
) -> httpx.Response:
    """POST ``body`` to ``at() + path`` until an answer that is not transient comes back."""
    while True:
        try:
            answer = await client.post(at() + path, json=body, headers=bearer(token) if token else None)
        except httpx.HTTPError:
            await anyio.sleep(0.05)
            continue
        if answer.status_code not in RETRY_STATUSES:
            return answer
        await anyio.sleep(0.05)


async def callback(
    client: httpx.AsyncClient,
    at: Callable[[], str],
    task_id: str,
    token: str,
    event: dict[str, Any],
    name: str,
    attempt: int | None = None,
) -> None:
    """A worker's callback on ``task_id`` (callbackId ``<task>-<name>``) until taken: ``200``."""
    body: dict[str, Any] = {"event": event, "callbackId": f"{task_id}-{name}"}
    if attempt is not None:
        body["attempt"] = attempt
    answer = await until_answered(client, at, f"/v1/tasks/{task_id}/callbacks", body, token)
    assert answer.status_code == 200, answer.text
