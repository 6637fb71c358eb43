"""What the Dramatiq middleware reports when a run fails: retryable exactly when Dramatiq's ``Retries`` runs
the message again. Dramatiq calls the ``after_*`` hooks in reverse order, so the middleware (installed after
``Retries``) reports before ``Retries`` has decided: a message ``Retries`` gives up on (an exception the
actor ``throws``, a ``retry_when`` that says no) while it has retries left must still be a final fail, or
the gateway requeues a task nobody will run again. A message failed before it runs (``AgeLimit``) cancels
its task, which would otherwise stay queued until its deadline.

A stub broker and an in-process worker run real Dramatiq middleware; the reporter is a recorder (what is
sent to the gateway, and how, is the reporter's, tested with it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

from gateway.integrations.dramatiq import GatewayMiddleware
from gateway.integrations.report import GatewayConfig, Ticket
from gateway.integrations.ticket import error_text

JOIN_S = 30


@dataclass
class Recorded:
    task_id: str
    outcomes: list[tuple[str, bool | None]] = field(default_factory=list)

    def progress(self, value: int, cursor: str = "") -> None:
        pass

    def succeed(self, value: Any) -> None:
        self.outcomes.append(("succeed", None))

    def fail(self, error: BaseException | str, *, retryable: bool) -> None:
        self.outcomes.append((error_text(error), retryable))

    def finish(self) -> None:
        pass


class Recorder:
    """Stands in for a ``Reporter``: creates nothing, records each run's outcome."""

    def __init__(self) -> None:
        self.config = GatewayConfig(url="http://127.0.0.1:9")
        self.runs: list[Recorded] = []
        self.cancelled: list[tuple[str, str | None]] = []

    def cancel(self, task_id: str, reason: str | None = None, **how: Any) -> dict[str, Any] | None:
        assert how.get("wait") is False  # a dramatiq worker thread never waits for the gateway
        self.cancelled.append((task_id, reason))
        return None

    def create(self, task_id: str, **_: Any) -> Ticket | None:
        return None

    def begin(
        self, task_id: str, *, worker: str, ticket: Ticket | None, scheme: str, rerun: bool = False
    ) -> Recorded:
        run = Recorded(task_id)
        self.runs.append(run)
        return run


@pytest.fixture
def stub() -> Iterator[tuple[StubBroker, Recorder]]:
    broker = StubBroker()
    recorder = Recorder()
    broker.add_middleware(GatewayMiddleware(recorder))  # type: ignore[arg-type]
    yield broker, recorder
    broker.close()


def _run(broker: StubBroker, queue: str) -> None:
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=50)
    worker.start()
    try:
        broker.join(queue, timeout=JOIN_S * 1000, fail_fast=False)
        worker.join()
    finally:
        worker.stop()


def _outcomes(recorder: Recorder) -> list[tuple[str, bool | None]]:
    return [outcome for run in recorder.runs for outcome in run.outcomes]


def test_an_exception_the_actor_throws_is_a_final_fail_with_retries_left(
    stub: tuple[StubBroker, Recorder],
) -> None:
    broker, recorder = stub

    @dramatiq.actor(broker=broker, queue_name="throws", max_retries=3, throws=(ValueError,))
    def bad_rows() -> None:
        raise ValueError("bad rows")

    bad_rows.send()
    _run(broker, "throws")
    assert _outcomes(recorder) == [("ValueError: bad rows", False)]


def test_retry_when_decides_as_retries_does(stub: tuple[StubBroker, Recorder]) -> None:
    broker, recorder = stub

    def once(retries: int, exc: BaseException) -> bool:
        return retries < 1

    @dramatiq.actor(
        broker=broker, queue_name="when", max_retries=5, retry_when=once, min_backoff=1, max_backoff=10
    )
    def flaky() -> None:
        raise RuntimeError("flaky")

    flaky.send()
    _run(broker, "when")
    assert _outcomes(recorder) == [("RuntimeError: flaky", True), ("RuntimeError: flaky", False)]


def test_max_retries_retries_then_fails_for_good(stub: tuple[StubBroker, Recorder]) -> None:
    broker, recorder = stub

    @dramatiq.actor(broker=broker, queue_name="max", max_retries=1, min_backoff=1, max_backoff=10)
    def flaky() -> None:
        raise RuntimeError("flaky")

    flaky.send()
    _run(broker, "max")
    assert _outcomes(recorder) == [("RuntimeError: flaky", True), ("RuntimeError: flaky", False)]


def test_a_message_too_old_to_run_cancels_its_task(stub: tuple[StubBroker, Recorder]) -> None:
    broker, recorder = stub

    @dramatiq.actor(broker=broker, queue_name="old", max_age=60_000)
    def late() -> None:
        raise AssertionError("AgeLimit runs no message past its age")

    message = late.message()
    broker.enqueue(message.copy(message_timestamp=message.message_timestamp - 3_600_000))
    _run(broker, "old")
    assert (recorder.runs, recorder.cancelled) == ([], [(message.message_id, "skipped")])
