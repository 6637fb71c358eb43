"""The TypeScript face of gateway-client.js: ``gateway-client.d.ts`` is served beside it, and ``tsc --strict``
accepts an application's use of the client and the React example of docs/react.md (``tests/types/check``,
which installs TypeScript from the npm registry once, outside git)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support import running_gateway

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.anyio
async def test_the_types_are_served_beside_the_client(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, sweep_interval_ms=0) as gw:
        answer = await gw.client.get("/static/gateway-client.d.ts")
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/typescript; charset=utf-8"
    assert answer.text == (ROOT / "static" / "gateway-client.d.ts").read_text()
    assert "export class GatewayClient" in answer.text


def test_tsc_accepts_the_types_the_usage_and_the_react_example() -> None:
    if shutil.which("npm") is None:
        if os.environ.get("CI"):
            pytest.fail("npm is missing (CI must type-check the client)")
        pytest.skip("npm is missing: install Node.js to type-check gateway-client.d.ts")
    done = subprocess.run(
        [str(ROOT / "tests" / "types" / "check")], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_types_declare_every_public_method_and_option_of_the_client() -> None:
    """The declarations follow gateway-client.js: a method or option added there and not here fails."""
    source = (ROOT / "static" / "gateway-client.js").read_text()
    types = (ROOT / "static" / "gateway-client.d.ts").read_text()
    methods = set(re.findall(r"^  ([a-zA-Z]\w*)\(", source, re.MULTILINE)) - {"constructor"}
    assert {"subscribe", "unsubscribe", "onState", "close"} <= methods
    for method in sorted(methods):
        assert re.search(rf"^  {method}\(", types, re.MULTILINE), f"GatewayClient.{method} is not declared"
    options = set(re.findall(r"@property \{[^}]*\} \[(\w+)", source))
    assert {"WebSocket", "heartbeatMs"} <= options
    for option in sorted(options):
        assert re.search(rf"^  {option}\?:", types, re.MULTILINE), f"ClientOptions.{option} is not declared"
    exports = set(re.findall(r"^export (?:class|function) (\w+)", source, re.MULTILINE))
    for name in sorted(exports):
        assert re.search(rf"^export (?:declare )?(?:class|function) {name}\b", types, re.MULTILINE), name


def test_the_worker_types_declare_every_export_and_method_of_the_node_worker() -> None:
    """gateway-worker.d.ts follows gateway-worker.js: an export or a public method added there and not here
    fails (tsc checks that what is declared is used rightly: tests/types/worker.ts)."""
    source = (ROOT / "static" / "gateway-worker.js").read_text()
    types = (ROOT / "static" / "gateway-worker.d.ts").read_text()
    body = source[source.index("export class GatewayWorker") :]
    methods = set(re.findall(r"^  (?:async )?([a-z]\w*)\(", body, re.MULTILINE)) - {"constructor"}
    assert {"start", "progress", "write", "flush", "heartbeat", "succeed", "fail", "close"} <= methods
    for method in sorted(methods):
        assert re.search(rf"^  {method}\(", types, re.MULTILINE), f"GatewayWorker.{method} is not declared"
    exports = set(re.findall(r"^export (?:class|function) (\w+)", source, re.MULTILINE))
    for name in sorted(exports):
        assert re.search(rf"^export (?:declare )?(?:class|function) {name}\b", types, re.MULTILINE), name
