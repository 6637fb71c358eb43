"""A job's run that is not its first (``Reporter.begin(..., rerun=True)``: a redelivered message, a retry, a
job a killed worker abandoned), against a real gateway: it reads the task before it starts, and waits for
the lease of the run before it without renewing it (a ``start`` answered ``already-running`` would: the
dead run's attempt would then live one lease longer, and the page would freeze that long).

The killed run is a run whose process stops reporting: ``Run.pending()`` (the hand-over of an RQ work horse)
makes its reporter send nothing more of it, as a killed process would, and nobody adopts what it left.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import anyio
import pytest

from gateway.integrations.report import GatewayConfig, Reporter
from tests.support import bearer, eventually, http_client
from tests.support.celery_processes import API_KEY, keyed_gateway, read_history

T = TypeVar("T")

# The task's lease (the gateway takes 1 s and more): its sender heartbeats a live run every third of it.
LEASE_MS = 2_000


def _reporter(url: str) -> Reporter:
    return Reporter(GatewayConfig(url=url, api_key=API_KEY, min_interval_s=0.05))


def _now_ms() -> int:
    """The gateway's clock, as it reads it (the same machine): whole milliseconds, rounded down."""
    return time.time_ns() // 1_000_000


@pytest.mark.anyio
async def test_a_rerun_waits_out_the_lease_of_a_killed_run_without_renewing_it(tmp_path: Path) -> None:
    async with (
        keyed_gateway(tmp_path) as gw,
        http_client(base_url=gw.url, headers=bearer(API_KEY)) as client,
    ):
        task_id = f"rerun-{uuid.uuid4().hex[:8]}"
        killed, redelivered = _reporter(gw.url), _reporter(gw.url)  # two worker processes
        ticket = await anyio.to_thread.run_sync(
            lambda: killed.create(task_id, ttl_ms=600_000, max_attempts=2, heartbeat_ms=LEASE_MS, tags=())
        )
        assert ticket is not None
        first = await anyio.to_thread.run_sync(
            lambda: killed.begin(task_id, worker="killed", ticket=ticket, scheme="celery")
        )
        assert first.attempt == 1
        first.progress(10, cursor="row-10")
        await eventually(
            lambda: read_history(client, task_id),
            lambda h: h["task"].get("progress") == 10,
            f"{task_id}'s first progress",
        )
        first.pending()  # killed: its reporter sends nothing more of it
        await eventually(_const(first.settled), lambda settled: settled.is_set(), "the first run over")
        # Every request of the first run (its callbacks, its heartbeats) has been answered by now.
        dead_ms = _now_ms()
        await eventually(_const(None), lambda _: _now_ms() > dead_ms, "the clock past the first run's end")
        second = await anyio.to_thread.run_sync(
            lambda: redelivered.begin(
                task_id, worker="redelivered", ticket=ticket, scheme="celery", wait=False, rerun=True
            )
        )
        second.progress(50, cursor="row-50")
        second.succeed("s3://reports/rerun")
        await anyio.to_thread.run_sync(second.finish)
        history = await eventually(
            lambda: read_history(client, task_id),
            lambda h: h["task"]["state"] == "succeeded",
            f"{task_id} succeeded by its second run",
            within_s=30,
        )
        events = [e["event"] for e in history["events"]]
        assert [e["type"] for e in events] == ["start", "progress", "fail", "start", "progress", "succeed"]
        timeout = events[2]
        assert (timeout["error"], timeout["retryable"]) == ("heartbeat-timeout", True)
        # The lease ran from the first run's last sign of life: the second run renewed nothing.
        assert timeout["atMs"] <= dead_ms + LEASE_MS, (timeout["atMs"] - dead_ms, events)
        assert events[3]["worker"] == "redelivered"
        assert second.attempt == 2
        assert history["task"]["attempts"] == 2


@pytest.mark.anyio
async def test_a_rerun_of_a_requeued_task_starts_the_next_attempt(tmp_path: Path) -> None:
    """A retry (the run before it failed retryable, so the task is queued): one read, then its start."""
    async with (
        keyed_gateway(tmp_path) as gw,
        http_client(base_url=gw.url, headers=bearer(API_KEY)) as client,
    ):
        task_id = f"retried-{uuid.uuid4().hex[:8]}"
        reporter = _reporter(gw.url)

        def runs() -> tuple[int | None, int | None]:
            ticket = reporter.create(task_id, ttl_ms=600_000, max_attempts=2, heartbeat_ms=LEASE_MS, tags=())
            assert ticket is not None
            first = reporter.begin(task_id, worker="w", ticket=ticket, scheme="celery")
            first.fail(ValueError("try again"), retryable=True)
            first.finish()
            second = reporter.begin(task_id, worker="w", ticket=ticket, scheme="celery", rerun=True)
            second.succeed("done")
            second.finish()
            return first.attempt, second.attempt

        assert await anyio.to_thread.run_sync(runs) == (1, 2)
        history = await eventually(
            lambda: read_history(client, task_id),
            lambda h: h["task"]["state"] == "succeeded",
            f"{task_id} succeeded by its second run",
        )
        assert [e["event"]["type"] for e in history["events"]] == ["start", "fail", "start", "succeed"]


@pytest.mark.anyio
async def test_a_rerun_that_cannot_read_its_task_starts_as_a_first_run_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker without the API key cannot read the task: it starts at once (and says why it could not
    look first) rather than wait for nothing."""
    async with keyed_gateway(tmp_path) as gw:
        task_id = f"keyless-{uuid.uuid4().hex[:8]}"
        keyless = Reporter(GatewayConfig(url=gw.url, min_interval_s=0.05))
        ticket = await anyio.to_thread.run_sync(
            lambda: _reporter(gw.url).create(
                task_id, ttl_ms=600_000, max_attempts=1, heartbeat_ms=LEASE_MS, tags=()
            )
        )
        assert ticket is not None
        with caplog.at_level(logging.WARNING, logger="gateway.integrations"):
            run = await anyio.to_thread.run_sync(
                lambda: keyless.begin(task_id, worker="w", ticket=ticket, scheme="celery", rerun=True)
            )
        assert run.attempt == 1
        run.succeed("done")
        await anyio.to_thread.run_sync(run.finish)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(f"cannot read task {task_id}" in w and "starting it" in w for w in warnings), warnings


def _const(value: T) -> Callable[[], Awaitable[T]]:
    """A probe for :func:`eventually` that returns ``value`` (the condition looks at it, or elsewhere)."""

    async def probe() -> T:
        return value

    return probe
