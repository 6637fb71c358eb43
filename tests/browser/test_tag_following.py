"""Following a tag in headless Chromium against a real gateway: gateway-client.js's tag subscription through
dropped connections (every task's entries once each, in order, a task created while it was away included),
and the dashboard opened on a tag (cards newest first, a new task at the top, live progress, finished ones
staying, on a desktop and a phone)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gateway.client import Worker
from tests.browser.conftest import VIEWPORTS, cut_or_off_screen, screenshot
from tests.support.tagged import Handed, create_tagged, tag_token

if TYPE_CHECKING:
    from tests.browser.conftest import Clocked, Console, Dashboard

pytestmark = pytest.mark.anyio

TAG = "owner:u42"

# One client, the tag subscribed; every frame handed over is kept (with its task) for the test to check.
FOLLOW = """
async ([tag, token]) => {
  const { GatewayClient, watchBrowser } = await import("/static/gateway-client.js");
  const client = new GatewayClient(location.origin, { storage: null, backoffBaseMs: 50, backoffCapMs: 200 });
  watchBrowser(client); // offline: no attempt until the network is back
  window.client = client;
  window.handed = [];
  window.errors = [];
  client.subscribeTag(tag, token, (frame, task) => window.handed.push({ ...frame, task }), {
    onTag: (frame) => window.handed.push(frame),
    onAdded: (frame) => window.handed.push(frame),
    onError: (error) => window.errors.push(error),
  });
}
"""

# The version the page holds for a task (-1: none yet).
HOLDS = "([id, version]) => (window.client.tagCursors('owner:u42') ?? {})[id] === version"


async def holds(page: Any, task_id: str, version: int) -> None:
    await page.wait_for_function(HOLDS, arg=[task_id, version], timeout=15_000)


async def test_the_tag_subscription_resumes_after_drops_with_nothing_lost_or_repeated(
    dashboard: Dashboard, console: Console
) -> None:
    gw, page = dashboard.gw, dashboard.page
    a = await create_tagged(gw, "a", [TAG])
    b = await create_tagged(gw, "b", [TAG])
    other = await create_tagged(gw, "elsewhere", ["owner:u7"])
    token = await tag_token(gw, TAG)
    await page.goto(gw.url + "/docs")  # a page of the gateway, for the module's origin
    await page.evaluate(FOLLOW, [TAG, token])
    await holds(page, "a", 0)
    await holds(page, "b", 0)

    async with Worker(gw.url, "a", a.callback_token) as wa, Worker(gw.url, "b", b.callback_token) as wb:
        await wa.start("w1")
        await wa.progress(10, "p10")
        await holds(page, "a", 2)

        # 1. The gateway closes every socket (1012); meanwhile a moves on, b starts, d is created.
        gw.gateway.hub.shutdown(1012)
        await wa.progress(20, "p20")
        await wa.progress(30, "p30")
        await wb.start("w2")
        d = await create_tagged(gw, "d", [TAG])
        await holds(page, "a", 4)
        await holds(page, "b", 1)
        await holds(page, "d", 0)

        # 2. Offline, the socket cut, entries committed while away: back online, each resumes from its cursor.
        await page.context.set_offline(True)
        gw.gateway.hub.shutdown(1012)
        await wa.progress(40, "p40")
        await wb.progress(50, "p50")
        async with Worker(gw.url, "elsewhere", other.callback_token) as wo:
            await wo.start("w0")
        await page.context.set_offline(False)
        await holds(page, "a", 5)
        await holds(page, "b", 2)

        # 3. Live again: every task to its end, d too.
        async with Worker(gw.url, "d", d.callback_token) as wd:
            await wd.start("w3")
            await wd.succeed("s3://results/d", "sha256:d")
        await wa.succeed("s3://results/a", "sha256:a")
        await wb.fail("bad input", retryable=False)
    await holds(page, "a", 6)
    await holds(page, "b", 3)
    await holds(page, "d", 2)

    handed = Handed()
    for frame in await page.evaluate("window.handed"):
        handed.take(frame)
    assert handed.entries == {"a": [1, 2, 3, 4, 5, 6], "b": [1, 2, 3], "d": [1, 2]}, handed.entries
    assert handed.first["d"]["type"] == "snapshot" and handed.first["d"]["reason"] == "new"
    assert "elsewhere" not in handed.version
    assert len(handed.listings) >= 3 and handed.listings[0] == ["b", "a"], handed.listings
    assert handed.listings[-1] == ["d", "b", "a"]
    # The cursors map is every task at the gateway's version, finished ones included; newest first.
    assert await page.evaluate("window.client.tagCursors('owner:u42')") == {"a": 6, "b": 3, "d": 2}
    tasks = await page.evaluate("window.client.tagTasks('owner:u42')")
    assert [task["id"] for task in tasks] == ["d", "b", "a"]
    for task in tasks:
        assert task == (await gw.client.get(f"/v1/tasks/{task['id']}")).json()
    assert await page.evaluate("window.errors") == []
    console.assert_clean()


async def order(dashboard: Dashboard) -> list[str]:
    ids: list[str] = await dashboard.page.eval_on_selector_all(
        "article.task-card", "els => els.map((e) => e.dataset.taskId)"
    )
    return ids


async def test_the_dashboard_on_a_tag_shows_its_tasks_newest_first_live(
    dashboard: Dashboard, console: Console, artifacts: Path
) -> None:
    gw, page, expect = dashboard.gw, dashboard.page, dashboard.expect
    made = {task_id: await create_tagged(gw, task_id, [TAG]) for task_id in ("report-1", "report-2")}
    await create_tagged(gw, "not-mine", ["owner:u7"])
    token = await tag_token(gw, TAG)
    async with (
        Worker(gw.url, "report-1", made["report-1"].callback_token) as one,
        Worker(gw.url, "report-2", made["report-2"].callback_token) as two,
    ):
        await one.start("w1")
        await one.progress(50, "half")
        await dashboard.open(f"?tag={TAG}&token={token}")
        head = page.locator("#tag-head")
        await expect(head).to_have_attribute("data-state", "live")
        await expect(head.get_by_role("heading")).to_have_text("Tasks of owner u42")
        await dashboard.wait_card("report-1", "d.state === 'running' && d.progress === '50'", 10_000)
        await dashboard.wait_card("report-2", "d.state === 'queued'", 10_000)
        assert await order(dashboard) == ["report-2", "report-1"]  # newest first
        await expect(dashboard.card("not-mine")).to_have_count(0)
        await expect(head.locator(".tag-summary")).to_have_text("2 tasks · 1 running · 1 waiting")
        await expect(dashboard.connection).to_have_attribute("data-state", "connected")
        # Nothing to type on this page: no form, no demo; nothing to remove (the tag shows all its tasks).
        await expect(page.get_by_text("Watch a task by id")).to_be_hidden()
        await expect(page.get_by_role("button", name="Start a demo task")).to_be_hidden()
        await expect(page.get_by_role("button", name="Stop watching report-1")).to_be_hidden()

        # A task created with the tag appears at the top as it comes, and its progress shows live.
        three = await create_tagged(gw, "report-3", [TAG])
        await dashboard.wait_card("report-3", "d.state === 'queued'", 10_000)
        assert await order(dashboard) == ["report-3", "report-2", "report-1"]
        await expect(dashboard.card("report-3")).to_have_attribute("data-new", "true")
        await expect(dashboard.card("report-2")).to_have_attribute("data-new", "false")
        async with Worker(gw.url, "report-3", three.callback_token) as worker:
            await worker.start("w3")
            await worker.progress(30, "row-30")
            await dashboard.wait_card("report-3", "d.progress === '30'", 10_000)
            bar = dashboard.card("report-3").get_by_role("progressbar")
            await expect(bar).to_have_attribute("aria-valuenow", "30")

            # A finished task stays, as it ended; one that failed says so.
            await one.succeed("s3://results/1", "sha256:1")
            await two.start("w2")
            await two.fail("the input is not a CSV", retryable=False)
            await dashboard.wait_card("report-1", "d.state === 'succeeded'", 10_000)
            await dashboard.wait_card("report-2", "d.state === 'failed'", 10_000)
            await expect(dashboard.card("report-2").locator(".task-failure")).to_contain_text("not a CSV")

            # The link drops while a task is created and another moves on: back, each is where it is, the
            # new one in its place.
            gw.gateway.hub.shutdown(1012)
            await worker.progress(60, "row-60")
            await create_tagged(gw, "report-4", [TAG])
            await dashboard.wait_card("report-3", "d.progress === '60'", 10_000)
            await dashboard.wait_card("report-4", "d.state === 'queued'", 10_000)
            assert await order(dashboard) == ["report-4", "report-3", "report-2", "report-1"]
            await expect(dashboard.connection).to_have_attribute("data-state", "connected")
            desktop = artifacts / "dashboard-tag.png"
            await page.screenshot(path=str(desktop), full_page=True)

            # On a phone: one card a row, newest first, nothing wider than the screen.
            await page.set_viewport_size({"width": 390, "height": 844})
            await worker.succeed("s3://results/3", "sha256:3")
            await dashboard.wait_card("report-3", "d.state === 'succeeded'", 10_000)
    for task_id in ("report-1", "report-2", "report-3"):
        await dashboard.assert_matches_server(task_id)
    phone = artifacts / "dashboard-tag-phone.png"
    await page.screenshot(path=str(phone), full_page=True)
    for path in (desktop, phone):
        assert path.stat().st_size > 10_000, path
    layout: dict[str, Any] = await page.evaluate(
        """() => ({
            scrollWidth: document.documentElement.scrollWidth,
            cards: [...document.querySelectorAll('article.task-card')].map((c) => {
                const box = c.getBoundingClientRect();
                return { id: c.dataset.taskId, width: box.width, top: box.top };
            }),
        })"""
    )
    assert layout["scrollWidth"] <= 390, layout
    assert all(300 <= card["width"] <= 390 for card in layout["cards"]), layout
    tops = [card["top"] for card in layout["cards"]]
    assert tops == sorted(tops) and len(set(tops)) == len(tops), layout  # one a row, in order
    assert [card["id"] for card in layout["cards"]] == ["report-4", "report-3", "report-2", "report-1"]
    console.assert_clean()


async def test_the_dashboard_says_when_the_tag_token_is_refused(
    dashboard: Dashboard, console: Console
) -> None:
    gw, page, expect = dashboard.gw, dashboard.page, dashboard.expect
    await create_tagged(gw, "report-1", [TAG])
    wrong = await tag_token(gw, "owner:u7")
    await dashboard.open(f"?tag={TAG}&token={wrong}")
    head = page.locator("#tag-head")
    await expect(head).to_have_attribute("data-state", "error")
    await expect(head.get_by_role("alert")).to_have_text(
        "Can't follow these tasks: the link's access code is for other tasks (forbidden). Open the whole link"
        " you were given, or ask whoever sent you the link for a new one."
    )
    await expect(dashboard.card("report-1")).to_have_count(0)
    # Nothing on the page follows anything: the header does not say "Connected" beside the refusal.
    await expect(dashboard.connection).to_be_hidden()
    await expect(dashboard.connection).to_have_attribute("data-state", "idle")
    await screenshot(page, "tag-refused")

    await dashboard.open(f"?tag={TAG}&token=eyJhbGciOi")  # the link cut short: its access code too
    await expect(head).to_have_attribute("data-state", "error")
    await expect(head.get_by_role("alert")).to_have_text(
        "Can't follow these tasks: the link's access code has expired or is not valid (unauthorized). Ask"
        " whoever sent you the link for a new one."
    )
    await expect(dashboard.connection).to_be_hidden()
    await page.set_viewport_size({"width": 390, "height": 844})
    assert await cut_or_off_screen(page, "#tag-head, .tag-error") == []
    await screenshot(page, "tag-refused")
    console.assert_clean()


@pytest.mark.parametrize("viewport", VIEWPORTS)
async def test_a_tags_page_shows_tasks_in_progress_before_finished_ones_and_the_tag_in_words(
    clocked: Clocked, console: Console, viewport: dict[str, int]
) -> None:
    """On a desktop and on a phone: the tasks still in progress first, then the finished ones, each group
    newest first; a task that finishes moves among the finished ones; the tag reads as words."""
    dashboard = clocked.dashboard
    gw, page, expect = dashboard.gw, dashboard.page, dashboard.expect
    await page.set_viewport_size(viewport)
    made = await clocked.create_in_turn("import-1", "export-2", "report-3", "resize-4", tags=[TAG])
    start = {"type": "start", "worker": "w"}
    succeed = {"type": "succeed", "resultRef": "s3://r/2", "resultHash": "sha256:2"}
    await clocked.report(made["import-1"], start, {"type": "progress", "progress": 60, "cursor": "row-60"})
    await clocked.report(made["export-2"], start, succeed)
    await clocked.report(
        made["resize-4"], start, {"type": "fail", "error": "not an image", "retryable": False}
    )
    token = await tag_token(gw, TAG)
    await dashboard.open(f"?tag={TAG}&token={token}")
    head = page.locator("#tag-head")
    await expect(head).to_have_attribute("data-state", "live")
    await expect(head.get_by_role("heading")).to_have_text("Tasks of owner u42")
    await expect(head.get_by_role("heading")).to_have_attribute("title", f"tag {TAG}")
    for task_id in made:
        await dashboard.wait_card(task_id, "d.version !== ''", 10_000)
    # Newest first alone would be resize-4, report-3, export-2, import-1.
    assert await order(dashboard) == ["report-3", "import-1", "resize-4", "export-2"]
    await expect(dashboard.connection).to_have_attribute("data-state", "connected")
    assert await cut_or_off_screen(page, "article.task-card, article.task-card .state-badge") == []
    assert await page.evaluate("document.documentElement.scrollWidth <= innerWidth")
    await screenshot(page, "tag-page")

    # import-1 finishes: it goes after resize-4 and export-2, the newer finished ones.
    await clocked.report(
        made["import-1"], {"type": "succeed", "resultRef": "s3://r/1", "resultHash": "sha256:1"}
    )
    await dashboard.wait_card("import-1", "d.state === 'succeeded'", 10_000)
    assert await order(dashboard) == ["report-3", "resize-4", "export-2", "import-1"]
    # A task created now comes first.
    clocked.clock.advance(1_000)
    await create_tagged(gw, "upload-5", [TAG])
    await dashboard.wait_card("upload-5", "d.state === 'queued'", 10_000)
    assert await order(dashboard) == ["upload-5", "report-3", "resize-4", "export-2", "import-1"]
    console.assert_clean()
