"""``write(name, text)`` of the Python workers against a real gateway: what a job writes is the stream's
text, exactly, sent in few appends (buffered), flushed before the outcome, once each even when answers are
lost on the way (the same ``seq`` again), and refused with the clients' errors once the attempt is over."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.client import AttemptOver, SyncWorker, TaskCancelled, Worker
from tests.support import create_task, eventually, http_client, post_callback, running_gateway
from tests.support.lossy_proxy import LossyProxy
from tests.support.threaded import Threaded, threaded_gateway


def one_per_request() -> httpx.AsyncClient:
    """A worker's client through the proxy: a connection per request, as the proxy carries one each."""
    return httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_keepalive_connections=0))


async def chunks_of(client: httpx.AsyncClient, task_id: str, name: str = "output") -> list[str]:
    page = await client.get(f"/v1/tasks/{task_id}/streams/{name}", params={"offset": 0, "limit": 10_000})
    assert page.status_code == 200, page.text
    assert not page.json()["more"]
    chunks: list[str] = page.json()["chunks"]
    return chunks


def appends(proxy: LossyProxy) -> list[tuple[dict[str, Any], bool]]:
    """The answers to the appends the proxy carried (the callbacks' have a ``reason``), each with whether
    it was passed on to the worker."""
    answers = [(json.loads(carried.body), carried.delivered) for carried in proxy.carried]
    return [(answer, delivered) for answer, delivered in answers if "nextOffset" in answer]


@pytest.mark.anyio
async def test_a_jobs_writes_are_the_streams_text_in_few_appends_flushed_before_succeed(
    sqlite_url: str,
) -> None:
    tokens = [f"word{n} " for n in range(1_000)]
    big = "é€𝄞" * 30_000  # 270,000 bytes of UTF-8 in one write: cut into chunks of at most 64 KiB
    async with running_gateway(sqlite_url) as gw:
        made = await create_task(gw, "llm-1", ttl_ms=120_000, max_attempts=1)
        proxy = LossyProxy(int(gw.url.rsplit(":", 1)[1]), loss=0.0, seed=1)
        async with proxy.running() as url, Worker(url, "llm-1", made.callback_token) as worker:
            await worker.start("w1")
            for token in tokens:
                await worker.write("output", token)
            await worker.write("log", big)
            await worker.write("output", "the end")
            await worker.succeed("s3://answers/1", "sha256:1")  # right after the last write
        text = await gw.client.get("/v1/tasks/llm-1/streams/output/text")
        assert text.text == "".join(tokens) + "the end"
        assert text.headers["Stream-Closed"] == "true"
        log_chunks = await chunks_of(gw.client, "llm-1", "log")
        assert "".join(log_chunks) == big and all(len(c.encode()) <= 65_536 for c in log_chunks)
        # 1,001 writes to "output" went in a few appends, not one each (the gateway allows 100 a second).
        assert 1 <= len([a for a, _ in appends(proxy) if a["stream"] == "output"]) <= 10
        assert (await chunks_of(gw.client, "llm-1")) == [*tokens, "the end"]


@pytest.mark.anyio
async def test_appends_whose_answers_are_lost_are_sent_again_and_taken_once(sqlite_url: str) -> None:
    """30% of the answers are lost after the gateway wrote them (appended what they carried). The worker
    sends each such batch again with its ``seq``: the stream holds every write once, in order."""
    writes = [f"line {n}\n" for n in range(300)]
    async with running_gateway(sqlite_url) as gw:
        made = await create_task(gw, "lossy-1", ttl_ms=120_000, max_attempts=1)
        proxy = LossyProxy(int(gw.url.rsplit(":", 1)[1]), loss=0.3, seed=7)
        async with (
            proxy.running() as url,
            one_per_request() as client,
            Worker(url, "lossy-1", made.callback_token, client=client) as worker,
        ):
            await worker.start("w1")
            for n, line in enumerate(writes):
                await worker.write("output", line)
                if n % 10 == 9:
                    await worker.flush()  # a batch of 10 lines each, so that many answers can be lost
            await worker.succeed("s3://logs/1", "sha256:1")
        assert await chunks_of(gw.client, "lossy-1") == writes  # none missing, none twice
        proxy.check_appends(len(writes))


@pytest.mark.anyio
async def test_a_write_after_a_cancel_or_past_its_attempt_raises_and_appends_nothing(
    sqlite_url: str,
) -> None:
    async with running_gateway(sqlite_url) as gw:
        made = await create_task(gw, "cut-1", ttl_ms=120_000, max_attempts=1)
        async with Worker(gw.url, "cut-1", made.callback_token) as worker:
            await worker.start("w1")
            await worker.write("output", "before ")
            await worker.flush()
            assert (await gw.client.post("/v1/tasks/cut-1/cancel", json={})).status_code == 200
            await worker.write("output", "after")  # buffered: the gateway has not been asked yet
            with pytest.raises(TaskCancelled):
                await worker.flush()
            with pytest.raises(TaskCancelled):  # and so is every write from here on
                await worker.write("output", "more")
        assert (await gw.client.get("/v1/tasks/cut-1/streams/output/text")).text == "before "

        made = await create_task(gw, "stale-1", ttl_ms=120_000, max_attempts=2)
        async with (
            Worker(gw.url, "stale-1", made.callback_token) as old,
            Worker(gw.url, "stale-1", made.callback_token) as new,
        ):
            await old.start("w1")
            await old.write("output", "first attempt")
            await old.flush()
            # Attempt 1 is failed (retryable) by someone else, and attempt 2 starts elsewhere.
            failed = {"type": "fail", "error": "lost", "retryable": True}
            await post_callback(gw, "stale-1", made.callback_token, failed, attempt=1)
            await new.start("w2")
            await new.write("output", "second attempt")
            await new.flush()
            await old.write("output", " goes on")
            with pytest.raises(AttemptOver) as over:
                await old.flush()
            assert over.value.code == "stale-attempt"
        assert (await gw.client.get("/v1/tasks/stale-1/streams/output/text")).text == "second attempt"


@pytest.fixture
def threaded(tmp_path: Path) -> Iterator[Threaded]:
    with threaded_gateway(f"sqlite:///{tmp_path / 'gateway.db'}") as threaded:
        yield threaded


def test_the_sync_worker_writes_from_a_jobs_thread(threaded: Threaded) -> None:
    made = threaded.client.post("/v1/tasks", json={"id": "sync-1", "ttlMs": 120_000}).json()
    lines = [f"step {n}\n" for n in range(300)]
    with SyncWorker(threaded.url, "sync-1", made["callbackToken"]) as worker:
        worker.start("w1")
        for line in lines:
            worker.write("steps", line)
        worker.succeed("s3://r/1", "sha256:1")
    assert threaded.client.get("/v1/tasks/sync-1/streams/steps/text").text == "".join(lines)


@pytest.mark.anyio
async def test_writes_inside_the_block_go_within_its_background_sender(sqlite_url: str) -> None:
    """Inside ``async with``, a write's text reaches the gateway without another call of the job."""
    async with running_gateway(sqlite_url) as gw:
        made = await create_task(gw, "bg-1", ttl_ms=120_000, max_attempts=1)
        async with Worker(gw.url, "bg-1", made.callback_token) as worker:
            await worker.start("w1")
            await worker.write("output", "thinking...")
            await eventually(
                lambda: gw.client.get("/v1/tasks/bg-1/streams/output/text"),
                lambda answer: answer.text == "thinking...",
                "the write's text read back, with no other call of the job",
            )
            await worker.succeed("s3://r/1", "sha256:1")


@pytest.mark.anyio
async def test_a_worker_that_takes_its_task_back_sends_its_text_as_the_new_attempts(sqlite_url: str) -> None:
    """Its lease ran out while the job still ran (here: no heartbeats, the worker used outside ``async
    with``): the next append is answered not-running, the worker takes the task back as attempt 2 and sends
    the batch again as that attempt's first, whose text replaces the first attempt's."""
    async with running_gateway(sqlite_url) as gw:
        body = {"id": "back-1", "ttlMs": 120_000, "maxAttempts": 2, "heartbeatMs": 1_000}
        made = (await gw.client.post("/v1/tasks", json=body)).json()
        async with http_client() as client:
            worker = Worker(gw.url, "back-1", made["callbackToken"], client=client)
            await worker.start("w1")
            await worker.write("output", "first attempt")
            await worker.flush()
            await eventually(
                lambda: gw.client.get("/v1/tasks/back-1"),
                lambda answer: answer.json()["state"] == "queued",
                "the lease ran out and requeued the task",
            )
            await worker.write("output", "taken back")
            await worker.flush()
            assert worker.attempt == 2
            await worker.succeed("s3://r/1", "sha256:1")
        text = await gw.client.get("/v1/tasks/back-1/streams/output/text")
        assert (text.text, text.headers["Stream-Attempt"]) == ("taken back", "2")
