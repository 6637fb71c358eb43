"""The run reporter (``gateway.integrations.report``) against a real gateway process: coalesced progress
with the latest value always sent before the outcome; a gateway that goes away mid-run (the job finishes,
and its outcome reaches the gateway once it is back); a producer's create that cannot reach the gateway
(bounded, and it says which task it could not create); a cancel on the gateway raising in the job; a run
that takes over an attempt (no lease) reporting apart from the run before it; a revoke that does not wait
for a gateway that is down.

The reporter is sync and blocks its caller for bounded times: the tests call it from a worker thread, so
the event loop stays free for their own requests.
"""

from __future__ import annotations

import logging
import socket
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from celery import Celery, signals

from gateway.client import TaskCancelled
from gateway.integrations.celery import install, uninstall
from gateway.integrations.report import GatewayConfig, Reporter, Run
from gateway.integrations.ticket import result_hash
from tests.support import bearer, eventually, http_client
from tests.support.celery_processes import API_KEY, keyed_gateway, read_history
from tests.support.processes import free_port

# A min_interval no test outlasts: every progress after the first must wait for the outcome.
FOREVER_S = 3600.0
# The timeout of a reporter whose revoke must not wait for it: far above the bound the test puts on it.
REVOKE_TIMEOUT_S = 30.0


def _reporter(url: str, **config: Any) -> Reporter:
    return Reporter(GatewayConfig(url=url, api_key=API_KEY, **config))


def _begin(reporter: Reporter, task_id: str, **create: Any) -> Run:
    ticket = reporter.create(
        task_id, ttl_ms=create.get("ttl_ms", 600_000), max_attempts=2, heartbeat_ms=None, tags=()
    )
    assert ticket is not None and ticket.token
    return reporter.begin(task_id, worker="test-worker", ticket=ticket, scheme="celery")


@pytest.fixture
def unanswering() -> Iterator[str]:
    """A loopback address that takes connections and never answers (nothing accepts them)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.anyio
async def test_progress_is_coalesced_and_its_latest_value_goes_before_the_outcome(tmp_path: Path) -> None:
    async with (
        keyed_gateway(tmp_path) as gw,
        http_client(base_url=gw.url, headers=bearer(API_KEY)) as client,
    ):
        reporter = _reporter(gw.url, min_interval_s=FOREVER_S)
        task_id = f"coalesced-{uuid.uuid4().hex[:8]}"

        def job() -> None:
            run = _begin(reporter, task_id)
            assert run.attempt == 1
            for value in range(1, 100):
                run.progress(value, cursor=f"row-{value}")
            run.succeed({"rows": 99})
            run.finish()

        await anyio.to_thread.run_sync(job)
        history = await eventually(
            lambda: read_history(client, task_id),
            lambda h: h["task"]["state"] == "succeeded",
            f"{task_id} succeeded",
        )
        events = [e["event"] for e in history["events"]]
        progress = [(e["progress"], e["cursor"]) for e in events if e["type"] == "progress"]
        # The first value may go at once; every later one waits for the outcome, which takes the latest.
        assert 1 <= len(progress) <= 2, progress
        assert progress[-1] == (99, "row-99"), progress
        assert [e["type"] for e in events] == ["start", *["progress"] * len(progress), "succeed"]
        assert history["task"]["resultRef"] == f"celery://{task_id}"
        assert history["task"]["resultHash"] == result_hash({"rows": 99})


@pytest.mark.anyio
async def test_a_job_finishes_while_the_gateway_is_down_and_its_outcome_arrives_when_it_is_back(
    tmp_path: Path,
) -> None:
    port = free_port()
    reporter = _reporter(f"http://127.0.0.1:{port}", min_interval_s=0.05, timeout_s=1.0)
    task_id = f"down-{uuid.uuid4().hex[:8]}"
    async with keyed_gateway(tmp_path, port=port):
        run = await anyio.to_thread.run_sync(lambda: _begin(reporter, task_id))
        assert run.attempt == 1
    # The gateway is stopped: the job goes on and finishes (finish() does not wait for a gateway it
    # cannot reach), its reports kept for the sender.
    run.progress(40, cursor="row-40")
    run.progress(70, cursor="row-70")
    run.fail(ValueError("disk full"), retryable=False)
    await anyio.to_thread.run_sync(run.finish)
    assert not run.settled.is_set()
    async with (
        keyed_gateway(tmp_path, port=port, name="gw-again") as gw,
        http_client(base_url=gw.url, headers=bearer(API_KEY)) as client,
    ):
        history = await eventually(
            lambda: read_history(client, task_id),
            lambda h: h["task"]["state"] == "failed",
            f"{task_id} failed, reported once the gateway is back",
            within_s=30,
        )
        events = [e["event"] for e in history["events"]]
        progress = [e["progress"] for e in events[1:-1]]
        # 40 may have gone (and waited for the gateway) before 70 replaced it: never after 70.
        assert progress in ([70], [40, 70]), events
        assert [events[0]["type"], events[-1]["type"]] == ["start", "fail"], events
        assert (events[-1]["error"], events[-1]["retryable"]) == ("ValueError: disk full", False)
        with anyio.fail_after(10):
            await anyio.to_thread.run_sync(run.settled.wait)


def test_a_create_that_gets_no_answer_gives_up_within_its_timeout_and_says_so(
    unanswering: str, caplog: pytest.LogCaptureFixture
) -> None:
    reporter = _reporter(unanswering, timeout_s=0.5)
    with caplog.at_level(logging.WARNING, logger="gateway.integrations"):
        ticket = reporter.create("report-42", ttl_ms=60_000, max_attempts=3, heartbeat_ms=None, tags=())
    assert ticket is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("could not create task report-42" in w and "Timeout" in w for w in warnings), warnings


def test_a_create_with_no_gateway_listening_says_it_could_not_create_the_task(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reporter = _reporter(f"http://127.0.0.1:{free_port()}", timeout_s=0.5)
    with caplog.at_level(logging.WARNING, logger="gateway.integrations"):
        assert reporter.create("report-43", ttl_ms=60_000, max_attempts=1, heartbeat_ms=None, tags=()) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("could not create task report-43" in w and "ConnectError" in w for w in warnings), warnings


@pytest.mark.anyio
async def test_a_cancel_on_the_gateway_makes_the_next_progress_raise(tmp_path: Path) -> None:
    async with (
        keyed_gateway(tmp_path) as gw,
        http_client(base_url=gw.url, headers=bearer(API_KEY)) as client,
    ):
        reporter = _reporter(gw.url, min_interval_s=0.05)
        task_id = f"cancelled-{uuid.uuid4().hex[:8]}"
        run = await anyio.to_thread.run_sync(lambda: _begin(reporter, task_id))
        run.progress(10)
        answer = await client.post(f"/v1/tasks/{task_id}/cancel", json={"reason": "not wanted"})
        assert answer.json()["reason"] == "cancelled", answer.text
        raised: list[TaskCancelled] = []

        def reports() -> bool:
            """The job's loop: a progress now and then, until one raises."""
            try:
                run.progress(20 + len(raised))
            except TaskCancelled as exc:
                raised.append(exc)
            return bool(raised)

        await eventually(lambda: anyio.to_thread.run_sync(reports), bool, "progress() raising TaskCancelled")
        assert raised[0].task is not None and raised[0].task["error"] == "cancelled"
        final = await read_history(client, task_id)
        assert [e["event"]["type"] for e in final["events"]][-1] == "cancel"


@pytest.mark.anyio
async def test_a_run_that_takes_over_an_attempt_reports_apart_from_the_run_before_it(tmp_path: Path) -> None:
    """A task without a lease, its message redelivered (the first worker killed mid-run): the new run takes
    the attempt over and counts its progress from the first again, yet its reports are its own (not taken
    for repeats of the first run's, nor refused as ids reused with another body)."""
    async with (
        keyed_gateway(tmp_path) as gw,
        http_client(base_url=gw.url, headers=bearer(API_KEY)) as client,
    ):
        task_id = f"taken-over-{uuid.uuid4().hex[:8]}"
        killed = _reporter(gw.url, min_interval_s=0.05)  # the first worker's process
        redelivered = _reporter(gw.url, min_interval_s=0.05)  # the process the message goes to next
        ticket = await anyio.to_thread.run_sync(
            lambda: killed.create(task_id, ttl_ms=600_000, max_attempts=1, heartbeat_ms=None, tags=())
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
        # The first run says nothing more (its worker was killed); the message runs again.
        second = await anyio.to_thread.run_sync(
            lambda: redelivered.begin(task_id, worker="redelivered", ticket=ticket, scheme="celery")
        )
        assert second.attempt == 1  # taken over: no lease could requeue it
        second.progress(50, cursor="row-50")
        second.succeed("s3://reports/taken-over")
        await anyio.to_thread.run_sync(second.finish)
        history = await eventually(
            lambda: read_history(client, task_id),
            lambda h: h["task"]["state"] == "succeeded",
            f"{task_id} succeeded by the run that took it over",
        )
        events = [e["event"] for e in history["events"]]
        progress = [(e["progress"], e["cursor"]) for e in events if e["type"] == "progress"]
        assert progress == [(10, "row-10"), (50, "row-50")], events
        assert history["task"]["resultRef"] == "s3://reports/taken-over"


@pytest.mark.anyio
async def test_a_revoke_with_the_gateway_down_returns_at_once_and_cancels_once_it_is_back(
    tmp_path: Path,
) -> None:
    """Celery's ``task_revoked`` runs in the worker's main process, the one taking messages: its cancel must
    not wait for a gateway that is down (here, the whole ``timeout`` it would retry for), yet must reach the
    gateway once it is back."""
    port = free_port()
    app = Celery(f"revoke-{uuid.uuid4().hex[:8]}")
    reporter = install(app, url=f"http://127.0.0.1:{port}", api_key=API_KEY, timeout=REVOKE_TIMEOUT_S)
    task_id = f"revoked-{uuid.uuid4().hex[:8]}"
    try:
        async with keyed_gateway(tmp_path, port=port):
            created = await anyio.to_thread.run_sync(
                lambda: reporter.create(task_id, ttl_ms=600_000, max_attempts=1, heartbeat_ms=None, tags=())
            )
            assert created is not None
        # The gateway is stopped. A cancel that waited would take REVOKE_TIMEOUT_S (the thread abandoned).
        with anyio.fail_after(REVOKE_TIMEOUT_S / 3):
            await anyio.to_thread.run_sync(
                lambda: signals.task_revoked.send(
                    sender=None,
                    request=SimpleNamespace(id=task_id),
                    terminated=False,
                    signum=None,
                    expired=False,
                ),
                abandon_on_cancel=True,
            )
        async with (
            keyed_gateway(tmp_path, port=port, name="gw-again") as gw,
            http_client(base_url=gw.url, headers=bearer(API_KEY)) as client,
        ):
            history = await eventually(
                lambda: read_history(client, task_id),
                lambda h: h["task"]["state"] == "failed",
                f"{task_id} cancelled once the gateway is back",
                within_s=30,
            )
            assert history["task"]["error"] == "cancelled"
            assert [e["event"]["type"] for e in history["events"]] == ["cancel"]
    finally:
        uninstall(app)


@pytest.mark.anyio
async def test_a_runs_cancel_goes_after_the_task_it_makes_and_does_not_wait(tmp_path: Path) -> None:
    """``Run.cancel`` (arq's abort) of a run that must make its task first (no ticket): the cancel is sent
    after the create and the start, not before (it would be refused: ``404 unknown-task``)."""
    async with (
        keyed_gateway(tmp_path) as gw,
        http_client(base_url=gw.url, headers=bearer(API_KEY)) as client,
    ):
        reporter = _reporter(gw.url)
        task_id = f"aborted-{uuid.uuid4().hex[:8]}"

        def aborted() -> None:
            run = reporter.begin(task_id, worker="w", ticket=None, scheme="arq", wait=False)
            run.cancel("aborted")

        await anyio.to_thread.run_sync(aborted)

        async def history_if_made() -> dict[str, Any] | None:
            answer = await client.get(f"/v1/tasks/{task_id}/events", params={"cursor": 0})
            return None if answer.status_code == 404 else await read_history(client, task_id)

        history = await eventually(
            history_if_made,
            lambda h: h is not None and h["task"]["state"] == "failed",
            f"{task_id} cancelled after its run made and started it",
        )
        assert history is not None
        assert [e["event"]["type"] for e in history["events"]] == ["start", "cancel"]
        assert history["task"]["error"] == "cancelled"


@pytest.mark.anyio
async def test_a_lost_run_is_failed_without_waiting_for_a_gateway_that_is_down(tmp_path: Path) -> None:
    """``Reporter.lost`` (Celery's ``task_failure`` in the worker's main process, for a pool process it lost):
    with the gateway down it returns at once (a lost that waited would take the whole ``timeout``), and once
    the gateway is back the running task fails for good with the queue's error, while a task its lease has
    requeued meanwhile (here: never started) is cancelled, saying why."""
    port = free_port()
    reporter = _reporter(f"http://127.0.0.1:{port}", timeout_s=REVOKE_TIMEOUT_S)
    running, requeued = (f"lost-{n}-{uuid.uuid4().hex[:8]}" for n in ("running", "requeued"))
    async with keyed_gateway(tmp_path, port=port):
        run = await anyio.to_thread.run_sync(lambda: _begin(reporter, running))
        assert run.attempt == 1
        ticket = await anyio.to_thread.run_sync(
            lambda: reporter.create(requeued, ttl_ms=600_000, max_attempts=1, heartbeat_ms=None, tags=())
        )
        assert ticket is not None and run.ticket is not None
    # The gateway is stopped. A lost that waited would take REVOKE_TIMEOUT_S (the thread abandoned).
    error = RuntimeError("Worker exited prematurely: signal 9 (SIGKILL)")
    with anyio.fail_after(REVOKE_TIMEOUT_S / 3):
        for task_id, its_ticket in ((running, run.ticket), (requeued, ticket)):
            await anyio.to_thread.run_sync(reporter.lost, task_id, its_ticket, error, abandon_on_cancel=True)
    async with (
        keyed_gateway(tmp_path, port=port, name="gw-again") as gw,
        http_client(base_url=gw.url, headers=bearer(API_KEY)) as client,
    ):
        for task_id in (running, requeued):
            history = await eventually(
                partial(read_history, client, task_id),
                lambda h: h["task"]["state"] == "failed",
                f"{task_id} failed once the gateway is back",
                within_s=30,
            )
            if task_id == running:
                assert [e["event"]["type"] for e in history["events"]] == ["start", "fail"]
                assert history["task"]["error"] == f"RuntimeError: {error}"
            else:
                assert [e["event"]["type"] for e in history["events"]] == ["cancel"]
                assert history["task"]["error"] == "cancelled"
