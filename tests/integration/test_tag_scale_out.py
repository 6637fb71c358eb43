"""Tag subscriptions across processes: issue 18's acceptance test.

Three ``gateway serve`` processes on one PostgreSQL database (tests/support/processes.py), with each bus.
Twenty clients follow four tags on ``/v1/ws`` (five per tag, spread over the processes; some tasks carry two
tags), each keeping its cursors map and reconnecting with it, to another process, when its socket drops
(tests/support/tag_subscriber.py checks every frame as it comes). Tasks are created and driven through
processes picked at random, and creates go on during the run, so that every process announces tasks
(``added``) created on the others. The process serving the most of these clients is SIGKILLed mid-run. What is
asserted:

- every client ends holding every task of its tag, each exactly as the store has it at its final version;
- per task, the frames a client got (resume frames included, over every connection) chain without gap or
  repeat, and each connection's frames keep the contract's order (listing, resume frames in its order,
  then ``added`` and events); each task is ``added`` at most once per subscription, and every task a
  client knows was listed or added;
- tests/support/history.py's invariants hold for every task (callbacks answered 2xx in the history exactly
once,
  one terminal state, one notification).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
import pytest

from tests.integration.test_live_support import STEP_S
from tests.integration.test_scale_out import BUSES, bus_environ, drain, get_task, history, unique
from tests.support import http_client, postgres_database
from tests.support.history import History
from tests.support.processes import (
    CallbackPoster,
    GatewayProcess,
    assert_history_is,
    gateway_processes,
    task_callbacks,
)
from tests.support.tag_subscriber import TagSubscriber

pytestmark = pytest.mark.anyio

# Bounds the whole test (process start-up included); it aims at well under it.
TEST_S = 120.0
TAGS = 4
PER_TAG = 5  # clients per tag
BEFORE = 8  # tasks created before the clients subscribe
DURING = 12  # tasks created during the run: half before the kill, half after
PROGRESS = range(10, 100, 10)  # a worker's run: start, these 9, succeed
PACE_S = 0.03  # between a worker's callbacks (its pace, not a wait for anything)
CREATE_PACE_S = 0.05  # between the creates during the run
KILL_AFTER = 4  # callbacks answered for each task created before the clients, before the kill
RETENTION = 1000  # every resume is a delta (or caught-up), checked as such


@pytest.fixture
def pg_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


def tags_of(k: int, tags: list[str]) -> list[str]:
    """Task k carries tag k % 4; every third task also the next one."""
    first = tags[k % len(tags)]
    return [first, tags[(k + 1) % len(tags)]] if k % 3 == 0 else [first]


async def tag_token(client: httpx.AsyncClient, url: str, tag: str) -> str:
    answer = await client.post(f"{url}/v1/tokens", json={"tag": tag, "ttlS": 3600})
    assert answer.status_code == 201, answer.text
    token = answer.json()["token"]
    assert isinstance(token, str), answer.text
    return token


async def create_tagged(
    client: httpx.AsyncClient, url: Callable[[], str], task_id: str, tags: list[str]
) -> dict[str, Any]:
    """``POST /v1/tasks`` with ``tags`` to a process picked by ``url``, again (same body) on another after a
    transport error: a create whose answer was lost is answered ``200`` with the same task."""
    body = {"id": task_id, "ttlMs": 600_000, "maxAttempts": 2, "tags": tags}
    give_up = anyio.current_time() + STEP_S
    while True:
        try:
            answer = await client.post(f"{url()}/v1/tasks", json=body)
        except httpx.TransportError as exc:
            assert anyio.current_time() < give_up, (
                f"{task_id}: no answer to its create within {STEP_S}s: {exc}"
            )
            await anyio.sleep(0.05)  # a retry's backoff
            continue
        assert answer.status_code in (200, 201), answer.text
        made: dict[str, Any] = answer.json()
        assert made["task"]["tags"] == sorted(tags), made
        return made


@pytest.mark.postgres
@pytest.mark.parametrize("bus", BUSES)
async def test_tag_subscribers_follow_every_task_through_a_process_kill(
    bus: str | None, pg_url: str, tmp_path: Path
) -> None:
    env = {**await bus_environ(bus), "GATEWAY_RETENTION_VERSIONS": str(RETENTION)}
    run = unique("tags")
    tags = [f"owner:{run}-u{i}" for i in range(TAGS)]
    ids = [f"{run}-{k}" for k in range(BEFORE + DURING)]
    seen = History()
    rng = random.Random(f"tags-{bus}")  # the same picks each run
    started = killed_at = time.monotonic()
    with anyio.fail_after(TEST_S):
        async with (
            gateway_processes(3, pg_url, tmp_path, env=env) as gws,
            http_client(timeout=STEP_S) as client,
        ):

            def live() -> str:
                """A process picked at random among those running."""
                return rng.choice([gw for gw in gws if gw.running]).url

            tokens = {tag: await tag_token(client, gws[0].url, tag) for tag in tags}
            made: dict[str, dict[str, Any]] = {}
            posters: dict[str, CallbackPoster] = {}
            halfway = anyio.Event()

            def check_halfway() -> None:
                if all(len(posters[t].applied) >= KILL_AFTER for t in ids[:BEFORE]):
                    halfway.set()

            async def create(k: int) -> CallbackPoster:
                task_id = ids[k]
                made[task_id] = await create_tagged(client, live, task_id, tags_of(k, tags))
                seen.created(made[task_id]["task"])
                poster = CallbackPoster(client, task_id, made[task_id]["callbackToken"], live, history=seen)
                posters[task_id] = poster
                return poster

            def drive(workers: anyio.abc.TaskGroup, poster: CallbackPoster) -> None:
                calls = task_callbacks(poster.task_id, PROGRESS)
                workers.start_soon(partial(poster.run, calls, pace_s=PACE_S, after_each=check_halfway))

            before = [await create(k) for k in range(BEFORE)]
            subscribers = [
                TagSubscriber(
                    f"sub-{i}",
                    tags[i % TAGS],
                    tokens[tags[i % TAGS]],
                    gws,
                    start=i % len(gws),
                    history=seen,
                    retention=RETENTION,
                )
                for i in range(TAGS * PER_TAG)
            ]
            victim: GatewayProcess | None = None
            on_victim: list[TagSubscriber] = []
            applied_at_kill = 0
            async with anyio.create_task_group() as clients:
                for subscriber in subscribers:
                    clients.start_soon(subscriber.run)
                with anyio.fail_after(STEP_S):
                    for subscriber in subscribers:
                        await subscriber.ready.wait()
                async with anyio.create_task_group() as workers:
                    for poster in before:
                        drive(workers, poster)
                    for k in range(BEFORE, BEFORE + DURING // 2):
                        await anyio.sleep(CREATE_PACE_S)  # creates go on during the run, at a pace
                        drive(workers, await create(k))
                    with anyio.fail_after(STEP_S):
                        await halfway.wait()
                    # The process serving the most clients now.
                    serving = Counter(s.connected_to for s in subscribers if s.connected_to is not None)
                    victim = max(gws, key=lambda gw: serving[gw])
                    on_victim = [s for s in subscribers if s.connected_to is victim]
                    applied_at_kill = sum(len(p.applied) for p in posters.values())
                    await victim.kill()
                    killed_at = time.monotonic()
                    for k in range(BEFORE + DURING // 2, BEFORE + DURING):
                        await anyio.sleep(CREATE_PACE_S)
                        drive(workers, await create(k))
                assert victim is not None
                survivor = next(gw for gw in gws if gw is not victim)
                finals = {t: await get_task(client, survivor.url, t) for t in ids}
                for subscriber in subscribers:
                    subscriber.expect(
                        {t: task["version"] for t, task in finals.items() if subscriber.tag in task["tags"]}
                    )
                with anyio.move_on_after(STEP_S * 2):
                    for subscriber in subscribers:
                        await subscriber.complete.wait()
                clients.cancel_scope.cancel()
            recovered_s = time.monotonic() - killed_at
            assert all(gw.running for gw in gws if gw is not victim), "only the victim may be gone"
            histories = {t: await history(client, survivor.url, t) for t in ids}
            for item in await drain(client, survivor.url):
                seen.notification(item)

    for task_id, entries in histories.items():
        seen.final(task_id, entries)
    assert victim is not None
    # tests/support/history.py: every stream gapless across connections, and the store's invariants
    seen.check()
    assert applied_at_kill < sum(len(p.applied) for p in posters.values()), "the kill came after the run"
    for k, task_id in enumerate(ids):
        poster = posters[task_id]
        assert finals[task_id]["state"] == "succeeded", finals[task_id]
        assert finals[task_id]["tags"] == sorted(tags_of(k, tags)), finals[task_id]
        assert poster.server_errors == [], poster.server_errors
        assert_history_is(histories[task_id], poster.applied)
    for subscriber in subscribers:
        expected = {t: task for t, task in finals.items() if subscriber.tag in task["tags"]}
        missing = {t: (subscriber.tasks.get(t, {}).get("version"), v["version"]) for t, v in expected.items()}
        assert subscriber.tasks == expected, (
            f"{subscriber.name} ({subscriber.tag}) after {subscriber.connections} connections "
            f"(closes {subscriber.closes}, to {subscriber.urls}): held vs final versions {missing}"
        )
    # Every process announced tasks made on the others (creates went on, through every process).
    added = sum((s.added for s in subscribers), start=Counter[str]())
    assert all(added[gw.url] > 0 for gw in gws), (added, [gw.url for gw in gws])
    # The clients of the killed process went on elsewhere, with their cursors.
    assert on_victim, "the victim served no client"
    for subscriber in on_victim:
        assert subscriber.connections >= 2 and subscriber.urls[-1] != victim.url, (
            subscriber.name,
            subscriber.urls,
            subscriber.closes,
        )
    resumes = sum((s.resumes for s in subscribers), start=Counter[str]())
    print(
        f"\nkilled {victim.name} serving {len(on_victim)} of {len(subscribers)} tag clients "
        f"({bus or 'postgres'}); all exact {recovered_s:.1f}s after the kill; added by process "
        f"{dict(added)}; resume frames {dict(resumes)}; callback answers "
        f"{dict(sum((p.answers for p in posters.values()), start=Counter[str]()))}; "
        f"{time.monotonic() - started:.1f}s in all"
    )
