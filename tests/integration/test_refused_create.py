"""A job whose gateway task the gateway refuses to create (its own options ask for a heartbeat of 0.5 s, which
``install()`` would have refused) is published all the same, on each queue's real broker, and its producer
says so at ERROR: which job is not shown, why (the gateway's code and message), and what to do. The task
does not exist on the gateway (a real one, in this process). Producers only: no worker, no wait."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import anyio
import dramatiq
import pytest
from arq.connections import RedisSettings, create_pool
from dramatiq.brokers.redis import RedisBroker
from redis import Redis
from rq import Queue

from gateway.integrations import arq as gateway_arq
from gateway.integrations import celery as gateway_celery
from gateway.integrations import dramatiq as gateway_dramatiq
from gateway.integrations import rq as gateway_rq
from tests.jobs.celery_tasks import make_app
from tests.support import http_client, running_gateway
from tests.support.celery_processes import redis_broker
from tests.support.queue_runs import API_KEY, ARQ_DB, RQ_DB, gateway_headers, redis_space

# A job's own gateway options that the gateway refuses (heartbeatMs is at least 1000).
REFUSED = {"heartbeatMs": 500}


@pytest.fixture
def errors(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The integrations' log captured from WARNING up; RQ's and arq's process-wide reporters put back."""
    for module in (gateway_rq, gateway_arq):
        monkeypatch.setattr(module, "_reporter", module._reporter)
    with caplog.at_level(logging.WARNING, logger="gateway.integrations"):
        yield


def _said_not_shown(caplog: pytest.LogCaptureFixture, job_id: str) -> None:
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("gateway.integrations")]
    assert len(said) == 1, said
    level, message = said[0]
    assert level == logging.ERROR, said
    assert message.startswith(
        f"task-gateway: job {job_id} is not shown on the gateway: the gateway refused to create its task "
        "(400 invalid-request: heartbeatMs: must be from 1000 to "
    ), message
    assert message.endswith(
        "the job runs all the same, unreported. Correct the value it names, in the job's gateway options "
        "or in install()'s."
    ), message


async def _not_shown(caplog: pytest.LogCaptureFixture, url: str, job_id: str) -> None:
    """The job's task was not created, and the integration said so once, naming the job."""
    _said_not_shown(caplog, job_id)
    async with http_client(base_url=url, headers=gateway_headers()) as client:
        answer = await client.get(f"/v1/tasks/{job_id}")
    assert answer.status_code == 404, answer.text


@pytest.mark.anyio
@pytest.mark.usefixtures("errors")
async def test_celery_says_which_job_is_not_shown(sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
    with redis_broker() as broker:
        async with running_gateway(sqlite_url, api_key=API_KEY) as gw:
            app = make_app(
                broker=broker.url,
                backend="disabled://",
                queue=broker.queue,
                prefix=broker.prefix,
                gateway=gw.url,
                api_key=API_KEY,
            )
            try:
                sent = await anyio.to_thread.run_sync(
                    lambda: app.signature("tg.steps").apply_async(
                        ([10], "s3://x"), headers={"gateway": REFUSED}
                    )
                )
            finally:
                gateway_celery.uninstall(app)
                app.close()
            await _not_shown(caplog, gw.url, str(sent.id))
            published = Redis.from_url(broker.url)
            assert published.llen(f"{broker.prefix}{broker.queue}") == 1  # published all the same
            published.close()


@pytest.mark.anyio
@pytest.mark.usefixtures("errors")
async def test_rq_says_which_job_is_not_shown(sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
    async with running_gateway(sqlite_url, api_key=API_KEY) as gw, redis_space(RQ_DB) as space:
        gateway_rq.install(url=gw.url, api_key=API_KEY, timeout=5.0)
        redis = Redis.from_url(space.url)
        queue = Queue(space.token, connection=redis)
        job_id = f"{space.token}-refused"
        await anyio.to_thread.run_sync(
            lambda: gateway_rq.enqueue(queue, "tests.jobs.rq_jobs.work", "ok", job_id=job_id, gateway=REFUSED)
        )
        await _not_shown(caplog, gw.url, job_id)
        assert queue.job_ids == [job_id]  # enqueued all the same
        redis.close()


@pytest.mark.anyio
@pytest.mark.usefixtures("errors")
async def test_arq_says_which_job_is_not_shown(sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
    async with running_gateway(sqlite_url, api_key=API_KEY) as gw, redis_space(ARQ_DB) as space:
        gateway_arq.configure(url=gw.url, api_key=API_KEY, timeout=5.0)
        redis = await create_pool(RedisSettings(host="127.0.0.1", port=6379, database=ARQ_DB))
        try:
            job_id = f"{space.token}-refused"
            job = await gateway_arq.enqueue_job(
                redis, "work", "ok", _job_id=job_id, _queue_name=space.key("queue"), _gateway=REFUSED
            )
            assert job is not None  # enqueued all the same
            await _not_shown(caplog, gw.url, job_id)
        finally:
            await redis.aclose()


@pytest.mark.anyio
@pytest.mark.usefixtures("errors")
async def test_dramatiq_says_which_job_is_not_shown(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_gateway(sqlite_url, api_key=API_KEY) as gw, redis_space(RQ_DB) as space:
        broker = RedisBroker(url=space.url, namespace=f"dramatiq-{space.token}")  # type: ignore[no-untyped-call]
        try:
            gateway_dramatiq.install(broker, url=gw.url, api_key=API_KEY, timeout=5.0)
            actor = dramatiq.actor(actor_name="refused", queue_name=space.token, broker=broker)(lambda: None)
            message = await anyio.to_thread.run_sync(lambda: actor.send_with_options(gateway=REFUSED))
            await _not_shown(caplog, gw.url, message.message_id)
            queued = Redis.from_url(space.url)
            assert queued.hlen(f"dramatiq-{space.token}:{space.token}.msgs") == 1  # enqueued all the same
            queued.close()
        finally:
            broker.close()
