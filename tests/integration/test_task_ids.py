"""What a task id may be (protocol.md, Create): one rule where an id is made and wherever one comes in.

An id has no control character (Unicode category Cc: C0, DEL and C1, such as U+0085) and is in Unicode
normalization form C, so that two ids that look the same are the same id: ``café`` sent decomposed (``e`` +
U+0301) is refused with the composed form named, not made a second task beside ``café``. The gateway does
not normalize an id itself: a backend may have minted tokens for the id it sent.

An id no task can have is what any id of no task is: ``404 unknown-task`` in every route's path (after the
credential), ``4404`` on the single-task socket, ``unknown-task`` in a ``/v1/ws`` subscribe.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import anyio
import pytest

from tests.integration.test_live_support import closed_with, live_gateway, recv_frame, socket, ws_url
from tests.support import Running, bearer, error, mint

pytestmark = pytest.mark.anyio

API_KEY = "task-ids-api-key"
NFC = "caf\u00e9"
NFD = "cafe\u0301"
# Ids no task can have, beside those refused before (a slash, C0 controls, over 128 characters).
IMPOSSIBLE = ["a\u0085b", "\u009f", "x\u007fy", NFD, "\u212b"]  # the last: ANGSTROM SIGN, NFC is U+00C5


async def create(gw: Running, task_id: str) -> tuple[int, dict[str, object]]:
    answer = await gw.client.post(
        "/v1/tasks", json={"id": task_id, "ttlMs": 60_000, "maxAttempts": 1}, headers=bearer(API_KEY)
    )
    return answer.status_code, answer.json()


async def test_an_id_with_a_control_character_or_not_in_nfc_is_refused_at_create(sqlite_url: str) -> None:
    async with live_gateway(sqlite_url, api_key=API_KEY) as gw:
        status, body = await create(gw, "a\u0085b")
        assert status == 400, body
        assert body == {
            "error": {
                "code": "invalid-request",
                "message": "id: must not contain control characters (U+0085)",
            }
        }
        status, body = await create(gw, NFD)
        assert status == 400, body
        nfc_form = f"id: must be in Unicode normalization form C (NFC): send {NFC!r}, which looks the same"
        assert body["error"] == {"code": "invalid-request", "message": nfc_form}
        for task_id in IMPOSSIBLE:
            status, body = await create(gw, task_id)
            assert status == 400 and body["error"]["code"] == "invalid-request", (task_id, body)  # type: ignore[index]
        # The composed form is an ordinary id; a non-Latin one in NFC too.
        for task_id in (NFC, "\u00c5", "\u65e5\u672c-42", "emoji-\U0001f600"):
            status, body = await create(gw, task_id)
            assert status == 201, (task_id, body)
        listed = await gw.client.get("/v1/tasks", headers=bearer(API_KEY))
        assert sorted(t["id"] for t in listed.json()["tasks"]) == sorted(
            [NFC, "\u00c5", "\u65e5\u672c-42", "emoji-\U0001f600"]
        )


async def test_an_id_no_task_can_have_is_an_unknown_task_in_every_path(sqlite_url: str) -> None:
    """Even with a valid token for it (a backend can mint one for any id): the credential is checked first,
    then the id, as for any task that does not exist."""
    async with live_gateway(sqlite_url, api_key=API_KEY) as gw:
        for task_id in IMPOSSIBLE:
            path = "/v1/tasks/" + quote(task_id, safe="")
            reads = bearer(mint(task_id, "subscribe"))
            for method, url, headers, body in (
                ("GET", path, reads, None),
                ("GET", path + "/events?cursor=0", reads, None),
                ("GET", path + "/stream", reads, None),
                (
                    "POST",
                    path + "/callbacks",
                    bearer(mint(task_id, "callback")),
                    {"event": {"type": "start", "worker": "w"}},
                ),
                ("POST", path + "/deliveries", {**bearer(API_KEY), "Idempotency-Key": "k"}, None),
            ):
                answer = await gw.client.request(method, url, headers=headers, json=body)
                message = error(answer, 404, "unknown-task")
                assert task_id in message, (task_id, url, message)
            # Credentials first: no token is still 401, another task's token 403.
            error(await gw.client.get(path), 401, "unauthorized")
            error(await gw.client.get(path, headers=bearer(mint("other"))), 403, "forbidden")

            with anyio.fail_after(10):
                async with socket(
                    ws_url(gw, f"/v1/tasks/{quote(task_id, safe='')}/ws", token=mint(task_id))
                ) as ws:
                    frames, closed = await closed_with(ws)
                assert [(f["type"], f["code"], f["taskId"]) for f in frames] == [
                    ("error", "unknown-task", task_id)
                ]
                assert closed == 4404
                async with socket(ws_url(gw, "/v1/ws")) as ws:
                    await ws.send(
                        json.dumps({"type": "subscribe", "taskId": task_id, "token": mint(task_id)})
                    )
                    frame = await recv_frame(ws)
                    assert (frame["type"], frame["code"], frame["taskId"]) == (
                        "error",
                        "unknown-task",
                        task_id,
                    )
