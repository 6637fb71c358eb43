"""The Node worker helper (``static/gateway-worker.js``) under ``node --test`` (tests/node/) against a real
gateway started here, directly and through a proxy that loses 30% of its answers: the helper's own tests
check what the gateway holds; this one checks, from the proxy's record, that answers were lost and that
each lost one was followed by a retry answered as a duplicate (the same ``seq``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import anyio
import pytest

from tests.support import create_task, doc_blocks, running_gateway
from tests.support.lossy_proxy import LossyProxy

ROOT = Path(__file__).resolve().parents[2]
NODE_TESTS = ROOT / "tests" / "node" / "worker.test.mjs"


@pytest.mark.anyio
async def test_the_node_worker_helper_passes_its_tests_against_a_real_gateway(sqlite_url: str) -> None:
    node = shutil.which("node")
    if node is None:
        if os.environ.get("CI"):
            pytest.fail("node is missing (CI must run the Node worker helper's tests)")
        pytest.skip("node is missing: install Node.js 20 to test static/gateway-worker.js")
    async with running_gateway(sqlite_url) as gw:
        proxy = LossyProxy(int(gw.url.rsplit(":", 1)[1]), loss=0.3, seed=11)
        async with proxy.running() as lossy_url:
            env = {**os.environ, "GATEWAY_URL": gw.url, "GATEWAY_LOSSY_URL": lossy_url}
            with anyio.fail_after(120):
                done = await anyio.run_process([node, "--test", str(NODE_TESTS)], env=env, check=False)
        output = done.stdout.decode() + done.stderr.decode()
        assert done.returncode == 0, output
        proxy.check_appends(300)  # tests/node/worker.test.mjs's lossy test: 300 lines


@pytest.mark.anyio
async def test_the_node_pages_example_streams_its_answer(sqlite_url: str, tmp_path: Path) -> None:
    """docs/node-worker.md's example, saved as the reader saves it beside gateway-worker.js, run by node."""
    node = shutil.which("node")
    if node is None:
        if os.environ.get("CI"):
            pytest.fail("node is missing (CI must run the Node worker helper's example)")
        pytest.skip("node is missing: install Node.js 20 to run docs/node-worker.md's example")
    (example,) = [b for b in doc_blocks.blocks("docs/node-worker.md") if b.mark == doc_blocks.RUN_BY]
    (tmp_path / "answer.mjs").write_text(example.text)
    shutil.copy(ROOT / "static" / "gateway-worker.js", tmp_path / "gateway-worker.js")
    async with running_gateway(sqlite_url) as gw:
        made = await create_task(gw, "answer-48", ttl_ms=120_000, max_attempts=1)
        env = {
            **os.environ,
            "GATEWAY_URL": gw.url,
            "TASK_ID": "answer-48",
            "CALLBACK_TOKEN": made.callback_token,
        }
        with anyio.fail_after(60):
            done = await anyio.run_process([node, "answer.mjs"], cwd=tmp_path, env=env, check=False)
        assert done.returncode == 0, done.stdout.decode() + done.stderr.decode()
        text = await gw.client.get("/v1/tasks/answer-48/streams/output/text")
        assert text.text == "The quick brown fox jumps over the lazy dog. "
        task = (await gw.client.get("/v1/tasks/answer-48")).json()
        assert (task["state"], task["progress"]) == ("succeeded", 100)
