"""Tasks with tags, and tag tokens, through the HTTP API (for the tests of the clients that follow a tag)."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from tests.support import Created, Running

TERMINAL = {"succeeded", "failed", "expired"}


async def create_tagged(
    gw: Running, task_id: str, tags: list[str], *, ttl_ms: int = 600_000, max_attempts: int = 2
) -> Created:
    """``POST /v1/tasks`` with ``tags``; checks the 201 and that the task carries them."""
    body: dict[str, Any] = {"id": task_id, "ttlMs": ttl_ms, "maxAttempts": max_attempts, "tags": tags}
    answer = await gw.client.post("/v1/tasks", json=body)
    assert answer.status_code == 201, answer.text
    made = Created(answer.json())
    assert made.task["tags"] == sorted(tags), made
    return made


async def tag_token(gw: Running, tag: str) -> str:
    """A tag token for ``tag`` from ``POST /v1/tokens`` (open mode: no API key)."""
    answer = await gw.client.post("/v1/tokens", json={"tag": tag, "ttlS": 3600})
    assert answer.status_code == 201, answer.text
    token: str = answer.json()["token"]
    return token


class Handed:
    """What a tag's follower handed on, per task, checked as it comes: no entry twice, none out of order, a
    snapshot only for a task it did not know."""

    def __init__(self) -> None:
        self.version: dict[str, int] = {}
        self.entries: dict[str, list[int]] = defaultdict(list)
        self.first: dict[str, dict[str, Any]] = {}
        self.task: dict[str, dict[str, Any]] = {}
        self.added: list[str] = []
        self.listings: list[list[str]] = []

    def take(self, frame: dict[str, Any]) -> None:
        kind = frame["type"]
        if kind == "tag":
            self.listings.append(frame["taskIds"])
            return
        if kind == "added":
            self.added.append(frame["taskId"])
            return
        task_id, version = frame["taskId"], frame["version"]
        before = self.version.get(task_id)
        if kind == "snapshot":
            assert before is None and frame["reason"] == "new", (frame, before)
        elif kind == "event":
            assert before is not None and version == before + 1, (frame, before)
            self.entries[task_id].append(version)
        elif kind == "delta":
            assert before is not None, frame
            versions = [entry["version"] for entry in frame["events"]]
            assert versions == list(range(before + 1, version + 1)), (frame, before)
            self.entries[task_id].extend(versions)
        else:
            assert kind == "caught-up" and version == before, (frame, before)
        self.first.setdefault(task_id, frame)
        self.version[task_id] = version
        self.task[task_id] = frame["task"]

    def total(self) -> int:
        return sum(len(versions) for versions in self.entries.values())

    def ended(self, *task_ids: str) -> bool:
        return all(self.task.get(task_id, {}).get("state") in TERMINAL for task_id in task_ids)
