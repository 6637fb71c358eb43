""" "All tasks" on the dashboard in headless Chromium: where the management API is open it lists every task
a page at a time ("More"), newest first, live, with each task's title, state, progress, attempts, worker,
created, duration, a batch's counts and tags; filters by state, title, tag and batch; and links each task
to its card; with an API key (which a browser does not hold) the section stays hidden."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import pytest

from tests.browser.conftest import VIEWPORTS, cut_or_off_screen, screenshot
from tests.support import Created, bearer, create_task, post_callback, running_gateway

if TYPE_CHECKING:
    from tests.browser.conftest import Clocked, Console, Dashboard
    from tests.support import Running

pytestmark = pytest.mark.anyio

PAGE_SIZE = 20  # task-list.js


async def rows(page: Any) -> list[tuple[str, str]]:
    found = await page.eval_on_selector_all(
        "#all-tasks tbody tr", "els => els.map(e => [e.dataset.taskId, e.dataset.state])"
    )
    return [(i, s) for i, s in found]


async def test_all_tasks_pages_filters_and_opens_a_task(dashboard: Dashboard, console: Console) -> None:
    gw, page, expect = dashboard.gw, dashboard.page, dashboard.expect
    ids = sorted(f"batch-{n:02d}" for n in range(PAGE_SIZE + 5))
    created = {i: await create_task(gw, i) for i in ids}
    await post_callback(gw, "batch-07", created["batch-07"].callback_token, {"type": "start", "worker": "w"})

    await dashboard.open()
    section = page.locator("#all-tasks")
    await expect(section).to_have_attribute("data-ready", "true")
    summary = section.get_by_text("All tasks", exact=True)
    await expect(summary).to_be_visible()
    await summary.click()  # collapsed until asked for
    more = section.get_by_role("button", name="More")
    await expect(section).to_have_attribute("data-count", str(PAGE_SIZE))
    await expect(more).to_be_visible()
    await more.click()
    await expect(section).to_have_attribute("data-count", str(len(ids)))
    await expect(more).to_be_hidden()
    listed = await rows(page)
    assert sorted(i for i, _ in listed) == ids and len(listed) == len(ids)  # every task once
    assert dict(listed)["batch-07"] == "running"

    await section.get_by_label("Show").select_option("running")
    await expect(section).to_have_attribute("data-count", "1")
    assert await rows(page) == [("batch-07", "running")]
    await section.get_by_label("Show").select_option("failed")
    await expect(section).to_have_attribute("data-count", "0")
    await expect(section.get_by_text("No task matches these filters.")).to_be_visible()

    await section.get_by_label("Show").select_option("")
    await expect(section).to_have_attribute("data-count", str(PAGE_SIZE))
    await section.get_by_role("link", name="batch-10").click()
    await expect(dashboard.card("batch-10")).to_have_attribute("data-state", "queued")
    console.assert_clean()


@pytest.mark.parametrize("viewport", VIEWPORTS)
async def test_all_tasks_are_newest_first_each_state_whole_and_every_column_on_screen(
    clocked: Clocked, console: Console, viewport: dict[str, int]
) -> None:
    """On a desktop and on a phone: the newest task first (not the ids' order), each state's word whole
    (none cut to "Succeed" or "Cancelle"), and the progress, attempts and worker of every task on the
    screen, with nothing to scroll sideways."""
    dashboard = clocked.dashboard
    gw, page, expect = dashboard.gw, dashboard.page, dashboard.expect
    await page.set_viewport_size(viewport)
    uuid = "3f2a8c1e-9d4b-4c6a-8e1f-2b7d9a0c5e31"  # an id the gateway gives, when it names the task
    made = await clocked.create_in_turn("report-b", "report-a", uuid, "report-z", "report-c", "report-e")
    start = {"type": "start", "worker": "w"}
    succeed = {"type": "succeed", "resultRef": "s3://r/b", "resultHash": "sha256:b"}
    await clocked.report(made["report-b"], start, succeed)
    await clocked.report(made[uuid], start, {"type": "progress", "progress": 40, "cursor": "row-40"})
    await clocked.report(made["report-c"], start, {"type": "fail", "error": "timeout", "retryable": True})
    await clocked.report(made["report-e"], start, {"type": "fail", "error": "bad input", "retryable": False})
    assert (await gw.client.post("/v1/tasks/report-a/cancel", json={})).status_code == 200

    await dashboard.open()
    section = page.locator("#all-tasks")
    await expect(section).to_have_attribute("data-ready", "true")
    await section.get_by_text("All tasks", exact=True).click()
    await expect(section).to_have_attribute("data-count", "6")
    words = await page.eval_on_selector_all(
        "#all-tasks tbody tr",
        "els => els.map(e => [e.dataset.taskId, e.querySelector('.state-badge').innerText])",
    )
    assert words == [
        ["report-e", "Failed"],
        ["report-c", "Retrying"],
        ["report-z", "Queued"],
        [uuid, "Running"],
        ["report-a", "Cancelled"],
        ["report-b", "Succeeded"],
    ]  # newest first
    running = section.locator(f'tr[data-task-id="{uuid}"]')
    await running.scroll_into_view_if_needed()  # below the filters on a phone: a scroll down, never sideways
    for text in (uuid, "40%", "1 of 3", "w"):
        await expect(running.get_by_text(text, exact=True)).to_be_in_viewport()
    assert await cut_or_off_screen(page, "#all-tasks .state-badge") == []
    assert await cut_or_off_screen(page, "#all-tasks td") == []
    assert (
        await cut_or_off_screen(page, "#all-tasks .all-tasks-scroll") == []
    )  # nothing scrolled out of sight
    assert await page.evaluate("document.documentElement.scrollWidth <= innerWidth")
    if viewport["width"] < 500:
        # No column heads on a phone: each number says what it is.
        named = await running.evaluate(
            "tr => [...tr.querySelectorAll('td[data-label]')].filter(td => td.getClientRects().length)"
            ".map(td => getComputedStyle(td, '::before').content)"
        )
        assert named == ['"Progress"', '"Attempts"', '"Worker"', '"Created"', '"Duration"'], named
    await page.evaluate("scrollTo(0, 0)")  # the sticky header at the top of the whole page's picture
    await screenshot(page, "task-list")
    console.assert_clean()


async def test_all_tasks_says_retrying_as_the_card_does(dashboard: Dashboard, console: Console) -> None:
    """A task back in queued after a failed attempt with attempts left reads "Retrying" in the table, as on
    its card; a task not yet attempted reads "Queued" in both."""
    gw, page, expect = dashboard.gw, dashboard.page, dashboard.expect
    again = await create_task(gw, "again-1", max_attempts=2)
    await create_task(gw, "fresh-1", max_attempts=2)
    await post_callback(gw, "again-1", again.callback_token, {"type": "start", "worker": "w"})
    await post_callback(
        gw, "again-1", again.callback_token, {"type": "fail", "error": "lost", "retryable": True}
    )
    task = (await gw.client.get("/v1/tasks/again-1")).json()
    assert (task["state"], task["attempts"]) == ("queued", 1)

    await dashboard.open(f"?task=again-1&token={again.subscribe_token}")
    section = page.locator("#all-tasks")
    await expect(section).to_have_attribute("data-count", "2")
    await section.get_by_text("All tasks", exact=True).click()
    card_word = dashboard.card("again-1").locator(".state-badge")
    await expect(card_word).to_have_text("Retrying")
    await expect(section.locator('tr[data-task-id="again-1"] .state-badge')).to_have_text("Retrying")
    await expect(section.locator('tr[data-task-id="again-1"]')).to_have_attribute("data-retrying", "true")
    await expect(section.locator('tr[data-task-id="fresh-1"] .state-badge')).to_have_text("Queued")
    # The filter's "queued" holds both, and says so.
    await expect(section.get_by_label("Show").locator('option[value="queued"]')).to_have_text(
        "Queued or retrying"
    )
    console.assert_clean()


async def test_all_tasks_stays_hidden_without_the_management_api(
    context: Any, sqlite_url: str, console: Console
) -> None:
    async with running_gateway(sqlite_url, api_key="k3y") as gw:
        page = await context.new_page()
        page.on("console", lambda m: console.errors.append(m.text) if m.type == "error" else None)
        async with page.expect_response("**/v1/tasks?*") as info:
            await page.goto(gw.url + "/")
        assert (await info.value).status == 401
        await page.wait_for_selector("body[data-ready=true]", state="attached")
        from playwright.async_api import expect

        await expect(page.locator("#all-tasks")).to_be_hidden()
        await expect(page.get_by_role("link", name="/healthz")).to_have_count(0)  # operators' links too
        await page.close()
    # The refused probe is the only console error (the browser reports every 401 it loads).
    assert all("401" in e for e in console.errors), console.errors


async def make(gw: Running, task_id: str, **fields: Any) -> Created:
    """``POST /v1/tasks`` with the fields given (``title``, ``parent``, ``tags``, ``metadata``)."""
    answer = await gw.client.post(
        "/v1/tasks", json={"id": task_id, "ttlMs": 600_000, "maxAttempts": 2, **fields}
    )
    assert answer.status_code == 201, answer.text
    return Created(answer.json())


@pytest.mark.parametrize("viewport", VIEWPORTS)
async def test_all_tasks_reads_titles_and_batches_live_and_filters_by_state_tag_batch_and_title(
    dashboard: Dashboard, console: Console, viewport: dict[str, int]
) -> None:
    """The operators' list of issue 34: each task's title (its status line under it), state, progress,
    attempts, worker, created, duration, a batch's counts and its tags; live (a row changes as its task does,
    a task created while the list is open comes in at the top); filters by state, title text, tag and batch
    (a batch's counts list its children; its title opens it as its parent with its children); on a phone,
    nothing cut or off screen."""
    gw, page, expect = dashboard.gw, dashboard.page, dashboard.expect
    await page.set_viewport_size(viewport)
    await make(gw, "job-1", title="Monthly sales export for the northern region", tags=["team:sales"])
    batch = await make(gw, "job-2", title="Import of 3 files", tags=["team:data", "owner:u42"])
    await post_callback(gw, "job-2", batch.callback_token, {"type": "start", "worker": "celery@worker-7"})
    files = [await make(gw, f"job-2-{n}", title=f"file-{n}.csv", parent="job-2") for n in (1, 2, 3)]
    await post_callback(
        gw, "job-2-1", files[0].callback_token, {"type": "start", "worker": "celery@worker-7"}
    )
    await post_callback(
        gw, "job-2-1", files[0].callback_token, {"type": "succeed", "resultRef": "s3://1", "resultHash": "h"}
    )

    await dashboard.open()
    section = page.locator("#all-tasks")
    await expect(section).to_have_attribute("data-ready", "true")
    await section.get_by_text("All tasks", exact=True).click()
    await expect(section).to_have_attribute("data-count", "5")
    order = await page.eval_on_selector_all("#all-tasks tbody tr", "els => els.map(e => e.dataset.taskId)")
    assert order == ["job-2-3", "job-2-2", "job-2-1", "job-2", "job-1"], order  # newest first
    row = section.locator('tr[data-task-id="job-2"]')
    await expect(row.locator(".all-task-title a")).to_have_text("Import of 3 files")
    await expect(row.locator(".all-task-title a")).to_have_attribute("href", "/?task=job-2")
    await expect(row.locator(".state-badge")).to_have_text("Running")
    await expect(row.locator(".all-task-worker")).to_have_text("celery@worker-7")
    await expect(row.locator(".all-task-batch")).to_have_text("1/3\u00a0done")
    await expect(row.locator(".all-task-tags .tag")).to_have_text(["owner:u42", "team:data"])
    await expect(row.locator(".all-task-duration")).to_have_text(re.compile(r"^\d+\u00a0s$"))
    done = section.locator('tr[data-task-id="job-2-1"]')
    await expect(done.locator(".all-task-duration")).to_have_text(re.compile(r"^\d+\u00a0s$"))
    await expect(section.locator('tr[data-task-id="job-1"] .all-task-worker')).to_have_text("—")

    # Live: a child starts and says where it is; its parent's counts move; a new task comes in at the top.
    await post_callback(
        gw, "job-2-2", files[1].callback_token, {"type": "start", "worker": "celery@worker-9"}
    )
    answer = await gw.client.post(
        "/v1/tasks/job-2-2/metadata",
        json={"attempt": 1, "patch": {"message": "Reading row 40 of 90"}},
        headers=bearer(files[1].callback_token),
    )
    assert answer.status_code == 200, answer.text
    child = section.locator('tr[data-task-id="job-2-2"]')
    await expect(child.locator(".state-badge")).to_have_text("Running")
    await expect(child.locator(".all-task-worker")).to_have_text("celery@worker-9")
    await expect(child.locator(".all-task-line")).to_have_text("Reading row 40 of 90")
    await expect(row.locator(".all-task-batch")).to_have_text("1/3\u00a0done · 1\u00a0running")
    await make(gw, "job-3", title="Nightly backup")
    await expect(section.locator("tbody tr").first).to_have_attribute("data-task-id", "job-3")
    await expect(section).to_have_attribute("data-count", "6")
    assert (
        await cut_or_off_screen(page, "#all-tasks td, #all-tasks .state-badge, #all-tasks .all-tasks-scroll")
        == []
    )
    assert await page.evaluate("document.documentElement.scrollWidth <= innerWidth")
    await screenshot(page, "task-list-batches")

    async def listed() -> list[str]:
        ids: list[str] = await page.eval_on_selector_all(
            "#all-tasks tbody tr", "els => els.map(e => e.dataset.taskId)"
        )
        return ids

    # Filters: title text (any case), tag (a row's tag sets it), batch (a row's counts set it), state.
    await section.get_by_label("Title").fill("EXPORT")
    await expect(section).to_have_attribute("data-query", "title=EXPORT")
    assert await listed() == ["job-1"]
    await section.get_by_role("button", name="Clear filters").click()
    await expect(section).to_have_attribute("data-query", "")
    await row.locator(".all-task-tags .tag", has_text="team:data").click()
    await expect(section).to_have_attribute("data-query", "tag=team%3Adata")
    assert await listed() == ["job-2"]
    await expect(section.get_by_label("Tag")).to_have_value("team:data")
    await section.get_by_role("button", name="Clear filters").click()
    await expect(section).to_have_attribute("data-query", "")
    await section.locator('tr[data-task-id="job-2"] .all-task-batch button').click()
    await expect(section).to_have_attribute("data-query", "parent=job-2")
    assert await listed() == ["job-2-3", "job-2-2", "job-2-1"]
    await section.get_by_label("Show").select_option("running")
    await expect(section).to_have_attribute("data-query", "state=running&parent=job-2")
    assert await listed() == ["job-2-2"]
    await section.get_by_role("button", name="Clear filters").click()
    await expect(section).to_have_attribute("data-count", "6")

    # A batch's title opens it as its parent, with its children.
    await section.locator('tr[data-task-id="job-2"] .all-task-title a').click()
    card = dashboard.card("job-2")
    await expect(card.locator(".task-id")).to_have_text("Import of 3 files")
    await expect(card.locator("li.child")).to_have_count(3)
    await expect(card.locator('li.child[data-task-id="job-2-2"] .child-line')).to_have_text(
        "Reading row 40 of 90"
    )
    await expect(card.locator(".batch-counts")).to_have_text("1 of 3 done\u00a0· 1 running")
    assert await cut_or_off_screen(page, "article.task-card, .child-title, .batch-counts") == []
    await screenshot(page, "batch-opened")
    console.assert_clean()
