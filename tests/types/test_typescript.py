"""The TypeScript face of gateway-client.js: ``gateway-client.d.ts`` is served beside it, and ``tsc --strict``
accepts an application's use of the client and the React example of docs/react.md (``tests/types/check``,
which installs TypeScript from the npm registry once, outside git)."""

from __future__ import annotations

import os
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
