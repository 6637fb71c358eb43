"""The walkthrough of docs/walkthrough.md in Python, against a real server on each database (the page's own
curl blocks run as written in tests/integration/test_doc_blocks.py, on SQLite)."""

from __future__ import annotations

import pytest

from tests.support import running_gateway


@pytest.mark.anyio
async def test_walkthrough(database_url: str) -> None:
    async with running_gateway(database_url) as gw:
        body = {"id": "report-1", "ttlMs": 60_000, "maxAttempts": 2}
        created = await gw.client.post("/v1/tasks", json=body)
        assert created.status_code == 201
        cb = {"Authorization": f"Bearer {created.json()['callbackToken']}"}
        sub = {"Authorization": f"Bearer {created.json()['subscribeToken']}"}
        for event in (
            {"type": "start", "worker": "w1"},
            {"type": "progress", "progress": 40, "cursor": "row-400"},
            {"type": "succeed", "resultRef": "s3://bucket/report-1", "resultHash": "sha256:ab"},
        ):
            answer = await gw.client.post("/v1/tasks/report-1/callbacks", json={"event": event}, headers=cb)
            assert answer.status_code == 200, answer.text
            assert answer.json()["changed"] is True
        events = await gw.client.get("/v1/tasks/report-1/events", params={"cursor": 1}, headers=sub)
        assert events.status_code == 200
        body = events.json()
        assert body["mode"] == "delta"
        assert [e["version"] for e in body["events"]] == [2, 3]
        assert body["task"]["state"] == "succeeded"
        delivered = await gw.client.post("/v1/tasks/report-1/deliveries", headers={"Idempotency-Key": "k"})
        assert delivered.json()["receipt"]["resultRef"] == "s3://bucket/report-1"
        drained = await gw.client.post("/v1/notifications/drain")
        notes = [(n["taskId"], n["state"], n["version"]) for n in drained.json()]
        assert notes == [("report-1", "succeeded", 3)]
