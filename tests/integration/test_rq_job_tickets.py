"""An RQ job enqueued without ``gateway.integrations.rq.enqueue`` (a plain ``queue.enqueue(...,
retry=Retry(max=2))``) and run as a ``GatewayJob``: its task is made with the job's attempts (its retries
plus one), and every run, retries included, asks for the same task (a run with fewer retries left must not
ask for another, which the gateway refuses as ``task-exists``), with the tags its ``meta["gateway"]``
asks for. On this machine's Redis (db 12, a queue of the test's own); the reporter is a recorder of what
each run was begun with.
"""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest
from redis import Redis
from rq import Queue, Retry

from gateway.integrations import rq as gateway_rq
from gateway.integrations.report import GatewayConfig, Ticket
from tests.support.queue_runs import RQ_DB, redis_space


def add(a: int, b: int) -> int:
    return a + b


class Recorded:
    def __init__(self) -> None:
        self.settled = threading.Event()
        self.settled.set()  # everything answered

    def succeed(self, value: Any) -> None:
        pass

    def fail(self, error: BaseException | str, *, retryable: bool) -> None:
        pass

    def finish(self) -> None:
        pass


class Recorder:
    def __init__(self) -> None:
        self.config = GatewayConfig(url="http://127.0.0.1:9", ttl_ms=60_000, heartbeat_ms=3_000)
        self.tickets: list[Ticket | None] = []

    def begin(
        self, task_id: str, *, worker: str, ticket: Ticket | None, scheme: str, rerun: bool = False
    ) -> Recorded:
        self.tickets.append(ticket)
        return Recorded()


@pytest.mark.anyio
async def test_a_plain_enqueued_job_makes_one_task_with_its_retries_as_attempts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    recorder = Recorder()
    monkeypatch.setattr(gateway_rq, "_reporter", recorder)
    async with redis_space(RQ_DB) as space:

        def runs() -> list[int]:
            redis = Redis.from_url(space.url)
            try:
                queue = Queue(space.token, connection=redis, job_class=gateway_rq.GatewayJob)
                job = queue.enqueue(
                    add,
                    2,
                    3,
                    job_id=f"{space.token}-job",
                    retry=Retry(max=2),
                    meta={"gateway": {"tags": ["owner:u42"]}},
                )
                results = []
                for _ in range(3):  # the first run, then the two retries RQ makes of it
                    run = gateway_rq.GatewayJob.fetch(job.id, connection=redis)
                    results.append(run.perform())
                    run.retries_left = (run.retries_left or 0) - 1
                    run.save()
                return results
            finally:
                redis.close()

        assert await anyio.to_thread.run_sync(runs) == [5, 5, 5]
    # The same task each time, titled by its function and arguments.
    assert recorder.tickets == [Ticket(None, 60_000, 3, 3_000, ("owner:u42",), title="add(2, 3)")] * 3
