"""A task's title and live metadata from the Python clients against a real gateway (issue 34): ``Backend``
creates with a title and metadata and patches with the API key; ``Worker.metadata``/``message`` patch as
the attempt, through a proxy that loses answers after the gateway wrote them (each patch taken once in
effect: a merge patch sent again changes nothing more), beside the history, never in it; a queue job's
``Run.metadata`` goes the same way without blocking, before its outcome; ``watch`` yields the metadata frames
and ends holding the store's metadata; and the refusals are the clients' errors.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

import anyio
import httpx
import pytest
from anyio.streams.text import TextReceiveStream

from gateway.client import AsyncBackend, CallbackError, TaskCancelled, Worker, watch
from gateway.integrations.report import GatewayConfig, Reporter
from gateway.json_merge_patch import merge_patch as apply
from tests.support import STEP_S, eventually, mint, running_gateway
from tests.support.lossy_proxy import LossyProxy

PATCHES: list[dict[str, Any]] = [
    {"file": "a.csv", "rows": 0, "columns": {"id": "int", "name": "text"}},
    *({"rows": n * 100, "message": f"Row {n * 100}"} for n in range(1, 16)),
    {"columns": {"name": None, "price": "decimal"}},
    {"file": None, "message": "Done"},
]


def metadata_answers(proxy: LossyProxy) -> list[bool]:
    """Whether each answer to a metadata patch the proxy carried was passed on (callbacks' answers carry a
    ``reason``)."""
    answers = [(json.loads(carried.body), carried.delivered) for carried in proxy.carried]
    return [delivered for answer, delivered in answers if set(answer) == {"task"}]


@pytest.mark.anyio
async def test_a_workers_patches_are_merged_once_in_order_through_lost_answers_beside_the_history(
    sqlite_url: str,
) -> None:
    expected: dict[str, Any] = {"owner": "u42"}
    for patch in PATCHES:
        expected = apply(expected, patch)
    async with running_gateway(sqlite_url) as gw, AsyncBackend(gw.url) as backend:
        made = await backend.create(
            "meta-1", ttl_ms=120_000, title="Import of a.csv", metadata={"owner": "u42"}
        )
        assert (made.task["title"], made.task["metadata"]) == ("Import of a.csv", {"owner": "u42"})
        seen: list[dict[str, Any]] = []

        async def follow() -> None:
            async for frame in watch(gw.url, {"meta-1": mint("meta-1")}, on_status=None):
                seen.append(frame)

        proxy = LossyProxy(int(gw.url.rsplit(":", 1)[1]), loss=0.3, seed=11)
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow)
            async with (
                proxy.running() as url,
                httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_keepalive_connections=0)) as client,
                Worker(url, "meta-1", made.callback_token, client=client) as worker,
            ):
                await worker.start("w1")
                for n, patch in enumerate(PATCHES):
                    answer = await worker.metadata(patch)
                    if n == 3:
                        await worker.progress(50)
                assert answer["task"]["metadata"] == expected
                await worker.message("Imported")
                await worker.succeed("s3://imports/a", "sha256:1")
        expected["message"] = "Imported"
        task = (await gw.client.get("/v1/tasks/meta-1")).json()
        assert (task["metadata"], task["title"], task["version"]) == (expected, "Import of a.csv", 3)
        events = (await gw.client.get("/v1/tasks/meta-1/events", params={"cursor": 0})).json()["events"]
        assert [entry["event"]["type"] for entry in events] == ["start", "progress", "succeed"]
        lost = metadata_answers(proxy)
        assert len(lost) > len(PATCHES) and not all(lost)  # answers were lost, and their patches sent again
        # The subscriber saw the metadata move, and holds the store's at the end.
        live = [frame for frame in seen if frame["type"] == "metadata"]
        assert live and seen[-1]["task"]["metadata"] == expected
        revisions = [frame["revision"] for frame in live]
        assert revisions == sorted(revisions)


@pytest.mark.anyio
async def test_a_refused_patch_and_a_cancelled_task_raise_the_clients_errors(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw, AsyncBackend(gw.url) as backend:
        made = await backend.create("meta-2", ttl_ms=120_000)
        async with Worker(gw.url, "meta-2", made.callback_token) as worker:
            with pytest.raises(RuntimeError, match="before start"):
                await worker.metadata({"a": 1})
            await worker.start("w1")
            with pytest.raises(ValueError, match="at most 8192"):
                await worker.metadata({"blob": "x" * 9_000})  # refused before it is sent
            await worker.metadata({"blob": "x" * 5_000})
            with pytest.raises(CallbackError) as refused:
                await worker.metadata({"more": "y" * 5_000})  # 10 KB merged: past the gateway's 8 KiB
            assert (refused.value.status, refused.value.code) == (413, "metadata-too-large")
            await backend.cancel("meta-2")
            with pytest.raises(TaskCancelled):
                await worker.message("still here?")
        # The API key patches any task, an ended one too.
        task = await backend.patch_metadata("meta-2", {"blob": None, "note": "cancelled by support"})
        assert task["metadata"] == {"note": "cancelled by support"} and task["state"] == "failed"


@pytest.mark.anyio
async def test_a_queue_jobs_patches_go_without_blocking_before_its_outcome_through_lost_answers(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_gateway(sqlite_url) as gw:
        proxy = LossyProxy(int(gw.url.rsplit(":", 1)[1]), loss=0.3, seed=5)
        async with proxy.running() as url:
            reporter = Reporter(GatewayConfig(url=url, api_key=None, timeout_s=5.0, min_interval_s=0.05))

            def job() -> None:
                ticket = reporter.create(
                    "run-1", ttl_ms=120_000, max_attempts=1, heartbeat_ms=None, tags=(), title="export(1)"
                )
                assert ticket is not None and ticket.title == "export(1)"
                run = reporter.begin("run-1", worker="w1", ticket=ticket, scheme="celery")
                for n in range(1, 301):
                    run.progress(n // 3)
                    run.metadata({"current": n, "total": 300})
                    run.message(f"Row {n} of 300")
                    if n % 30 == 0:
                        time.sleep(0.06)  # the job's own pace, not a wait for the sender
                run.metadata({"total": None, "blob": "x" * 5_000})
                run.metadata({"more": "y" * 5_000})  # past 8 KiB merged: refused, dropped, said
                run.succeed("s3://exports/1")
                run.finish()

            with caplog.at_level(logging.WARNING, logger="gateway.integrations"):
                await anyio.to_thread.run_sync(job)
                task = await eventually(
                    lambda: gw.client.get("/v1/tasks/run-1"),
                    lambda answer: answer.json()["state"] == "succeeded",
                    "the run's outcome taken",
                )
        assert task.json()["metadata"] == {"current": 300, "message": "Row 300 of 300", "blob": "x" * 5_000}
        assert task.json()["title"] == "export(1)"
        said = [r.getMessage() for r in caplog.records if "patch of task run-1 refused" in r.getMessage()]
        assert len(said) == 1 and "413 metadata-too-large" in said[0]
        # 600 patches went as far fewer requests (composed while they waited), each merged once in effect.
        sent = metadata_answers(proxy)
        assert 1 <= len(sent) < 300, len(sent)


@pytest.mark.anyio
async def test_gateway_watch_shows_the_title_and_each_new_status_line(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw, AsyncBackend(gw.url) as backend:
        made = await backend.create("cli-meta", ttl_ms=120_000, title="Monthly sales export")
        command = [sys.executable, "-m", "gateway.cli", "watch", "cli-meta", "--url", gw.url]
        process = await anyio.open_process([*command, "--token", made.subscribe_token])
        async with process, Worker(gw.url, "cli-meta", made.callback_token) as worker:
            assert process.stdout is not None
            lines = TextReceiveStream(process.stdout)
            printed = ""

            async def printed_line(text: str) -> None:
                nonlocal printed
                with anyio.fail_after(STEP_S):
                    while text not in printed:
                        printed += await lines.receive()

            await printed_line("Monthly sales export  (cli-meta)")  # its first frame: the title, then its id
            await worker.start("w")
            await worker.message("Reading 1,200 rows")
            await printed_line("  Reading 1,200 rows")
            await worker.progress(50)
            await worker.message("Writing the report")
            await printed_line("  Writing the report")
            await worker.succeed("s3://r", "sha256:r")
            with anyio.fail_after(STEP_S):
                async for chunk in lines:
                    printed += chunk
                assert await process.wait() == 0
        assert printed.count("Reading 1,200 rows") == 1  # said when it changed, not at every frame
        assert "cli-meta: succeeded" in printed
