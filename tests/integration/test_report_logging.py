"""What a worker's log says while the gateway is away mid-run: one WARNING when the reporter's sender first
cannot reach it (which gateway, why, how many reports wait), one INFO when it reaches it again; never a line
per retry, however many retries there are."""

from __future__ import annotations

import logging
import re
import uuid
from pathlib import Path

import anyio
import pytest

from gateway.integrations.report import GatewayConfig, Reporter
from tests.support import bearer, eventually, http_client
from tests.support.celery_processes import API_KEY, keyed_gateway, read_history
from tests.support.processes import free_port

# The retries to see (logged at DEBUG) while the gateway is away, before it comes back.
RETRIES = 3


@pytest.mark.anyio
async def test_an_unreachable_gateway_is_said_once_and_its_return_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    reporter = Reporter(GatewayConfig(url=url, api_key=API_KEY, min_interval_s=0.05, timeout_s=1.0))
    task_id = f"away-{uuid.uuid4().hex[:8]}"
    caplog.set_level(logging.DEBUG, logger="gateway.integrations")

    def said(level: int, text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == level and text in r.getMessage()]

    async with keyed_gateway(tmp_path, port=port):
        ticket = await anyio.to_thread.run_sync(
            lambda: reporter.create(task_id, ttl_ms=600_000, max_attempts=1, heartbeat_ms=None, tags=())
        )
        assert ticket is not None
        run = await anyio.to_thread.run_sync(
            lambda: reporter.begin(task_id, worker="w", ticket=ticket, scheme="celery")
        )
        assert run.attempt == 1
    # The gateway is stopped: the job goes on, and its reports wait, retried.
    run.progress(40, cursor="row-40")
    run.succeed("s3://reports/away")
    await anyio.to_thread.run_sync(run.finish)

    async def retries() -> int:
        return len(said(logging.DEBUG, f"task-gateway: {task_id}: "))  # its retries

    await eventually(retries, lambda n: n >= RETRIES, f"{RETRIES} retries while the gateway is away", 30)
    async with (
        keyed_gateway(tmp_path, port=port, name="gw-again") as gw,
        http_client(base_url=gw.url, headers=bearer(API_KEY)) as client,
    ):
        await eventually(
            lambda: read_history(client, task_id),
            lambda h: h["task"]["state"] == "succeeded",
            f"{task_id} succeeded once the gateway is back",
            within_s=30,
        )
    warnings = said(logging.WARNING, f"cannot reach {url} ")  # (other tests' reporters may say theirs)
    assert len(warnings) == 1, warnings
    pattern = rf"task-gateway: cannot reach {re.escape(url)} \(\w+: .+\); ([0-9]+) reports wait and are "
    found = re.match(pattern + "retried until their task's deadline$", warnings[0])
    assert found is not None and int(found[1]) >= 1, warnings
    assert len(said(logging.INFO, f"reached {url} again")) == 1, caplog.text
