"""The ordering guarantee under a race (protocol.md, WebSocket): subscribers join a task at random moments
while callbacks are committed concurrently, with every kind of cursor, and each one still sees every
version exactly once, in order, and ends with the task's exact final state and a ``1000`` close.

300 callbacks (cycles of a start, a run of progress steps and a retryable failure, so that many of them
change the task) are posted with up to 16 in flight; 30 subscribers each connect once a seeded random
number of callbacks has been answered, with a cursor of 0, the newest version seen, an older one, or one
ahead of anything the task will reach. Runs on SQLite and PostgreSQL, with the default retention (8
versions: old cursors get snapshots) and with a retention that keeps every cursor within a delta.
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import pytest

from tests.integration.test_live_support import (
    StreamCheck,
    get_task,
    live_gateway,
    read_to_close,
    recv_frame,
    socket,
    ws_url,
)
from tests.support import create_task, post_callback

CALLBACKS = 300
SUBSCRIBERS = 30
IN_FLIGHT = 16
AHEAD = 100_000  # beyond any version this test can reach
DEADLINE_S = 40


def planned_events(rng: random.Random) -> list[dict[str, Any]]:
    """300 events in cycles of start, 3-25 increasing progress steps, retryable failure."""
    events: list[dict[str, Any]] = []
    cycle = 0
    while len(events) < CALLBACKS:
        cycle += 1
        events.append({"type": "start", "worker": f"w{cycle}"})
        steps = sorted(rng.sample(range(1, 101), rng.randint(3, 25)))
        events += [{"type": "progress", "progress": p, "cursor": f"{cycle}:{p}"} for p in steps]
        events.append({"type": "fail", "error": f"boom {cycle}", "retryable": True})
    return events[:CALLBACKS]


@pytest.mark.anyio
@pytest.mark.parametrize("retention", [8, 10_000], ids=["retention-8", "retention-all"])
async def test_subscribers_joining_during_a_burst_see_each_version_once_in_order(
    database_url: str, retention: int
) -> None:
    rng = random.Random(f"live-race-{retention}")
    events = planned_events(rng)
    thresholds = sorted(rng.sample(range(CALLBACKS), SUBSCRIBERS))
    kinds = (["zero", "current", "old", "ahead"] * SUBSCRIBERS)[:SUBSCRIBERS]
    rng.shuffle(kinds)

    # A burst on one task, faster than the per-task callback rate allows: that limit is lifted here.
    async with live_gateway(database_url, retention_versions=retention) as gw:
        made = await create_task(gw, "race", max_attempts=10_000)
        token, sub_token = made["callbackToken"], made["subscribeToken"]
        answered = 0
        newest = 0  # the newest version any answer has shown: committed, so never ahead of the task
        waiting: list[tuple[int, anyio.Event]] = [(t, anyio.Event()) for t in thresholds]
        resumed = [anyio.Event() for _ in range(SUBSCRIBERS)]
        checks: list[StreamCheck | None] = [None] * SUBSCRIBERS
        close_codes: list[int | None] = [None] * SUBSCRIBERS
        limiter = anyio.CapacityLimiter(IN_FLIGHT)

        async def post(event: dict[str, Any]) -> None:
            nonlocal answered, newest
            async with limiter:
                answer = await post_callback(gw, "race", token, event)
            newest = max(newest, answer["task"]["version"])
            answered += 1
            for threshold, ready in waiting:
                if threshold <= answered:
                    ready.set()

        def cursor_for(kind: str) -> int:
            if kind == "zero":
                return 0
            if kind == "current":
                return newest
            if kind == "old":
                return max(0, newest - rng.randint(1, 20))
            return newest + AHEAD

        async def subscriber(i: int) -> None:
            await waiting[i][1].wait()
            cursor = cursor_for(kinds[i])
            check = checks[i] = StreamCheck("race", cursor, retention=retention)
            async with socket(ws_url(gw, "/v1/tasks/race/ws", cursor=cursor, token=sub_token)) as ws:
                check.feed(await recv_frame(ws))
                resumed[i].set()
                close_codes[i] = await read_to_close(ws, check)

        with anyio.fail_after(DEADLINE_S):
            async with anyio.create_task_group() as tg:
                for i in range(SUBSCRIBERS):
                    tg.start_soon(subscriber, i)
                await post_callback(gw, "race", token, {"type": "start", "worker": "w0"})
                async with anyio.create_task_group() as burst:
                    for event in events:
                        burst.start_soon(post, event)
                for ready in resumed:
                    await ready.wait()
                # Then the task is succeeded: from whatever state the burst left it in.
                if (await get_task(gw, "race"))["state"] == "queued":
                    await post_callback(gw, "race", token, {"type": "start", "worker": "last"})
                done = {"type": "succeed", "resultRef": "s3://race", "resultHash": "h"}
                assert (await post_callback(gw, "race", token, done))["reason"] == "succeeded"

        final = await get_task(gw, "race")
        assert final["state"] == "succeeded"
        assert final["version"] > SUBSCRIBERS, "the burst should change the task many times"
        for i, check in enumerate(checks):
            assert check is not None and check.resume is not None
            check.assert_final(final)
            assert close_codes[i] == 1000, (i, kinds[i], close_codes[i])
            if kinds[i] == "ahead":
                assert check.resume["type"] == "snapshot" and check.resume["reason"] == "cursor-ahead"
            # Every version after the resume frame arrived as an event, unless a snapshot covered it.
            if check.conflated == 0:
                assert check.event_versions == list(range(check.resume["version"] + 1, final["version"] + 1))
