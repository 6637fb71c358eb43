"""The dashboard at ``/`` in headless Chromium: demo tasks to the end, a reload that resumes from the kept
cursor, tasks from a link, and screenshots on a desktop and a phone-sized screen."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.browser.conftest import Dashboard
from tests.support import create_task, post_callback, running_gateway

if TYPE_CHECKING:
    from tests.browser.conftest import Console

pytestmark = pytest.mark.anyio


async def test_page_loads_clean_and_demo_tasks_run_to_success(dashboard: Dashboard, console: Console) -> None:
    await dashboard.open()
    page = dashboard.page
    await dashboard.expect(page.get_by_role("button", name="Start a demo task")).to_be_visible()
    await dashboard.expect(page.locator("#empty")).to_be_visible()

    # A demo ends `failed` now and then, by design: start a few side by side until one succeeds (bounded;
    # three all failing is about one chance in a thousand per round).
    started: list[str] = []
    succeeded: list[str] = []
    for _ in range(3):
        batch = [(await dashboard.start_demo())[0] for _ in range(3)]
        started += batch
        await dashboard.expect(dashboard.connection).to_have_attribute("data-state", "connected")
        await dashboard.expect(dashboard.connection).to_have_attribute("data-transport", "websocket")
        for task_id in batch:
            if await dashboard.wait_terminal(task_id) == "succeeded":
                succeeded.append(task_id)
        if succeeded:
            break
    assert succeeded, f"no demo task succeeded out of {len(started)}"

    await dashboard.expect(page.locator("#empty")).to_be_hidden()
    seen = await dashboard.seen()
    for task_id in started:
        # Each card ends exactly where the gateway says the task is, state, version, progress, attempts.
        await dashboard.assert_matches_server(task_id)
        progress = seen["cards"][task_id]["progress"]
        assert progress == sorted(progress) or 0 in progress, progress  # only a retry goes back to 0
    for task_id in succeeded:
        card = dashboard.card(task_id)
        bar = card.get_by_role("progressbar")
        await dashboard.expect(bar).to_have_attribute("aria-valuenow", "100")
        await dashboard.expect(card.locator(".state-badge")).to_have_text("succeeded")
        await dashboard.expect(card.locator(".f-event")).to_contain_text("succeeded: demo://results/")
        await dashboard.expect(card.locator(".f-time-left")).to_have_text("done")
        # It was live: the bar went through values between 0 and 100 on its way.
        assert any(0 < p < 100 for p in seen["cards"][task_id]["progress"]), seen["cards"][task_id]
    first = dashboard.card(started[0])
    assert await first.get_attribute("data-resume") in ("caught-up", "delta")
    assert await first.get_attribute("data-resumed-from") == "0"

    console.assert_clean()


async def test_reload_mid_task_resumes_from_the_kept_cursor(dashboard: Dashboard, console: Console) -> None:
    await dashboard.open()
    task_id, _ = await dashboard.start_demo()
    await dashboard.wait_card(task_id, "d.state === 'running' && Number(d.version) >= 3")
    kept_before = int(
        await dashboard.page.evaluate(f"sessionStorage.getItem('task-gateway:cursor:{task_id}')")
    )
    assert kept_before >= 3

    await dashboard.page.reload()
    await dashboard.page.wait_for_selector("body[data-ready=true]", state="attached")
    # The card is back (the tab's list survives the reload) and resumed from the kept cursor, not from 0.
    await dashboard.wait_card(task_id, "d.resume !== ''", timeout_ms=10_000)
    data = await dashboard.dataset(task_id)
    assert data["resume"] in ("caught-up", "delta"), data
    assert int(data["resumedFrom"]) >= kept_before, data
    assert data["resumes"] == "1", data

    await dashboard.wait_terminal(task_id)
    await dashboard.assert_matches_server(task_id)
    console.assert_clean()


async def test_tasks_from_a_link_and_the_form(dashboard: Dashboard, console: Console) -> None:
    """`/?task=A&token=TA&task=B&token=TB` watches both; the form adds more; a wrong token shows as an
    error until the right one is given; removing a task forgets it, across a reload too."""
    gw = dashboard.gw
    names = ("link-a", "link-b", "form-c", "fix-d")
    a, b, c, d = [await create_task(gw, name, ttl_ms=600_000, max_attempts=3) for name in names]
    await dashboard.open(f"?task=link-a&token={a['subscribeToken']}&task=link-b&token={b['subscribeToken']}")
    for task_id in ("link-a", "link-b"):
        await dashboard.wait_card(task_id, "d.state === 'queued' && d.resume === 'caught-up'", 10_000)
    card = dashboard.card("link-a")
    await dashboard.expect(card.locator(".f-attempts")).to_have_text("0 of 3")
    await dashboard.expect(card.locator(".f-time-left")).to_have_text(re.compile(r"^(10m 00s|9m \d\ds)$"))

    form = dashboard.page.locator("#add-task")
    await form.get_by_label("Task id").fill("form-c")
    await form.get_by_label("Subscribe token").fill(c["subscribeToken"])
    await form.get_by_role("button", name="Watch").click()
    await dashboard.wait_card("form-c", "d.state === 'queued'", 10_000)

    # A worker starts it: the card follows, with the latest event.
    await post_callback(gw, "form-c", c["callbackToken"], {"type": "start", "worker": "w-7"})
    await dashboard.wait_card("form-c", "d.state === 'running' && d.version === '1'", 10_000)
    await dashboard.expect(dashboard.card("form-c").locator(".f-event")).to_contain_text("started by w-7")
    await dashboard.expect(dashboard.card("form-c").locator(".f-attempts")).to_have_text("1 of 3")

    # A wrong token (another task's): the card says so instead of waiting forever; the right one fixes it.
    await form.get_by_label("Task id").fill("fix-d")
    await form.get_by_label("Subscribe token").fill(a["subscribeToken"])
    await form.get_by_role("button", name="Watch").click()
    await dashboard.wait_card("fix-d", "d.state === 'error'", 10_000)
    await dashboard.expect(dashboard.card("fix-d").locator(".card-error")).to_contain_text("forbidden")
    await form.get_by_label("Task id").fill("fix-d")
    await form.get_by_label("Subscribe token").fill(d["subscribeToken"])
    await form.get_by_role("button", name="Watch").click()
    await dashboard.wait_card("fix-d", "d.state === 'queued'", 10_000)
    await dashboard.expect(dashboard.card("fix-d")).to_have_count(1)
    await dashboard.expect(dashboard.card("fix-d").locator(".card-error")).to_be_hidden()

    # Stop watching link-b: gone from the page, from the address, and after a reload.
    await dashboard.page.get_by_role("button", name="Stop watching link-b", exact=True).click()
    await dashboard.expect(dashboard.card("link-b")).to_have_count(0)
    assert "link-b" not in dashboard.page.url
    await dashboard.page.reload()
    await dashboard.page.wait_for_selector("body[data-ready=true]", state="attached")
    for task_id in ("link-a", "form-c", "fix-d"):
        await dashboard.expect(dashboard.card(task_id)).to_have_count(1)
    await dashboard.expect(dashboard.card("link-b")).to_have_count(0)
    # After the reload form-c resumes from its kept cursor: caught-up at version 1.
    await dashboard.wait_card("form-c", "d.resume === 'caught-up' && d.resumedFrom === '1'", 10_000)
    await dashboard.expect(dashboard.card("form-c").locator(".f-event")).to_contain_text("started by w-7")
    console.assert_clean()


async def test_screenshots_mid_run_on_desktop_and_phone(dashboard: Dashboard, artifacts: Path) -> None:
    await dashboard.open()
    ids = [(await dashboard.start_demo())[0] for _ in range(3)]
    # Mid-run: every demo has started and the first is well under way.
    for task_id in ids:
        await dashboard.wait_card(task_id, "Number(d.version) >= 1")
    await dashboard.wait_card(ids[0], "Number(d.progress) >= 25 && Number(d.progress) < 100")
    page = dashboard.page

    desktop = artifacts / "dashboard.png"
    await page.screenshot(path=str(desktop), full_page=True)
    await page.set_viewport_size({"width": 390, "height": 844})
    phone = artifacts / "dashboard-phone.png"
    await page.screenshot(path=str(phone), full_page=True)
    for path in (desktop, phone):
        assert path.stat().st_size > 10_000, path

    # On the phone: nothing wider than the screen, cards one per row, the bars still labelled.
    layout: dict[str, Any] = await page.evaluate(
        """() => ({
            scrollWidth: document.documentElement.scrollWidth,
            cards: [...document.querySelectorAll('article.task-card')]
                .map((c) => c.getBoundingClientRect().width),
            bars: [...document.querySelectorAll('[role=progressbar]')]
                .map((b) => b.getAttribute('aria-valuenow')),
        })"""
    )
    assert layout["scrollWidth"] <= 390, layout
    assert all(300 <= width <= 390 for width in layout["cards"]), layout
    assert len(layout["bars"]) == 3 and all(v is not None for v in layout["bars"]), layout


async def test_no_demo_button_when_the_demo_is_off(sqlite_url: str, context: Any) -> None:
    async with running_gateway(sqlite_url, demo=False) as gw:
        page = await context.new_page()
        try:
            dashboard = Dashboard(page, gw)
            await dashboard.open()
            await page.wait_for_selector("body[data-demo=off]", state="attached")
            await dashboard.expect(page.get_by_role("button", name="Start a demo task")).to_have_count(0)
            await dashboard.expect(page.get_by_role("button", name="Watch")).to_be_visible()
        finally:
            await page.close()
