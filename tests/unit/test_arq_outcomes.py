"""What the arq integration reports at a try's end, through what ``install()`` makes of a worker's settings
(the wrapped function and the chained ``after_job_end``), with a recorder for the reporter and a stand-in
for arq's Redis (whether arq kept the job, its stored result):

- a ``Retry`` on the function's last try is a final fail (arq fails the job for good when it next takes
  it, without a try or a hook: a retryable fail would leave the task requeued for nobody);
- a job enqueued without ``enqueue_job()`` creates its task with the function's ``max_tries`` as attempts;
- an abort's cancel (a request, up to ``timeout_s``) does not block the worker's event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from arq import Retry
from arq.worker import func

from gateway.integrations import arq as gateway_arq
from gateway.integrations.report import GatewayConfig, Run, Ticket
from tests.support import wait_until

RELEASE_S = 5.0


@dataclass(eq=False)
class Recorded(Run):  # a Run to the after_job_end hook, which reports runs only
    task_id: str
    ticket: Ticket | None
    retryable: list[bool] = field(default_factory=list)
    cancel_called: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    cancel_waited_out: bool | None = None

    def succeed(self, value: Any) -> None:
        pass

    def fail(self, error: BaseException | str, *, retryable: bool) -> None:
        self.retryable.append(retryable)

    def cancel(self, reason: str | None = None) -> None:
        # Stands in for the cancel's request to a slow gateway, answered once the test says so.
        self.cancel_called.set()
        self.cancel_waited_out = not self.release.wait(RELEASE_S)

    def finish(self) -> None:
        pass


class Recorder:
    def __init__(self) -> None:
        self.config = GatewayConfig(url="http://127.0.0.1:9", ttl_ms=60_000, heartbeat_ms=3_000)
        self.runs: list[Recorded] = []

    def begin(
        self, task_id: str, *, worker: str, ticket: Ticket | None, scheme: str, rerun: bool = False
    ) -> Recorded:
        run = Recorded(task_id, ticket)
        self.runs.append(run)
        return run


class ArqRedis:
    """What ``_report`` asks of arq's Redis: whether the job is kept, its stored result (none)."""

    def __init__(self, kept: bool) -> None:
        self.kept = kept

    async def exists(self, key: str) -> int:
        return int(self.kept)

    async def get(self, key: str) -> bytes | None:
        return None


async def retried(ctx: dict[str, Any]) -> None:
    raise Retry(defer=0)


async def aborted(ctx: dict[str, Any]) -> None:
    raise asyncio.CancelledError()  # what Job.abort() ends a try with


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorder]:
    monkeypatch.setattr(gateway_arq, "_reporter", None)
    recorder = Recorder()
    yield recorder


def _installed(recorder: Recorder, monkeypatch: pytest.MonkeyPatch, **settings: Any) -> dict[str, Any]:
    gateway_arq.install(settings, url="http://127.0.0.1:9")
    monkeypatch.setattr(gateway_arq, "_reporter", recorder)
    return settings


@pytest.mark.anyio
async def test_a_retry_on_the_last_try_is_a_final_fail(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _installed(recorder, monkeypatch, functions=[func(retried, max_tries=2)])
    function = settings["functions"][0]
    for job_try in (1, 2):
        ctx: dict[str, Any] = {"job_id": "job-1", "job_try": job_try, "redis": ArqRedis(kept=True)}
        with pytest.raises(Retry):
            await function.coroutine(ctx)
        await settings["after_job_end"](ctx)
    assert [run.retryable for run in recorder.runs] == [[True], [False]]


@pytest.mark.anyio
async def test_the_workers_max_tries_counts_for_functions_without_their_own(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _installed(recorder, monkeypatch, functions=[retried], max_tries=3)
    function = settings["functions"][0]
    for job_try in (2, 3):
        ctx: dict[str, Any] = {"job_id": "job-1", "job_try": job_try, "redis": ArqRedis(kept=True)}
        with pytest.raises(Retry):
            await function.coroutine(ctx)
        await settings["after_job_end"](ctx)
    assert [run.retryable for run in recorder.runs] == [[True], [False]]


@pytest.mark.anyio
async def test_a_job_without_a_ticket_makes_its_task_with_the_functions_max_tries(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _installed(recorder, monkeypatch, functions=[func(retried, max_tries=4)])
    ctx: dict[str, Any] = {"job_id": "job-1", "job_try": 1, "redis": ArqRedis(kept=True)}
    with pytest.raises(Retry):
        await settings["functions"][0].coroutine(ctx)
    await settings["after_job_end"](ctx)
    assert recorder.runs[0].ticket == Ticket(None, 60_000, 4, 3_000, (), title="retried()")


@pytest.mark.anyio
async def test_an_aborts_cancel_leaves_the_event_loop_free(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = _installed(recorder, monkeypatch, functions=[aborted])
    ctx: dict[str, Any] = {"job_id": "job-1", "job_try": 1, "redis": ArqRedis(kept=False)}
    with pytest.raises(asyncio.CancelledError):
        await settings["functions"][0].coroutine(ctx)
    ending = asyncio.ensure_future(settings["after_job_end"](ctx))
    run = recorder.runs[0]
    # The loop runs this while the cancel waits for its answer (a blocked loop would run it only after).
    await wait_until(run.cancel_called.is_set, "the abort's cancel was sent", RELEASE_S * 2)
    run.release.set()
    await ending
    assert run.cancel_waited_out is False


class SlowRecorder(Recorder):
    """A reporter whose ``begin`` waits (as one waits for a slow gateway's answer to ``start``)."""

    def __init__(self) -> None:
        super().__init__()
        self.beginning = threading.Event()
        self.answer = threading.Event()

    def begin(
        self, task_id: str, *, worker: str, ticket: Ticket | None, scheme: str, rerun: bool = False
    ) -> Recorded:
        self.beginning.set()
        self.answer.wait(RELEASE_S)
        return super().begin(task_id, worker=worker, ticket=ticket, scheme=scheme)


async def endless(ctx: dict[str, Any]) -> None:
    raise AssertionError("the try was cancelled before its function was called")


@pytest.mark.anyio
async def test_a_try_aborted_while_its_start_is_on_its_way_still_cancels_its_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recorder = SlowRecorder()
    settings = _installed(recorder, monkeypatch, functions=[endless])
    ctx: dict[str, Any] = {"job_id": "job-1", "job_try": 1, "redis": ArqRedis(kept=False)}
    trying = asyncio.ensure_future(settings["functions"][0].coroutine(ctx))
    await wait_until(recorder.beginning.is_set, "the try's start was sent", RELEASE_S * 2)
    trying.cancel()  # Job.abort()
    with pytest.raises(asyncio.CancelledError):
        await trying
    recorder.answer.set()
    ending = asyncio.ensure_future(settings["after_job_end"](ctx))
    await wait_until(lambda: bool(recorder.runs), "the run began", RELEASE_S * 2)
    run = recorder.runs[0]
    await wait_until(run.cancel_called.is_set, "the abort's cancel was sent", RELEASE_S * 2)
    run.release.set()
    await ending
    assert run.cancel_waited_out is False
