"""A task's streams across gateway processes on one PostgreSQL database (protocol.md, Live: chunks and end,
Order): an append through any process reaches the subscribers of every process, over LISTEN/NOTIFY and over
Redis; and issue 33's chaos run: producers appending through a proxy that loses 30% of the answers (each
batch sent again with its seq until answered), attempts failing and retried, subscribers dropping at random
and resuming from the offsets they hold, one process SIGKILLed. Every subscriber ends with each stream's
``GET .../text``, having seen no gap, no repeat and no earlier attempt's chunk after a later one's
(``tests/support/stream_text.py`` checks every frame)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import anyio
import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import WebSocketException

from tests.integration.test_live_support import loads
from tests.integration.test_scale_out import BUSES, bus_environ, unique
from tests.integration.test_scale_out import pg_url as pg_url
from tests.support import STEP_S, http_client
from tests.support.lossy_proxy import LossyProxy
from tests.support.processes import gateway_processes, round_robin_balancer, start_all
from tests.support.retried import callback, until_answered
from tests.support.stream_text import StreamText

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TEST_S = 90.0


class Producer:
    """A worker of one task: attempts of batches appended to ``output``, each batch's seq sent again until
    answered; a failed attempt (retryable) then a second one, or a success."""

    def __init__(self, task_id: str, token: str, *, batches: int, retried: bool, seed: int) -> None:
        self.task_id, self.token = task_id, token
        self.batches, self.retried = batches, retried
        self.rng = random.Random(seed)
        self.appended = 0  # batches answered 200
        self.duplicates = 0
        self.on_append: Callable[[], None] = lambda: None

    async def run(
        self,
        appends: httpx.AsyncClient,
        appends_at: Callable[[], str],
        calls: httpx.AsyncClient,
        calls_at: Callable[[], str],
    ) -> None:
        """Appends to ``appends_at()``, callbacks to ``calls_at()`` (a process's URL, or a proxy's)."""
        attempts = [1, 2] if self.retried else [1]
        for attempt in attempts:
            await self.callback(
                calls, calls_at, {"type": "start", "worker": f"w{attempt}"}, f"start-{attempt}"
            )
            for seq in range(self.batches):
                chunks = [f"[{self.task_id} a{attempt} b{seq} c{i}]" for i in range(self.rng.randint(1, 5))]
                body = {"attempt": attempt, "seq": seq, "chunks": chunks}
                path = f"/v1/tasks/{self.task_id}/streams/output"
                answer = await until_answered(appends, appends_at, path, body, self.token)
                assert answer.status_code == 200, answer.text
                self.appended += 1
                self.duplicates += answer.json()["duplicate"]
                self.on_append()
            if attempt < attempts[-1]:
                fail = {"type": "fail", "error": "boom", "retryable": True}
                await self.callback(calls, calls_at, fail, f"fail-{attempt}", attempt)
        done = {"type": "succeed", "resultRef": "s3://r", "resultHash": "sha256:1"}
        await self.callback(calls, calls_at, done, "succeed", attempts[-1])

    async def callback(
        self,
        client: httpx.AsyncClient,
        at: Callable[[], str],
        event: dict[str, Any],
        callback_id: str,
        attempt: int | None = None,
    ) -> None:
        await callback(client, at, self.task_id, self.token, event, callback_id, attempt)


class Subscriber:
    """A client of one task's ``output`` on the single-task socket: it drops its connection at random (at
    most ``drops`` times) and resumes from the cursor and offset it holds, until the stream's end."""

    def __init__(self, ws_url: str, task_id: str, token: str, *, drops: int, seed: int) -> None:
        self.ws_url, self.task_id, self.token = ws_url, task_id, token
        self.holder = StreamText(task_id, {"output": 0})
        self.rng = random.Random(seed)
        self.drops_left = drops
        self.cursor = 0
        self.connections = 0
        self.closes: list[int | None] = []
        self.ready = anyio.Event()

    def url(self) -> str:
        query = {
            "cursor": self.cursor,
            "token": self.token,
            "streams": f"output:{self.holder.offsets['output']}",
        }
        return f"{self.ws_url}/v1/tasks/{self.task_id}/ws?{urlencode(query)}"

    async def run(self) -> None:
        while not self.holder.ended:
            self.connections += 1
            self.holder.resubscribed()
            drop_after = self.rng.randint(1, 6) if self.drops_left else None
            try:
                async with connect(self.url(), open_timeout=STEP_S, close_timeout=1) as ws:
                    self.ready.set()
                    received = 0
                    async for raw in ws:
                        frame = loads(raw)
                        self.holder.feed(frame)
                        if frame.get("taskId") == self.task_id and isinstance(frame.get("version"), int):
                            self.cursor = frame["version"]
                        received += 1
                        if drop_after is not None and received >= drop_after:
                            self.drops_left -= 1
                            break  # the client goes away (its phone lost the network)
                    self.closes.append(ws.close_code)
            except (OSError, WebSocketException, TimeoutError):  # a handshake cut short too
                self.closes.append(None)  # its process went away, or the balancer had none to give
                await anyio.sleep(0.1)


async def text_of(client: httpx.AsyncClient, url: str, task_id: str) -> str:
    answer = await client.get(f"{url}/v1/tasks/{task_id}/streams/output/text")
    assert answer.status_code == 200, answer.text
    return answer.text


async def create(client: httpx.AsyncClient, url: str, task_id: str) -> dict[str, Any]:
    answer = await client.post(f"{url}/v1/tasks", json={"id": task_id, "ttlMs": 600_000, "maxAttempts": 2})
    assert answer.status_code == 201, answer.text
    return dict(answer.json())


@pytest.mark.parametrize("bus", BUSES)
async def test_an_append_through_any_process_reaches_the_subscribers_of_every_process(
    bus: str | None, pg_url: str, tmp_path: Path
) -> None:
    env = await bus_environ(bus)
    run = unique("streams")
    with anyio.fail_after(TEST_S):
        async with (
            gateway_processes(3, pg_url, tmp_path, env=env) as gws,
            http_client(timeout=STEP_S) as client,
        ):
            made = await create(client, gws[0].url, run)
            token = made["subscribeToken"]
            subscribers = [Subscriber(gws[i % 3].ws_url, run, token, drops=0, seed=i) for i in range(6)]
            producer = Producer(run, made["callbackToken"], batches=12, retried=True, seed=1)
            rng = random.Random(run)
            async with anyio.create_task_group() as tg:
                await start_all(tg, subscribers)
                anywhere = lambda: rng.choice(gws).url  # noqa: E731  # each request to any process
                await producer.run(client, anywhere, client, anywhere)
            expected = await text_of(client, gws[0].url, run)
    assert expected.startswith(f"[{run} a2 b0 ")
    for subscriber in subscribers:
        assert subscriber.holder.ended and subscriber.holder.texts == {"output": expected}
        assert subscriber.connections == 1 and subscriber.closes == [1000], subscriber.closes
        assert subscriber.holder.streams["output"].restarts[-1] == 2


async def test_chaos_every_subscriber_ends_with_the_text_with_no_gap_repeat_or_earlier_attempt(
    pg_url: str, tmp_path: Path
) -> None:
    tasks, subscribers_count, batches = 20, 50, 8
    run = unique("chaos")
    started = time.monotonic()
    with anyio.fail_after(TEST_S):
        async with (
            gateway_processes(3, pg_url, tmp_path) as gws,
            round_robin_balancer([gw.port for gw in gws]) as lb,
            http_client(timeout=STEP_S) as client,
        ):
            lossy = LossyProxy(int(lb.url.rsplit(":", 1)[1]), loss=0.3, seed=33)
            made = [await create(client, lb.url, f"{run}-{i}") for i in range(tasks)]
            subscribers = [
                Subscriber(
                    lb.ws_url,
                    made[i % tasks]["task"]["id"],
                    made[i % tasks]["subscribeToken"],
                    drops=3,
                    seed=i,
                )
                for i in range(subscribers_count)
            ]
            producers = [
                Producer(m["task"]["id"], m["callbackToken"], batches=batches, retried=i % 3 == 0, seed=i)
                for i, m in enumerate(made)
            ]
            total = sum(batches * (2 if p.retried else 1) for p in producers)
            halfway = anyio.Event()

            def count() -> None:
                if sum(p.appended for p in producers) >= total // 2:
                    halfway.set()

            for producer in producers:
                producer.on_append = count
            async with (
                lossy.running() as lossy_url,
                httpx.AsyncClient(
                    timeout=STEP_S, limits=httpx.Limits(max_keepalive_connections=0)
                ) as appends,
                anyio.create_task_group() as tg,
            ):
                await start_all(tg, subscribers)
                async with anyio.create_task_group() as workers:
                    for producer in producers:
                        workers.start_soon(producer.run, appends, lambda: lossy_url, client, lambda: lb.url)
                    with anyio.fail_after(STEP_S):
                        await halfway.wait()
                    victim = gws[1]
                    await victim.kill()
            survivor = gws[0]
            texts = {m["task"]["id"]: await text_of(client, survivor.url, m["task"]["id"]) for m in made}

    lost = sum(not c.delivered for c in lossy.carried)
    assert lossy.errors == [] or all(isinstance(e, OSError | EOFError) for e in lossy.errors), lossy.errors
    assert lost > 0 and sum(p.duplicates for p in producers) > 0
    for subscriber in subscribers:
        held = subscriber.holder
        assert held.ended, (subscriber.task_id, held.offsets)
        assert held.texts["output"] == texts[subscriber.task_id], subscriber.task_id
    retried = [s for s in subscribers if any(p.retried and p.task_id == s.task_id for p in producers)]
    assert retried and all(s.holder.streams["output"].attempt == 2 for s in retried)
    resumes = sum(s.connections - 1 for s in subscribers)
    print(
        f"\nstreams chaos: {tasks} tasks, {total} batches, {lost} answers lost, "
        f"{sum(p.duplicates for p in producers)} duplicates; {subscribers_count} subscribers, "
        f"{resumes} resumes, "
        f"{sum(s.holder.frames for s in subscribers)} chunks frames; {victim.name} killed; "
        f"{time.monotonic() - started:.1f}s"
    )
