"""Leases end on time under load (protocol.md, Heartbeat leases: within 1 s of their end), against
``gateway serve`` on SQLite and on PostgreSQL, under the load of the expiry test (test_expiry_load.py,
whose gateway, busy workers and histogram reader this reuses).

300 tasks with 2 s leases (and an hour to live) are created and started while 20 busy workers
(tests/support/busy_workers.py, a process of their own) post callbacks as fast as the gateway answers them;
then their workers vanish (nothing renews the leases). Each lease must be seen ended within 1 s of its own end
(the start's ``leaseUntilMs``), measured two ways, both asserted:

- **pushed**: a subscriber per task on a real WebSocket; a task's time is the arrival of the ``fail`` entry
  (``heartbeat-timeout``, stamped at the lease's end) on this machine's wall clock;
- **committed**: the gateway's own ``gateway_lease_lateness_seconds`` histogram (``/metrics``), from a
  lease's end to the commit of its fail.

With one attempt each, every task ends ``failed``: its subscription closes after that frame.
"""

from __future__ import annotations

import json
import os
from typing import Any

import anyio
import anyio.abc
import pytest
from websockets.asyncio.client import connect

from tests.integration.test_expiry_load import (
    BOUND_MS,
    CREATORS,
    WORKERS,
    busy_workers,
    commit_lateness,
    figures,
    gateway,
    wall_ms,
)
from tests.support import bearer, http_client

LEASES = 300
HEARTBEAT_MS = 2_000
METRIC = "gateway_lease_lateness_seconds"


@pytest.mark.anyio
async def test_every_lease_ends_within_a_second_of_its_end_under_twenty_busy_workers(
    database_url: str, tmp_path: Any, record_property: Any
) -> None:
    ends: dict[str, int] = {}
    pushed: dict[str, int] = {}
    subscribed: dict[str, int] = {}
    ids = [f"lease-{i:04d}" for i in range(LEASES)]

    async with (
        gateway(database_url, tmp_path) as gw,
        busy_workers(gw.url, tmp_path),
        http_client(base_url=gw.url, timeout=30) as client,
    ):

        async def follow(task_id: str, *, task_status: anyio.abc.TaskStatus[None]) -> None:
            """One subscriber of the task, from before its start to its end."""
            async with connect(f"{gw.ws_url}/v1/tasks/{task_id}/ws?cursor=0") as ws:
                async for raw in ws:
                    seen = wall_ms()
                    frame = json.loads(raw)
                    assert frame["type"] != "error", frame
                    if task_id not in subscribed:
                        subscribed[task_id] = seen
                        task_status.started()
                    if frame["type"] == "event" and frame["event"]["type"] == "fail":
                        pushed[task_id] = seen
                        assert frame["event"] == {
                            "type": "fail",
                            "atMs": ends[task_id],
                            "error": "heartbeat-timeout",
                            "retryable": True,
                        }, frame
                        assert frame["task"]["state"] == "failed", frame

        async def run(task_ids: list[str], followers: anyio.abc.TaskGroup) -> None:
            for task_id in task_ids:
                body = {"id": task_id, "ttlMs": 3_600_000, "maxAttempts": 1, "heartbeatMs": HEARTBEAT_MS}
                made = await client.post("/v1/tasks", json=body)
                assert made.status_code == 201, made.text
                await followers.start(follow, task_id)
                started = await client.post(
                    f"/v1/tasks/{task_id}/callbacks",
                    json={"event": {"type": "start", "worker": "vanishing"}},
                    headers=bearer(made.json()["callbackToken"]),
                )
                assert started.status_code == 200 and started.json()["reason"] == "started", started.text
                ends[task_id] = started.json()["leaseUntilMs"]  # then the worker is gone

        load_at_start = os.getloadavg()[0]
        with anyio.fail_after(120):
            async with anyio.create_task_group() as followers, anyio.create_task_group() as starters:
                for c in range(CREATORS):
                    starters.start_soon(run, ids[c::CREATORS], followers)
        buckets = await commit_lateness(client, METRIC, LEASES)
        load = (load_at_start, os.getloadavg()[0])

    assert sorted(pushed) == ids
    late = {i: pushed[i] - ends[i] for i in ids}
    report = (
        f"pushed (seen by a subscriber) after the lease's end: {figures(late)}; committed (the gateway's "
        f"own figure): {buckets.get('+Inf', 0) - buckets.get('1.0', 0):.0f} of {buckets.get('+Inf', 0):.0f} "
        f"over 1 s; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end, {os.cpu_count()} CPUs"
    )
    print(f"\nleases under {WORKERS} busy workers ({database_url.split(':')[0]}):\n  {report}")
    record_property("pushed_lease_lateness_max_ms", max(late.values()))
    # Each subscriber was in place before its lease began, so what it saw was the push of the fail.
    assert all(subscribed[i] < ends[i] for i in ids), "a subscription came after its lease ended"
    assert buckets["+Inf"] == LEASES, report
    assert buckets["1.0"] == LEASES, report
    assert max(late.values()) <= BOUND_MS, report
