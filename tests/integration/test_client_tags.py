"""The Python clients of a tag against a real server: ``watch_tag`` through dropped connections (every
task's entries once each, in order, a task created while it was away included, the cursors map kept), and
``gateway watch --tag`` (the tag's tasks, one created while it runs, each change, a refusal)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import AsyncGenerator

import anyio
import pytest
from anyio.abc import ByteReceiveStream

from gateway.client import WatchError, Worker, watch_tag
from gateway.client.backoff import Backoff
from tests.integration.test_client import _killed_on_failure, port_of
from tests.support import TcpProxy, running_gateway, wait_until
from tests.support.tagged import Handed, create_tagged, tag_token

TAG = "owner:u42"


async def run(worker: Worker, steps: int) -> None:
    """start, progress 1..steps, succeed: steps + 2 entries."""
    await worker.start("w1")
    for p in range(1, steps + 1):
        await worker.progress(p, f"row-{p}")
    await worker.succeed(f"s3://results/{worker.task_id}", "sha256:1")


@pytest.mark.anyio
async def test_watch_tag_through_drops_hands_on_every_entry_once_and_a_task_made_meanwhile(
    sqlite_url: str,
) -> None:
    async with running_gateway(sqlite_url, retention_versions=10_000) as gw, TcpProxy(port_of(gw)) as proxy:
        made = {task_id: await create_tagged(gw, task_id, [TAG]) for task_id in ("a", "b")}
        other = await create_tagged(gw, "c", ["owner:u7"])  # another tag: never seen
        token = await tag_token(gw, TAG)
        handed = Handed()
        cursors: dict[str, int] = {}
        listed, d_seen = anyio.Event(), anyio.Event()
        cut_at = [10, 30, 50]

        async def produce() -> None:
            await listed.wait()
            async with anyio.create_task_group() as tg:
                for task_id, task in (*made.items(), ("c", other)):
                    tg.start_soon(_run_closing, Worker(gw.url, task_id, task.callback_token), 30)

        async def make_d() -> None:
            # Created once the link has dropped a first time (most likely while it is down).
            await wait_until(lambda: proxy.cuts >= 1, "the first cut")
            d = await create_tagged(gw, "d", [TAG, "project:7"])
            await d_seen.wait()
            async with Worker(gw.url, "d", d.callback_token) as worker:
                await run(worker, 10)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                tg.start_soon(make_d)
                frames = watch_tag(
                    proxy.url, TAG, token, cursors=cursors, backoff=Backoff(base_s=0.01, cap_s=0.1)
                )
                assert isinstance(frames, AsyncGenerator)  # closed below, once every task has ended
                async for frame in frames:
                    handed.take(frame)
                    if frame["type"] == "tag":
                        listed.set()
                    if "d" in handed.version:
                        d_seen.set()
                    if cut_at and handed.total() >= cut_at[0]:
                        cut_at.pop(0)
                        proxy.cut()
                    if handed.ended("a", "b", "d"):
                        break
                await frames.aclose()

        assert proxy.cuts == 3
        assert handed.entries == {"a": list(range(1, 33)), "b": list(range(1, 33)), "d": list(range(1, 13))}
        # a and b were known from the first list, as they were (version 0); d as a new task, before any entry.
        assert [handed.first[t]["type"] for t in ("a", "b", "d")] == ["snapshot"] * 3
        assert handed.first["d"]["version"] == 0 and handed.first["d"]["reason"] == "new"
        assert handed.listings[0] == ["b", "a"]  # newest first
        assert all(listing in (["b", "a"], ["d", "b", "a"]) for listing in handed.listings), handed.listings
        assert "c" not in handed.version and "c" not in handed.added
        assert handed.added in ([], ["d"])  # announced once, unless it came in a list after a drop
        # The map it kept, for a later run, is every task at the version handed on last: the gateway's.
        assert cursors == {"a": 32, "b": 32, "d": 12}
        for task_id in ("a", "b", "d"):
            assert handed.task[task_id] == (await gw.client.get(f"/v1/tasks/{task_id}")).json()


async def _run_closing(worker: Worker, steps: int) -> None:
    async with worker:
        await run(worker, steps)


async def read_lines(stream: ByteReceiveStream, lines: list[str]) -> None:
    buffered = b""
    async for chunk in stream:
        buffered += chunk
        *done, buffered = buffered.split(b"\n")
        lines.extend(line.decode() for line in done)
    if buffered:
        lines.append(buffered.decode())


@pytest.mark.anyio
async def test_gateway_watch_tag_prints_the_tasks_a_new_one_and_each_change(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        first = await create_tagged(gw, "report-1", [TAG])
        async with Worker(gw.url, "report-1", first.callback_token) as worker:
            await run(worker, 1)
        await create_tagged(gw, "report-2", [TAG])
        await create_tagged(gw, "elsewhere", ["owner:u7"])
        token = await tag_token(gw, TAG)
        command = [sys.executable, "-m", "gateway.cli", "watch", "--tag", TAG, "--url", gw.url]
        env = {**os.environ, "GATEWAY_TOKEN": token}
        process = await anyio.open_process(command, env=env)
        out: list[str] = []
        err: list[str] = []

        async def said(text: str) -> None:
            await wait_until(
                lambda: any(text in line for line in out),
                lambda: f"{text!r} printed by gateway watch --tag (stdout {out}, stderr {err})",
                within_s=30,
            )

        async with process:
            assert process.stdout is not None and process.stderr is not None
            with anyio.fail_after(40), _killed_on_failure(process):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(read_lines, process.stdout, out)
                    tg.start_soon(read_lines, process.stderr, err)
                    await said(f"{TAG}: 2 tasks")
                    await said("report-1  v3  succeeded 100%")
                    await said("report-2  v0  queued 0%")
                    third = await create_tagged(gw, "report-3", [TAG])
                    await said("report-3  added")
                    async with Worker(gw.url, "report-3", third.callback_token) as worker:
                        await worker.start("w9")
                        await said("report-3  v1  started by w9")
                        await worker.progress(40, "row-40")
                        await said("report-3  v2  progress 40% (row-40)")
                        await worker.succeed("s3://results/3", "sha256:3")
                    await said("report-3: succeeded")
                    process.send_signal(signal.SIGINT)
                    returncode = await process.wait()
        assert returncode == 130, (out, err)
        lines = [line for line in out if line.strip()]
        assert lines[:3] == [
            f"{TAG}: 2 tasks",
            "report-2  v0  queued 0%, attempt 0/2",
            "report-1  v3  succeeded 100%, attempt 1/2",
        ]
        assert not any("elsewhere" in line for line in out), out
        assert sum("report-3  added" in line for line in out) == 1, out


@pytest.mark.anyio
async def test_a_token_for_another_tag_is_refused_and_not_retried(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        await create_tagged(gw, "report-1", [TAG])
        wrong = await tag_token(gw, "owner:u7")
        with anyio.fail_after(20), pytest.raises(WatchError) as raised:
            async for frame in watch_tag(gw.url, TAG, wrong):
                pytest.fail(f"a frame for a token of another tag: {frame}")
        assert (raised.value.code, raised.value.tag) == ("forbidden", TAG)

        command = [
            sys.executable,
            "-m",
            "gateway.cli",
            "watch",
            "--tag",
            TAG,
            "--url",
            gw.url,
            "--token",
            wrong,
        ]
        with anyio.fail_after(30):
            done = await anyio.run_process(command, check=False)
        assert done.returncode == 4, done
        assert done.stderr.decode().startswith("gateway watch: giving up: forbidden: "), done.stderr
        assert done.stdout == b""
