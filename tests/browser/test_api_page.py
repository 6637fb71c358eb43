"""The API page at ``/docs`` in headless Chromium: it renders every route of ``/openapi.json`` and fetches
nothing from anywhere but the gateway itself (it works offline, behind a firewall, with no CDN)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pytest

from tests.support import Running

if TYPE_CHECKING:
    from tests.browser.conftest import Console

pytestmark = pytest.mark.anyio


async def test_the_api_page_shows_every_route_with_nothing_from_elsewhere(
    gw: Running, page: Any, console: Console
) -> None:
    from playwright.async_api import expect

    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    await page.goto(gw.url + "/docs")
    await page.wait_for_selector("body[data-ready=true]", state="attached")

    doc = (await gw.client.get("/openapi.json")).json()
    expected = {(m.upper(), path) for path, methods in doc["paths"].items() for m in methods}
    shown = await page.eval_on_selector_all(
        "section.operation", "els => els.map(e => [e.dataset.method, e.dataset.path])"
    )
    assert {tuple(s) for s in shown} == expected and len(shown) == len(expected)
    callbacks = page.locator('section.operation[data-path="/v1/tasks/{task_id}/callbacks"]')
    await expect(callbacks).to_be_visible()
    await expect(callbacks).to_contain_text("callbackToken")
    await expect(callbacks).to_contain_text("409")
    await expect(page.locator("#model-CallbackAnswer")).to_contain_text("terminal-conflict")
    await expect(page.locator("#websockets")).to_contain_text("/v1/ws")

    assert requested, "no request recorded"
    for url in requested:
        assert urlsplit(url).hostname == "127.0.0.1", url
    console.assert_clean()
