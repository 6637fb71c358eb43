"""Gateways recover from a PostgreSQL restart by themselves.

Two ``gateway serve`` processes share a throwaway PostgreSQL cluster of the test's own
(tests/support/processes.py), never this machine's shared one. Mid-run the test stops PostgreSQL for a few
seconds and starts it again on the same port and data directory. Meanwhile a callback is answered ``503
unavailable`` with ``Retry-After`` (never a 500), ``/readyz`` is not 200; afterwards ``/readyz`` is 200 again,
every callback answered 2xx is in its task's history once, every subscriber ends at its task's exact final
state with no gap, and neither gateway process was restarted: their pools and bus listeners reconnect.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from functools import partial
from itertools import cycle
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from tests.integration.test_live_support import STEP_S
from tests.support import http_client
from tests.support.history import History
from tests.support.processes import (
    CallbackPoster,
    GatewayProcess,
    ResumingSubscriber,
    assert_history_is,
    gateway_processes,
    start_all,
    task_callbacks,
    throwaway_postgres,
)

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

# How long PostgreSQL stays down once both gateways have noticed (the scenario's outage, not a wait).
OUTAGE_S = 3.0
# How long the gateways may take to notice PostgreSQL is back (pool, bus listener with its backoff).
RECOVERY_S = 20.0
TEST_S = 90.0


async def ready_status(client: httpx.AsyncClient, gw: GatewayProcess) -> int:
    try:
        return (await client.get(f"{gw.url}/readyz")).status_code
    except httpx.TransportError:
        return 0


async def wait_ready(
    client: httpx.AsyncClient, gws: list[GatewayProcess], ready: bool
) -> dict[str, set[int]]:
    """Poll ``/readyz`` on every gateway until each answers 200 (``ready``) or anything else; the statuses
    seen. (Readiness is only known by asking.)"""
    seen: dict[str, set[int]] = {gw.name: set() for gw in gws}
    pending = list(gws)
    while pending:
        for gw in tuple(pending):
            status = await ready_status(client, gw)
            seen[gw.name].add(status)
            if (status == 200) == ready:
                pending.remove(gw)
        if pending:
            await anyio.sleep(0.05)
    return seen


async def test_gateways_recover_from_a_postgresql_restart_by_themselves(tmp_path: Path) -> None:
    run = f"pgr-{uuid.uuid4().hex[:8]}"
    seen = History()  # tests/support/history.py: every frame and answer the clients saw, checked at the end
    started = time.monotonic()
    with anyio.fail_after(TEST_S):
        async with (
            throwaway_postgres() as pg,
            gateway_processes(2, pg.url, tmp_path, env={"GATEWAY_RETENTION_VERSIONS": "1000"}) as gws,
            http_client(timeout=STEP_S) as client,
        ):
            pids = [gw.pid for gw in gws]
            made: list[dict[str, Any]] = []
            for i in range(2):
                answer = await client.post(
                    f"{gws[i].url}/v1/tasks", json={"id": f"{run}-{i}", "ttlMs": 600_000, "maxAttempts": 2}
                )
                assert answer.status_code == 201, answer.text
                made.append(answer.json())
                seen.created(answer.json()["task"])
            # Two subscribers per task on each gateway.
            subscribers = [
                ResumingSubscriber(
                    gw.ws_url,
                    m["task"]["id"],
                    m["subscribeToken"],
                    m["task"],
                    retention=1000,
                    history=seen,
                    name=f"sub-{gw.name}-{i}-{j}",
                )
                for gw in gws
                for i, m in enumerate(made)
                for j in range(2)
            ]
            # Each worker posts its callbacks to the two gateways in turn.
            posters = [
                CallbackPoster(
                    client,
                    m["task"]["id"],
                    m["callbackToken"],
                    partial(next, cycle([gw.url for gw in gws])),
                    history=seen,
                )
                for m in made
            ]
            begun = anyio.Event()

            def check_begun() -> None:
                if all(len(p.applied) >= 3 for p in posters):
                    begun.set()

            async with anyio.create_task_group() as tg:
                await start_all(tg, subscribers)
                for poster in posters:
                    calls = task_callbacks(poster.task_id, range(5, 100, 5))  # 21 callbacks
                    tg.start_soon(partial(poster.run, calls, pace_s=0.1, after_each=check_begun))

                with anyio.fail_after(STEP_S):
                    await begun.wait()
                await pg.stop()
                down_at = time.monotonic()
                with anyio.fail_after(STEP_S):
                    down = await wait_ready(client, gws, ready=False)
                    for poster in posters:
                        await poster.unavailable.wait()
                await anyio.sleep(max(0.0, down_at + OUTAGE_S - time.monotonic()))  # the rest of the outage
                await pg.start()
                up_at = time.monotonic()
                with anyio.fail_after(RECOVERY_S):
                    up = await wait_ready(client, gws, ready=True)
                ready_again_s = time.monotonic() - up_at
            done_s = time.monotonic() - up_at

            finals, histories = {}, {}
            for m in made:
                task_id = m["task"]["id"]
                finals[task_id] = (await client.get(f"{gws[0].url}/v1/tasks/{task_id}")).json()
                answer = await client.get(f"{gws[1].url}/v1/tasks/{task_id}/events", params={"cursor": 0})
                histories[task_id] = answer.json()
                seen.final(task_id, histories[task_id])
            drained = await client.post(f"{gws[0].url}/v1/notifications/drain")
            assert drained.status_code == 200, drained.text
            for item in drained.json():
                seen.notification(item)
            assert all(gw.running for gw in gws), "a gateway exited"
            assert [gw.pid for gw in gws] == pids
            starts = [gw.started_pids() for gw in gws]

    assert starts == [[pid] for pid in pids], f"a gateway process was restarted: {starts}"
    # While PostgreSQL was down each gateway answered /readyz, and not with 200: with 503.
    assert all(statuses - {200} == {503} for statuses in down.values()), down
    assert all(200 in statuses for statuses in up.values()), up
    for poster in posters:
        assert poster.server_errors == [], poster.server_errors  # never a 500
        assert "transport" not in poster.answers, poster.answers  # every try answered, none hung or dropped
        assert poster.no_retry_after == [], poster.no_retry_after
        assert poster.answers["503"] >= 1, poster.answers
        assert finals[poster.task_id]["state"] == "succeeded", finals[poster.task_id]
        assert_history_is(histories[poster.task_id], poster.applied)
    for subscriber in subscribers:
        subscriber.assert_final(finals[subscriber.task_id])
    seen.check()
    answers = sum((p.answers for p in posters), start=Counter[str]())
    drops = sorted({str(c) for s in subscribers for c in s.closes[:-1]})
    print(
        f"\nPostgreSQL down {up_at - down_at:.1f}s: /readyz while down {down}, ready again "
        f"{ready_again_s:.1f}s after the start, all done {done_s:.1f}s after it; callback answers "
        f"{dict(answers)}, {sum(p.duplicates for p in posters)} duplicateCallback; subscriber connections "
        f"{[s.connections for s in subscribers]}, earlier closes {drops}; "
        f"{time.monotonic() - started:.1f}s in all"
    )
