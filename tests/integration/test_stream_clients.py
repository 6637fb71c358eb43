"""A task's streams as the Python clients follow them, against a real server: ``watch(..., streams=...)``
yields each stream's chunks in order across dropped connections (resuming from the offset after the last
chunk yielded), a retry's output starting the text over, and the stream's end after the task's; ``gateway
watch TASK --stream NAME`` prints the text as it is written on stdout and says on stderr when a new
attempt's output starts over."""

from __future__ import annotations

import os
import sys
from typing import Any

import anyio
import pytest

from gateway.client import watch
from gateway.client.backoff import Backoff
from tests.support import STEP_S, Running, TcpProxy, bearer, create_task, post_callback, running_gateway

pytestmark = pytest.mark.anyio

START = {"type": "start", "worker": "w1"}
RETRY = {"type": "fail", "error": "boom", "retryable": True}
SUCCEED = {"type": "succeed", "resultRef": "s3://r", "resultHash": "sha256:1"}


async def append(gw: Running, task_id: str, token: str, attempt: int, seq: int, *chunks: str) -> None:
    body = {"attempt": attempt, "seq": seq, "chunks": list(chunks)}
    answer = await gw.client.post(f"/v1/tasks/{task_id}/streams/output", json=body, headers=bearer(token))
    assert answer.status_code == 200, answer.text


def apply(held: dict[str, Any], frame: dict[str, Any]) -> None:
    """A client's rule (protocol.md, Live): the next offset of the attempt held continues the text; any
    other frame starts it over."""
    if (frame["attempt"], frame["offset"]) != (held["attempt"], held["next"]):
        held["text"] = ""
        held["restarts"].append(frame["attempt"])
    held["text"] += "".join(frame["chunks"])
    held["attempt"], held["next"] = frame["attempt"], frame["offset"] + len(frame["chunks"])


async def test_watch_yields_a_streams_chunks_in_order_across_drops_then_its_end(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw, TcpProxy(int(gw.url.rsplit(":", 1)[1])) as proxy:
        made = await create_task(gw, "llm-1", max_attempts=2)
        token = made.callback_token
        await post_callback(gw, "llm-1", token, START)
        await append(gw, "llm-1", token, 1, 0, "Once ", "upon ")
        held: dict[str, Any] = {"attempt": None, "next": 0, "text": "", "restarts": []}
        kinds: list[str] = []
        ended_at: list[int] = []
        step = 0  # where the watcher is: the producer goes on past a cut only once the watcher made it
        second_cut = anyio.Event()

        async def produce() -> None:
            await append(gw, "llm-1", token, 1, 1, "a ", "time")  # live, while watched
            await post_callback(gw, "llm-1", token, RETRY)  # attempt 1 fails and is retried
            await post_callback(gw, "llm-1", token, START)
            await append(gw, "llm-1", token, 2, 0, "There ", "was ")
            await second_cut.wait()
            await append(gw, "llm-1", token, 2, 1, "a ", "king.")
            await post_callback(gw, "llm-1", token, SUCCEED, attempt=2)

        frames = watch(
            proxy.url,
            {"llm-1": made.subscribe_token},
            streams={"llm-1": {"output": 0}},
            backoff=Backoff(base_s=0.01, cap_s=0.1),
            on_status=None,
        )
        with anyio.fail_after(STEP_S * 3):
            async with anyio.create_task_group() as tg:
                async for frame in frames:
                    kinds.append(frame["type"])
                    if frame["type"] == "chunks":
                        apply(held, frame)
                    elif frame["type"] == "end":
                        ended_at.append(frame["offset"])
                    if held["next"] == 2 and step == 0:
                        step = 1
                        proxy.cut()  # a drop after the first batch: resumed from offset 2
                        tg.start_soon(produce)
                    elif held["text"] == "There was " and step == 1:
                        step = 2
                        proxy.cut()  # a drop inside the second attempt: resumed from offset 6
                        second_cut.set()
        assert proxy.cuts == 2
        assert held["text"] == "There was a king."
        assert held["restarts"] == [1, 2]  # the first frame, then the retry's output replacing attempt 1's
        text = await gw.client.get(
            "/v1/tasks/llm-1/streams/output/text", headers=bearer(made.subscribe_token)
        )
        assert text.text == held["text"]
        assert ended_at == [8] and kinds[-1] == "end"  # after the task's terminal frame, once
        last_entry = max(i for i, kind in enumerate(kinds) if kind != "chunks" and kind != "end")
        assert kinds.index("end") > last_entry


async def test_gateway_watch_stream_prints_the_text_and_says_when_a_retry_starts_it_over(
    sqlite_url: str,
) -> None:
    async with running_gateway(sqlite_url) as gw:
        made = await create_task(gw, "llm-2", max_attempts=2)
        token = made.callback_token
        await post_callback(gw, "llm-2", token, START)
        await append(gw, "llm-2", token, 1, 0, "half an ", "answer")
        command = [sys.executable, "-m", "gateway.cli", "watch", "llm-2", "--url", gw.url]
        command += ["--token", made.subscribe_token, "--stream", "output"]
        process = await anyio.open_process(command, env={**os.environ, "COLUMNS": "100"})
        async with process:
            assert process.stdout is not None and process.stderr is not None
            out = b""
            with anyio.fail_after(STEP_S):
                while b"half an answer" not in out:  # the text so far, before anything more happens
                    out += await process.stdout.receive()
            await post_callback(gw, "llm-2", token, RETRY)
            await post_callback(gw, "llm-2", token, START)
            await append(gw, "llm-2", token, 2, 0, "The whole ", "answer.\n")
            await post_callback(gw, "llm-2", token, SUCCEED, attempt=2)
            with anyio.fail_after(STEP_S):
                out += b"".join([chunk async for chunk in process.stdout])
                err = b"".join([chunk async for chunk in process.stderr]).decode()
                code = await process.wait()
        assert code == 0, err
        assert out.decode() == "half an answer\nThe whole answer.\n"
        assert "llm-2: the output starts over (attempt 2)" in err, err
        assert err.rstrip().endswith("llm-2: succeeded"), err
