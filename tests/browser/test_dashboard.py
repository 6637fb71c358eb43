"""The dashboard at ``/`` in headless Chromium: demo tasks to the end, a reload that resumes from the kept
cursor, tasks from a link, and screenshots on a desktop and a phone-sized screen."""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.browser.conftest import Dashboard
from tests.support import TcpProxy, create_task, post_callback, running_gateway

if TYPE_CHECKING:
    from tests.browser.conftest import Console

pytestmark = pytest.mark.anyio


async def test_page_loads_clean_and_demo_tasks_run_to_success(dashboard: Dashboard, console: Console) -> None:
    await dashboard.open()
    page = dashboard.page
    await dashboard.expect(page.get_by_role("button", name="Start a demo task")).to_be_visible()
    # Plain words for a person without their link; the developers' form folded away.
    await dashboard.expect(page.locator("#empty")).to_have_text(
        re.compile(r"^Open the link you were given to follow a task\.")
    )
    await dashboard.expect(page.get_by_label("Task id")).to_be_hidden()
    await dashboard.expect(page.get_by_text("Watch a task by id")).to_be_visible()

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
        await dashboard.expect(card.locator(".state-badge")).to_have_text("Succeeded")
        # A demo result is no web address: a reference to copy, never "succeeded: demo://..." text.
        await dashboard.expect(card.locator(".result-ref")).to_contain_text("demo://results/")
        copy = card.get_by_role("button", name=f"Copy the result of {task_id}")
        await dashboard.expect(copy).to_be_visible()
        await dashboard.expect(card).not_to_contain_text("succeeded:")
        # Finished: its attempts and how long it took; no time it gives up at, no "finished" repeating the
        # badge.
        await dashboard.expect(card.locator(".f-attempts")).to_be_visible()
        await dashboard.expect(card.locator(".f-took")).to_have_text(re.compile(r"^\d+\u00a0s$"))
        await dashboard.expect(card.locator(".f-deadline")).to_be_hidden()
        await dashboard.expect(card.locator(".f-event")).to_be_hidden()
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
    kept = await dashboard.page.evaluate(f"sessionStorage.getItem('task-gateway:cursor:{task_id}')")
    version, _, epoch = kept.partition(":")  # the cursor, with the epoch of its task
    kept_before = int(version)
    assert kept_before >= 3 and len(epoch) == 12

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
    # When it gives up (expires) as a time of day (hours and minutes, no leading zero), not a countdown.
    deadline = await dashboard.page.evaluate(
        "ms => new Date(ms).toLocaleTimeString([], {hour: 'numeric', minute: '2-digit'})"
        " .replace(/\\s/g, '\u00a0')",
        a["task"]["expiresAtMs"],
    )
    await dashboard.expect(card.locator(".f-deadline")).to_have_text(deadline)
    await dashboard.expect(card.locator(".facts")).to_contain_text("Gives up at")

    # Opened from a link, the controls are folded below the tasks: unfold them to add one.
    await dashboard.page.get_by_text("Watch another task").click()
    form = dashboard.page.locator("#add-task")
    await form.get_by_label("Task id").fill("form-c")
    await form.get_by_label("Access code (subscribe token)").fill(c["subscribeToken"])
    await form.get_by_role("button", name="Watch").click()
    await dashboard.wait_card("form-c", "d.state === 'queued'", 10_000)

    # A worker starts it: the card follows, with the latest event.
    await post_callback(gw, "form-c", c["callbackToken"], {"type": "start", "worker": "w-7"})
    await dashboard.wait_card("form-c", "d.state === 'running' && d.version === '1'", 10_000)
    await dashboard.expect(dashboard.card("form-c").locator(".f-event")).to_contain_text("started by w-7")
    await dashboard.expect(dashboard.card("form-c").locator(".f-attempts")).to_have_text("1 of 3")

    # A wrong token (another task's): the card says so instead of waiting forever; the right one fixes it.
    await form.get_by_label("Task id").fill("fix-d")
    await form.get_by_label("Access code (subscribe token)").fill(a["subscribeToken"])
    await form.get_by_role("button", name="Watch").click()
    await dashboard.wait_card("fix-d", "d.state === 'error'", 10_000)
    await dashboard.expect(dashboard.card("fix-d").locator(".card-error")).to_contain_text("forbidden")
    await form.get_by_label("Task id").fill("fix-d")
    await form.get_by_label("Access code (subscribe token)").fill(d["subscribeToken"])
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
            # No demo to offer: the plain words alone, the developers' form one click away.
            await dashboard.expect(page.locator("#empty")).to_have_text(
                "Open the link you were given to follow a task.", use_inner_text=True
            )
            await page.get_by_text("Watch a task by id").click()
            await dashboard.expect(page.get_by_role("button", name="Watch")).to_be_visible()
        finally:
            await page.close()


async def test_a_card_that_cannot_follow_says_what_to_do_and_no_connection_is_claimed(
    dashboard: Dashboard, console: Console
) -> None:
    """A link whose access code is another task's: the card says why and what to do, and the header says
    nothing of a connection (no "Connected" beside a card that follows nothing)."""
    gw, page, expect = dashboard.gw, dashboard.page, dashboard.expect
    await create_task(gw, "mine-1")
    other = await create_task(gw, "other-2")
    await dashboard.open(f"?task=mine-1&token={other.subscribe_token}")
    await dashboard.wait_card("mine-1", "d.state === 'error'", 10_000)
    await expect(dashboard.card("mine-1").locator(".card-error")).to_have_text(
        "Can't follow this task: the link's access code is for other tasks (forbidden). Open the whole link"
        " you were given, or ask whoever sent you the link for a new one."
    )
    await expect(dashboard.connection).to_be_hidden()
    await expect(dashboard.connection).to_have_attribute("data-state", "idle")
    assert "Connected" not in await page.locator("body").inner_text()
    console.assert_clean()


async def test_on_a_phone_the_indicator_stays_put_and_linked_tasks_come_first(
    dashboard: Dashboard, console: Console
) -> None:
    """390x844, opened from a `?task=` link: the watched tasks come before the (folded) controls; the
    connection indicator keeps one place and one size whatever the link does and however far the page is
    scrolled; a lost connection (amber banner, words, an icon) looks nothing like a failed task (a red card
    that says "Failed" and why); no jargon ("Version", "delta from v0") outside the folded details."""
    gw = dashboard.gw
    page = dashboard.page
    expect = dashboard.expect
    await page.set_viewport_size({"width": 390, "height": 844})
    names = ("report-a", "report-b", "report-c")
    made = {name: await create_task(gw, name, ttl_ms=600_000, max_attempts=2) for name in names}
    await post_callback(gw, "report-a", made["report-a"]["callbackToken"], {"type": "start", "worker": "w"})
    await post_callback(gw, "report-b", made["report-b"]["callbackToken"], {"type": "start", "worker": "w"})
    failure = {"type": "fail", "error": "the input file is not a CSV", "retryable": False}
    await post_callback(gw, "report-b", made["report-b"]["callbackToken"], failure)
    query = "&".join(f"task={n}&token={m['subscribeToken']}" for n, m in made.items())
    connection = dashboard.connection
    banner = page.locator("#link-banner")
    async with TcpProxy(int(gw.url.rsplit(":", 1)[1])) as relay:
        await page.goto(f"{relay.url}/?{query}")
        await page.wait_for_selector("body[data-ready=true]", state="attached")
        for name in names:
            await dashboard.wait_card(name, "d.resume !== ''", 10_000)
        await expect(connection).to_have_attribute("data-state", "connected")

        # The tasks first; the controls below them, folded.
        boxes = await page.evaluate(
            """() => ({
                firstCard: document.querySelector('article.task-card').getBoundingClientRect().top,
                controls: document.querySelector('.controls').getBoundingClientRect().top,
            })"""
        )
        assert boxes["firstCard"] < boxes["controls"] < 10_000, boxes
        await expect(page.get_by_role("button", name="Start a demo task")).to_be_hidden()
        await expect(page.get_by_role("button", name="Watch", exact=True)).to_be_hidden()

        # One place and one size for the indicator: connected, scrolled to the end, link lost, offline.
        async def indicator_box() -> dict[str, float]:
            box: dict[str, float] = await connection.evaluate(
                "el => { const r = el.getBoundingClientRect();"
                " return {x: r.x, y: r.y, w: r.width, h: r.height}; }"
            )
            return box

        connected = await indicator_box()
        assert connected["y"] >= 0 and connected["y"] + connected["h"] <= 120, connected
        await page.evaluate("window.scrollTo(0, document.documentElement.scrollHeight)")
        await page.wait_for_function("window.scrollY > 0")
        assert await indicator_box() == connected
        relay.refuse = True
        relay.stall()
        await expect(connection).to_have_attribute("data-state", "reconnecting", timeout=10_000)
        await expect(banner).to_be_visible()
        assert await indicator_box() == connected
        await page.context.set_offline(True)
        await expect(connection).to_have_attribute("data-state", "offline")
        assert await indicator_box() == connected
        await expect(banner).to_contain_text("offline")
        await page.context.set_offline(False)
        await expect(connection).to_have_attribute("data-state", "reconnecting", timeout=10_000)

        # A lost connection and a failed task look different, and say what they are.
        failed = dashboard.card("report-b")
        await expect(failed.locator(".state-badge")).to_have_text("Failed")
        await expect(failed.locator(".task-failure")).to_be_visible()
        await expect(failed.locator(".task-failure")).to_contain_text("The input file is not a CSV")
        await expect(failed).to_have_attribute("data-stale", "false")  # a finished task is not stale
        await expect(banner).to_contain_text("Connection lost")
        await expect(banner.locator("svg.icon")).to_be_visible()
        await expect(dashboard.card("report-a")).to_have_attribute("data-stale", "true")
        colours = await page.evaluate(
            """() => {
                const style = (selector) => getComputedStyle(document.querySelector(selector));
                const failed = 'article.task-card[data-task-id="report-b"]';
                return {
                    banner: style('#link-banner').backgroundColor,
                    failure: style(failed + ' .task-failure').backgroundColor,
                    failedBorder: style(failed).borderLeftColor,
                    staleBorder: style('article.task-card[data-task-id="report-a"]').borderLeftColor,
                    failedBadge: style(failed + ' .state-badge').backgroundColor,
                    indicatorDot: style('#connection .dot').backgroundColor,
                };
            }"""
        )
        assert colours["banner"] != colours["failure"], colours
        assert colours["failedBorder"] != colours["staleBorder"], colours
        assert colours["failedBadge"] != colours["indicatorDot"], colours

        # The stale card is not faded as a whole: its note is readable (WCAG AA), in light and dark.
        note = dashboard.card("report-a").locator(".stale-note")
        for scheme in ("light", "dark"):
            await page.emulate_media(color_scheme=scheme)
            seen = await note.evaluate(CONTRAST)
            assert seen["opacity"] == 1 and seen["ratio"] >= 4.5, (scheme, seen)
        await page.emulate_media(color_scheme="light")

        # Plain words on the card; the developer's words only inside the folded details.
        visible_text = await page.evaluate("document.body.innerText")
        for jargon in ("Version", "delta from", "caught-up", "Last resume"):
            assert jargon not in visible_text, jargon
        running = dashboard.card("report-a")
        # Only the note says how old the news is: no "Updated … ago" frozen above it.
        await expect(running.locator(".stale-note")).to_contain_text("no news since")
        await expect(running.locator(".f-updated")).to_have_text("")
        await expect(running.locator(".f-progress")).to_have_text("0%")
        await running.locator("details.tech summary").click()
        await expect(running.locator(".f-version")).to_be_visible()
        await expect(running.locator(".f-version")).to_have_text("1")
        await expect(running.locator(".f-transport")).to_have_text("reconnecting")

        relay.refuse = False
        await expect(connection).to_have_attribute("data-state", "connected", timeout=15_000)
        await expect(banner).to_be_hidden()
        await expect(running.locator(".f-updated")).to_contain_text("Updated")
        assert await indicator_box() == connected
    console.errors[:] = [e for e in console.errors if not e.startswith("WebSocket connection to")]
    console.assert_clean()


# The contrast ratio (WCAG 2) of an element's text on its own background, both opaque colours as computed.
CONTRAST = """(el) => {
    const rgb = (css) => {
        const n = css.match(/[\\d.]+/g).map(Number);
        return css.startsWith("color(") ? n.slice(0, 3).map((v) => v * 255) : n.slice(0, 3);
    };
    const lum = (c) => {
        const linear = (v) => (v <= 0.04045 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4);
        const [r, g, b] = c.map((v) => linear(v / 255));
        return 0.2126 * r + 0.7152 * g + 0.0722 * b;
    };
    const style = getComputedStyle(el);
    const [a, b] = [lum(rgb(style.color)), lum(rgb(style.backgroundColor))];
    let opacity = 1;
    for (let node = el; node; node = node.parentElement) opacity *= Number(getComputedStyle(node).opacity);
    return { ratio: (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05), opacity };
}"""


async def test_cards_say_what_came_of_each_task_on_a_phone(dashboard: Dashboard, console: Console) -> None:
    """Opened from a link on a phone: the cards in the link's order; a result to open (a web address) or to
    copy (anything else); a failed task says why once, that it will not be retried and what to do now; a
    requeued one which attempt failed and which comes next; when a task gives up as a time of day, gone once
    it is done; a long id on two lines at most; touch targets of 44 px."""
    gw, page, expect = dashboard.gw, dashboard.page, dashboard.expect
    await page.set_viewport_size({"width": 390, "height": 844})
    await page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=gw.url)
    long_id = "nightly-ledger-export-customer-48213-eu-west-1-2026-11-30T02-00-00Z-full-with-attachments"
    names = ("web-result", "s3-result", "broken", "again", long_id)
    made = {name: await create_task(gw, name, ttl_ms=600_000, max_attempts=3) for name in names}

    async def send(name: str, *events: dict[str, Any]) -> None:
        for event in events:
            await post_callback(gw, name, made[name].callback_token, event)

    start = {"type": "start", "worker": "w"}
    url = "https://files.example.com/exports/report.csv"
    await send("web-result", start, {"type": "succeed", "resultRef": url, "resultHash": "sha256:01"})
    s3_ref = "s3://exports/r.csv"
    await send("s3-result", start, {"type": "succeed", "resultRef": s3_ref, "resultHash": "sha256:02"})
    await send("broken", start, {"type": "fail", "error": "the input is not a CSV", "retryable": False})
    await send("again", start, {"type": "fail", "error": "worker lost its lease", "retryable": True})

    await dashboard.open()
    await expect(dashboard.connection).to_be_hidden()  # nothing watched: no connection state to show
    await expect(page.get_by_role("link", name="/healthz")).to_be_visible()  # open mode: operators' links
    await dashboard.open("?" + "&".join(f"task={n}&token={made[n].subscribe_token}" for n in names))
    for name in names:
        await dashboard.wait_card(name, "d.resume !== ''", 10_000)
    await expect(dashboard.connection).to_be_visible()
    order = await page.eval_on_selector_all("article.task-card", "els => els.map((e) => e.dataset.taskId)")
    assert order == list(names), order

    web = dashboard.card("web-result")
    link = web.get_by_role("link", name="Open result")
    await expect(link).to_have_attribute("href", url)
    await expect(link).to_have_attribute("rel", "noopener")
    await expect(link).to_have_attribute("target", "_blank")
    s3 = dashboard.card("s3-result")
    await expect(s3.get_by_role("link")).to_have_count(0)
    await expect(s3.locator(".result-ref")).to_have_text("s3://exports/r.csv")
    await s3.get_by_role("button", name="Copy the result of s3-result").click()
    await expect(s3.get_by_role("button", name="Copy the result of s3-result")).to_have_text("Copied")
    assert await page.evaluate("navigator.clipboard.readText()") == "s3://exports/r.csv"
    # The whole green box is the link, a 44 px target.
    link_box, result_box = await link.bounding_box(), await web.locator(".task-result").bounding_box()
    assert link_box is not None and result_box is not None, (link_box, result_box)
    assert link_box["height"] >= 44 and link_box["width"] == result_box["width"], (link_box, result_box)
    for card in (web, s3):
        await expect(card).not_to_contain_text("succeeded:")
        await expect(card.locator(".f-attempts")).to_have_text("1 of 3")  # done: its attempts stay,
        await expect(card.locator(".f-deadline")).to_be_hidden()  # no "gives up at"
        # When it finished, as a time of day: nothing an outage could leave saying "just now".
        await expect(card.locator(".f-updated")).to_have_text(re.compile(r"^Finished \d{1,2}:\d{2}"))

    broken = dashboard.card("broken")
    await expect(broken.locator(".state-badge")).to_have_text("Failed")
    failure = re.compile(
        r"^\s*The input is not a CSV\s*Will not be retried\.\s*"
        r"Start it again from where you created it, or contact support\.\s*$"
    )
    await expect(broken.locator(".task-failure")).to_have_text(failure)
    await expect(broken.locator(".facts")).to_be_hidden()
    assert (await broken.inner_text()).count("Failed") == 1  # the badge only
    # Requeued after its first attempt failed: one story in the badge, the line and the attempts.
    again = dashboard.card("again")
    await expect(again.locator(".state-badge")).to_have_text("Retrying")
    retry_line = "Attempt 1 of 3 failed: Worker lost its lease. Waiting for attempt 2."
    await expect(again.locator(".headline")).to_have_text(retry_line)
    await expect(again.locator(".f-attempts")).to_have_text("1 of 3")
    colours = await again.evaluate(
        "el => [getComputedStyle(el.querySelector('.headline')).color, getComputedStyle(el).color]"
    )
    assert colours[0] == colours[1], colours  # the card's text colour, not muted
    assert (await again.inner_text()).count("lost its lease") == 1
    await expect(again.locator(".f-deadline")).to_have_text(re.compile(r"^[1-9]\d?:\d\d"))
    for time in await page.locator(".f-event").all_inner_texts():
        assert not re.search(r"\d:\d\d:\d\d", time), time  # hours and minutes, no seconds

    # A long id wraps onto two lines at most; the whole id is in its title.
    title = dashboard.card(long_id).locator(".task-id")
    await expect(title).to_have_attribute("title", long_id)
    lines = await title.evaluate(
        "el => { const s = getComputedStyle(el); return [el.clientHeight / parseFloat(s.lineHeight),"
        " el.scrollHeight > el.clientHeight]; }"
    )
    assert 1.5 < lines[0] <= 2.05 and lines[1], lines

    for name in names:
        box = await page.get_by_role("button", name=f"Stop watching {name}", exact=True).bounding_box()
        assert box is not None and box["width"] >= 44 and box["height"] >= 44, box
    box = await again.locator("details.tech summary").bounding_box()
    assert box is not None and box["height"] >= 44, box

    # A task added here comes after the ones the link named, which stay at the top.
    extra = await create_task(gw, "extra", ttl_ms=600_000)
    await page.get_by_text("Watch another task").click()
    targets = [
        page.get_by_text("Watch another task"),
        page.get_by_label("Task id"),
        page.get_by_label("Access code (subscribe token)"),
        page.get_by_role("button", name="Watch", exact=True),
    ]
    for target in targets:
        box = await target.bounding_box()
        assert box is not None and box["height"] >= 44, box
    await page.get_by_label("Task id").fill("extra")
    await page.get_by_label("Access code (subscribe token)").fill(extra.subscribe_token)
    await page.get_by_role("button", name="Watch", exact=True).click()
    await dashboard.wait_card("extra", "d.state === 'queued'", 10_000)
    order = await page.eval_on_selector_all("article.task-card", "els => els.map((e) => e.dataset.taskId)")
    assert order == [*names, "extra"], order
    console.assert_clean()
