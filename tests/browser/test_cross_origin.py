"""gateway-client.js imported as a module by a page of another origin that the gateway allows, holding
only a subscribe token: the module itself, the WebSocket, the SSE fallback and a read of the task all
cross origins (the gateway's CORS headers and its WebSocket origin check)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import pytest

from gateway.client import Worker
from tests.support import running_gateway

if TYPE_CHECKING:
    from tests.browser.conftest import Console

pytestmark = pytest.mark.anyio

API_KEY = "browser-test-api-key"

# The page of the other origin: a static import from the gateway, one client over the WebSocket and one
# whose WebSocket never opens (so it falls back to SSE), and a read with the subscribe token.
PAGE = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><link rel="icon" href="data:,"><title>another app</title></head>
<body>
<script type="module">
import { GatewayClient } from "{gateway}/static/gateway-client.js";

const params = new URLSearchParams(location.search);
const taskId = params.get("task");
const token = params.get("token");
class NoWebSocket {
  constructor() { setTimeout(() => this.onclose && this.onclose({ code: 1006 }), 10); }
  send() {}
  close() {}
}
window.received = { ws: [], sse: [] };
const clients = {
  ws: new GatewayClient("{gateway}"),
  sse: new GatewayClient("{gateway}", { WebSocket: NoWebSocket, storage: null }),
};
for (const [name, client] of Object.entries(clients)) {
  client.subscribe(taskId, token, (frame, task) => {
    window.received[name].push({ type: frame.type, version: frame.version, state: task.state });
    document.body.dataset[name] = `${task.state}@${task.version}`;
  }, { onError: (error) => (document.body.dataset[name] = `error:${error.code}`) });
}
window.transports = () => Object.fromEntries(Object.entries(clients).map(([n, c]) => [n, c.transport]));
const read = await fetch(`{gateway}/v1/tasks/${encodeURIComponent(taskId)}`, {
  headers: { Authorization: `Bearer ${token}` },
});
document.body.dataset.read = `${read.status}:${(await read.json()).state}`;
</script>
</body>
</html>
"""


@asynccontextmanager
async def other_origin(pages: dict[str, str]) -> AsyncIterator[str]:
    """A bare HTTP server on another loopback port: ``/`` answers ``pages["/"]``, anything else 404."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await reader.readuntil(b"\r\n\r\n")
            path = request.split(b" ", 2)[1].decode().split("?", 1)[0]
            body = pages.get(path)
            status = "200 OK" if body is not None else "404 Not Found"
            data = (body or "not found").encode()
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: text/html; charset=utf-8\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + data)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, IndexError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def test_client_module_from_an_allowed_origin(sqlite_url: str, context: Any, console: Console) -> None:
    pages: dict[str, str] = {}
    async with (
        other_origin(pages) as origin,
        running_gateway(sqlite_url, allowed_origins=(origin,), api_key=API_KEY) as gw,
    ):
        pages["/"] = PAGE.replace("{gateway}", gw.url)
        answer = await gw.client.post(
            "/v1/tasks",
            json={"id": "elsewhere-1", "ttlMs": 600_000, "maxAttempts": 2},
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
        assert answer.status_code == 201, answer.text
        created = answer.json()

        page = await context.new_page()
        try:
            page.on("console", lambda m: console.errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: console.page_errors.append(str(e)))
            await page.goto(f"{origin}/?task=elsewhere-1&token={created['subscribeToken']}")
            body = page.locator("body")
            # Both clients are subscribed (the resume frame at version 0) and the token reads the task.
            await page.wait_for_function(
                "document.body.dataset.ws === 'queued@0' && document.body.dataset.sse === 'queued@0'"
            )
            await page.wait_for_function("document.body.dataset.read === '200:queued'")
            assert await page.evaluate("window.transports()") == {"ws": "websocket", "sse": "sse"}

            async with Worker(gw.url, "elsewhere-1", created["callbackToken"]) as worker:
                await worker.start("w1")
                await worker.progress(40, "half")
                await worker.succeed("s3://results/elsewhere-1", "sha256:02")
            await page.wait_for_function(
                "document.body.dataset.ws === 'succeeded@3' && document.body.dataset.sse === 'succeeded@3'",
                timeout=10_000,
            )
            received = await page.evaluate("window.received")
            for name in ("ws", "sse"):
                frames = received[name]
                assert frames[0] == {"type": "caught-up", "version": 0, "state": "queued"}, (name, frames)
                assert [f["version"] for f in frames] == [0, 1, 2, 3], (name, frames)
                assert [f["state"] for f in frames[1:]] == ["running", "running", "succeeded"], (name, frames)
            assert (await body.get_attribute("data-read")) == "200:queued"
        finally:
            await page.close()
    console.assert_clean()


async def test_client_module_refused_for_an_origin_not_allowed(sqlite_url: str, context: Any) -> None:
    """The same page on an origin the gateway does not list: the browser refuses the module (no CORS)."""
    pages: dict[str, str] = {}
    async with (
        other_origin(pages) as origin,
        running_gateway(sqlite_url, allowed_origins=("http://127.0.0.1:1",), api_key=API_KEY) as gw,
    ):
        pages["/"] = PAGE.replace("{gateway}", gw.url)
        page = await context.new_page()
        try:
            async with page.expect_console_message(
                lambda m: m.type == "error" and "CORS" in m.text and "gateway-client.js" in m.text
            ):
                await page.goto(f"{origin}/?task=elsewhere-2&token=none")
            assert await page.evaluate("window.received === undefined")
        finally:
            await page.close()
