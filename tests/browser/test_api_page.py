"""The API page at ``/docs`` in headless Chromium: it renders every route of ``/openapi.json`` and fetches
nothing from anywhere but the gateway itself (it works offline, behind a firewall, with no CDN)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pytest

from tests.browser.conftest import VIEWPORTS, cut_or_off_screen, screenshot
from tests.support import Running

if TYPE_CHECKING:
    from tests.browser.conftest import Console

MAX_STORED = "9223372036854775807"  # 2**63 - 1: past what a JavaScript number holds exactly

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


@pytest.mark.parametrize("viewport", VIEWPORTS)
async def test_the_api_page_fits_the_screen_and_states_every_bound_exactly(
    gw: Running, page: Any, console: Console, viewport: dict[str, int]
) -> None:
    """On a desktop and on a phone, every route's and model's tables stay inside their card and nothing
    scrolls sideways; a bound of 2**63-1 (a callback's `attempt`, `maxAttempts`) reads digit for digit, not
    as the nearest JavaScript number (9223372036854776000)."""
    from playwright.async_api import expect

    await page.set_viewport_size(viewport)
    await page.goto(gw.url + "/docs")
    await page.wait_for_selector("body[data-ready=true]", state="attached")

    attempt = page.locator("#model-CallbackBody tr").filter(has=page.get_by_text("attempt", exact=True))
    await expect(attempt).to_contain_text(f"≤ {MAX_STORED}")
    for model, field in (("HeartbeatBody", "attempt"), ("CreateBody", "maxAttempts")):
        row = page.locator(f"#model-{model} tr").filter(has=page.get_by_text(field, exact=True))
        await expect(row).to_contain_text(f"≤ {MAX_STORED}")
    assert "9223372036854776000" not in await page.locator("body").inner_text()

    assert await cut_or_off_screen(page, "section.operation, section.model") == []
    assert await cut_or_off_screen(page, "section.operation table, section.model table") == []
    assert await page.evaluate("document.documentElement.scrollWidth <= innerWidth")
    await page.locator("#model-CallbackBody").scroll_into_view_if_needed()
    await screenshot(page, "docs-callback-body", full_page=False)
    await page.locator(
        'section.operation[data-path="/v1/tasks/{task_id}/events"]'
    ).scroll_into_view_if_needed()
    await screenshot(page, "docs-events", full_page=False)
    console.assert_clean()


# A browser whose JSON.parse gives a reviver no source text (before Chrome 114, Firefox 135, Safari 18.4).
NO_SOURCE_TEXT = """
const parse = JSON.parse;
JSON.parse = (text, reviver) => parse(text, reviver && ((key, value) => reviver.call(this, key, value)));
"""


async def test_a_browser_that_rounds_a_bound_says_it_is_approximate(
    gw: Running, page: Any, console: Console
) -> None:
    from playwright.async_api import expect

    await page.add_init_script(NO_SOURCE_TEXT)
    await page.goto(gw.url + "/docs")
    await page.wait_for_selector("body[data-ready=true]", state="attached")
    attempt = page.locator("#model-CallbackBody tr").filter(has=page.get_by_text("attempt", exact=True))
    await expect(attempt).to_contain_text("≤ about 9.223e+18")
    assert "9223372036854776000" not in await page.locator("body").inner_text()
    console.assert_clean()
