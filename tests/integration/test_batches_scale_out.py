"""Issue 34's acceptance across processes: batches on three gateway processes sharing one PostgreSQL
database, over LISTEN/NOTIFY and over Redis, one process SIGKILLed mid-run. Children are created, started,
patched, ended (succeeded, failed, cancelled, requeued and run again) through any process, their requests
sent again until answered; their parents' metadata is patched too. At every quiet point (no request in
flight) each parent's ``children`` equal a count of its children's states in the store; afterwards every
subscriber (a parent's own socket, and ``/v1/ws`` following the batch with the parent's one token),
reconnecting to a live process after the kill, ends holding each parent's counts and metadata as stored."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import anyio
import httpx
import orjson
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import WebSocketException

from tests.integration.test_live_support import loads
from tests.integration.test_scale_out import BUSES, bus_environ, unique
from tests.integration.test_scale_out import pg_url as pg_url
from tests.support import STEP_S, http_client, wait_until
from tests.support.processes import GatewayProcess, gateway_processes, start_all
from tests.support.retried import callback, until_answered

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TEST_S = 120.0
STATES = ("queued", "running", "succeeded", "failed", "expired")


class Held:
    """What a client holds of the tasks it follows beside their histories: by task, the newest revision's
    metadata and children counts (a frame or task of an older revision is not applied)."""

    def __init__(self) -> None:
        self.revisions: dict[str, int] = {}
        self.metadata: dict[str, Any] = {}
        self.children: dict[str, Any] = {}

    def apply(self, task_id: str, revision: int, **parts: Any) -> None:
        if revision < self.revisions.get(task_id, -1):
            return
        self.revisions[task_id] = revision
        for name, value in parts.items():
            if value is not None:
                getattr(self, name)[task_id] = value

    def feed(self, frame: dict[str, Any]) -> None:
        kind = frame["type"]
        if kind == "metadata":
            self.apply(frame["taskId"], frame["revision"], metadata=frame["metadata"])
        elif kind == "children":
            self.apply(frame["taskId"], frame["revision"], children=frame["children"])
        elif isinstance(frame.get("task"), dict):
            task = frame["task"]
            self.apply(task["id"], task["revision"], metadata=task["metadata"], children=task.get("children"))


class Watcher:
    """A subscriber of one batch that reconnects to a live process after a drop: on the parent's own socket
    (from the last version seen), or on ``/v1/ws`` following the batch with the parent's token."""

    def __init__(self, gws: list[GatewayProcess], parent: str, token: str, *, batch: bool, seed: int) -> None:
        self.gws, self.parent, self.token, self.batch = gws, parent, token, batch
        self.rng = random.Random(seed)
        self.held = Held()
        self.cursor = "0"
        self.connections = 0
        self.frames: Counter[str] = Counter()
        self.ready = anyio.Event()

    def base(self) -> str:
        return self.rng.choice([gw for gw in self.gws if gw.running]).ws_url

    async def run(self) -> None:
        while True:
            try:
                query = urlencode({"cursor": self.cursor, "token": self.token})
                url = (
                    f"{self.base()}/v1/ws"
                    if self.batch
                    else f"{self.base()}/v1/tasks/{self.parent}/ws?{query}"
                )
                async with connect(url, open_timeout=STEP_S, close_timeout=1) as ws:
                    self.connections += 1
                    if self.batch:
                        await ws.send(
                            orjson.dumps({"type": "subscribe", "parent": self.parent, "token": self.token})
                        )
                    async for raw in ws:
                        frame = loads(raw)
                        self.frames[frame["type"]] += 1
                        assert frame["type"] != "error", frame
                        self.held.feed(frame)
                        if frame.get("taskId") == self.parent and isinstance(frame.get("version"), int):
                            self.cursor = f"{frame['version']}:{frame['task']['epoch']}"
                            self.ready.set()
            except (OSError, WebSocketException, TimeoutError):
                pass
            await anyio.sleep(0.1)


class Child:
    """One child's worker: start, a status line, then an end of its kind; every request sent again until
    answered, each callback under its own id."""

    def __init__(self, task_id: str, token: str, kind: str) -> None:
        self.task_id, self.token, self.kind = task_id, token, kind
        self.steps: list[Callable[[httpx.AsyncClient, Callable[[], str]], Any]] = []

    async def callback(
        self,
        client: httpx.AsyncClient,
        at: Callable[[], str],
        event: dict[str, Any],
        name: str,
        attempt: int | None = None,
    ) -> None:
        await callback(client, at, self.task_id, self.token, event, name, attempt)

    async def patch(
        self, client: httpx.AsyncClient, at: Callable[[], str], attempt: int, message: str
    ) -> None:
        body = {"attempt": attempt, "patch": {"message": message}}
        answer = await until_answered(client, at, f"/v1/tasks/{self.task_id}/metadata", body, self.token)
        assert answer.status_code == 200, answer.text

    async def first_half(self, client: httpx.AsyncClient, at: Callable[[], str]) -> None:
        if self.kind == "idle":
            return
        await self.callback(client, at, {"type": "start", "worker": "w"}, "start-1")
        await self.patch(client, at, 1, f"{self.task_id}: working")

    async def second_half(self, client: httpx.AsyncClient, at: Callable[[], str]) -> None:
        done = {"type": "succeed", "resultRef": "s3://r", "resultHash": "sha256:1"}
        if self.kind == "succeed":
            await self.callback(client, at, done, "succeed", 1)
        elif self.kind == "fail":
            await self.callback(client, at, {"type": "fail", "error": "boom", "retryable": False}, "fail", 1)
        elif self.kind == "cancel":
            answer = await until_answered(client, at, f"/v1/tasks/{self.task_id}/cancel", {})
            assert answer.status_code == 200, answer.text
        elif self.kind == "retry":
            await self.callback(
                client, at, {"type": "fail", "error": "flaky", "retryable": True}, "fail-1", 1
            )
            await self.callback(client, at, {"type": "start", "worker": "w"}, "start-2")
            await self.patch(client, at, 2, f"{self.task_id}: again")
            await self.callback(client, at, done, "succeed", 2)


async def counted(client: httpx.AsyncClient, url: str, parent: str) -> tuple[dict[str, Any], dict[str, int]]:
    """The parent as stored, and a count of its children's states read from their rows."""
    answer = await client.get(f"{url}/v1/tasks/{parent}")
    assert answer.status_code == 200, answer.text
    listed = await client.get(f"{url}/v1/tasks", params={"parent": parent, "limit": 500})
    assert listed.status_code == 200, listed.text
    states = Counter(t["state"] for t in listed.json()["tasks"])
    return answer.json(), {"total": sum(states.values()), **{s: states[s] for s in STATES}}


async def quiet_point(client: httpx.AsyncClient, url: str, parents: list[str]) -> dict[str, dict[str, Any]]:
    """No request in flight: each parent's counts equal a count of its children's states in the store."""
    stored = {}
    for parent in parents:
        task, counts = await counted(client, url, parent)
        assert task["children"] == counts, (parent, task["children"], counts)
        stored[parent] = task
    return stored


@pytest.mark.parametrize("bus", BUSES)
async def test_a_batchs_counts_stay_exact_and_reach_every_subscriber_through_a_sigkill(
    bus: str | None, pg_url: str, tmp_path: Path
) -> None:
    env = {**await bus_environ(bus), "GATEWAY_RECONCILE_INTERVAL_MS": "500"}
    run = unique("batch")
    rng = random.Random(run)
    kinds = ["succeed", "fail", "cancel", "retry", "idle"]
    with anyio.fail_after(TEST_S):
        async with (
            gateway_processes(3, pg_url, tmp_path, env=env) as gws,
            http_client(timeout=STEP_S) as client,
        ):

            def live() -> str:
                return rng.choice([gw for gw in gws if gw.running]).url

            parents: list[str] = []
            tokens: dict[str, str] = {}
            for i in range(3):
                made = await until_answered(
                    client, live, "/v1/tasks", {"id": f"{run}-p{i}", "ttlMs": 600_000, "title": f"Import {i}"}
                )
                assert made.status_code == 201, made.text
                parents.append(made.json()["task"]["id"])
                tokens[parents[-1]] = made.json()["subscribeToken"]
                start = {"event": {"type": "start", "worker": "boss"}, "callbackId": f"{parents[-1]}-start"}
                answer = await until_answered(
                    client, live, f"/v1/tasks/{parents[-1]}/callbacks", start, made.json()["callbackToken"]
                )
                assert answer.status_code == 200
            watchers = [
                Watcher(gws, parent, tokens[parent], batch=batch, seed=n)
                for n, (parent, batch) in enumerate((p, b) for p in parents for b in (False, True, True))
            ]
            children: list[Child] = []
            async with anyio.create_task_group() as following:
                await start_all(following, watchers)

                async def make(parent: str, n: int) -> None:
                    child_id = f"{parent}-c{n}"
                    body = {
                        "id": child_id,
                        "ttlMs": 600_000,
                        "maxAttempts": 2,
                        "parent": parent,
                        "title": f"file {n}",
                    }
                    answer = await until_answered(client, live, "/v1/tasks", body)
                    assert answer.status_code in (200, 201), answer.text
                    children.append(Child(child_id, answer.json()["callbackToken"], kinds[n % len(kinds)]))

                async with anyio.create_task_group() as tg:
                    for parent in parents:
                        for n in range(10):
                            tg.start_soon(make, parent, n)
                await quiet_point(client, live(), parents)
                async with anyio.create_task_group() as tg:
                    for child in children:
                        tg.start_soon(child.first_half, client, live)
                    for parent in parents:
                        body: dict[str, Any] = {"patch": {"message": "half done"}}
                        tg.start_soon(until_answered, client, live, f"/v1/tasks/{parent}/metadata", body)
                await quiet_point(client, live(), parents)
                ended = anyio.Event()
                answered: list[Child] = []

                async def end(child: Child) -> None:
                    await child.second_half(client, live)
                    answered.append(child)
                    if len(answered) >= len(children) // 3:
                        ended.set()

                async with anyio.create_task_group() as tg:
                    for child in children:
                        tg.start_soon(end, child)
                    with anyio.fail_after(STEP_S):
                        await ended.wait()  # a third of them answered: the kill falls among the others
                    victim = gws[1]
                    await victim.kill()
                    for parent in parents:
                        body = {"patch": {"message": "after the kill", "half": None}}
                        tg.start_soon(until_answered, client, live, f"/v1/tasks/{parent}/metadata", body)
                survivor = gws[0].url
                stored = await quiet_point(client, survivor, parents)

                def ended_on_the_store() -> bool:
                    return all(
                        w.held.children.get(w.parent) == stored[w.parent]["children"]
                        and w.held.metadata.get(w.parent) == stored[w.parent]["metadata"]
                        for w in watchers
                    )

                await wait_until(ended_on_the_store, "every subscriber on the stored counts and metadata")
                # Those following the batch hold each child's metadata as stored too.
                for w in watchers:
                    if w.batch:
                        for child in (c for c in children if c.task_id.startswith(f"{w.parent}-c")):
                            answer = await client.get(f"{survivor}/v1/tasks/{child.task_id}")
                            assert w.held.metadata.get(child.task_id) == answer.json()["metadata"], (
                                child.task_id
                            )
                following.cancel_scope.cancel()
    for parent in parents:
        assert stored[parent]["children"]["total"] == 10
        assert stored[parent]["metadata"] == {"message": "after the kill"}
    moved = sum(w.connections > 1 for w in watchers)
    assert moved >= 1, "some subscriber was on the killed process, and came back on another"
    print(
        f"\nbatches ({bus or 'postgres'}): {len(children)} children of {len(parents)} parents, {victim.name} "
        f"killed, {moved} of {len(watchers)} subscribers reconnected; frames "
        f"{dict(sum((w.frames for w in watchers), start=Counter[str]()))}"
    )
