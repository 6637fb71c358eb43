"""Tasks people can read, in headless Chromium against a real gateway (issue 34): a card names its task by its
title (the id in the technical details, the page's title too), shows its status line (`metadata.message`)
under the bar, live; a batch is one card counting its children live, in words and as a bar, and lists each
child's title, state and status line, live, through a link that goes silent and comes back; on a tag's page,
a batch whose children carry the tag is one card too."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests.browser.conftest import VIEWPORTS, cut_or_off_screen, screenshot
from tests.support import STEP_S, Created, TcpProxy, bearer, create_task, eventually, post_callback

if TYPE_CHECKING:
    from tests.browser.conftest import Console, Dashboard
    from tests.support import Running

pytestmark = pytest.mark.anyio

# A queue's job id: what every card showed before titles.
JOB_ID = "aa15b384-2c3e-4fe0-9ba2-5960af9b99c2"
START = {"type": "start", "worker": "w1"}

# Every value a batch's count of ended children and each child's status line took, from the first script on.
RECORDER = """
(() => {
  const seen = (window.__batch = { ended: [], lines: {} });
  new MutationObserver((records) => {
    for (const r of records) {
      const el = r.target.nodeType === 1 ? r.target : r.target.parentElement;
      if (!el) continue;
      if (el.matches(".batch") && r.attributeName === "data-ended") seen.ended.push(Number(el.dataset.ended));
      const line = el.closest(".child-line");
      if (line) (seen.lines[line.closest(".child").dataset.taskId] ??= []).push(line.textContent);
    }
  }).observe(document, { subtree: true, attributes: true, attributeFilter: ["data-ended"], childList: true,
    characterData: true });
})();
"""


async def make(
    gw: Running,
    task_id: str,
    *,
    title: str | None = None,
    parent: str | None = None,
    tags: list[str] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Created:
    """``POST /v1/tasks`` with a title, a parent, tags and metadata where given (one attempt, 10 minutes)."""
    body: dict[str, Any] = {"id": task_id, "ttlMs": 600_000, "maxAttempts": 1}
    for name, value in (("title", title), ("parent", parent), ("tags", tags), ("metadata", metadata)):
        if value is not None:
            body[name] = value
    answer = await gw.client.post("/v1/tasks", json=body)
    assert answer.status_code == 201, answer.text
    return Created(answer.json())


async def say(gw: Running, made: Created, message: str | None, **more: Any) -> None:
    """The worker's status line (and more metadata), as a merge patch with its callback token."""
    body = {"attempt": 1, "patch": {"message": message, **more}}
    answer = await gw.client.post(
        f"/v1/tasks/{made.task['id']}/metadata", json=body, headers=bearer(made.callback_token)
    )
    assert answer.status_code == 200, answer.text


async def server_task(gw: Running, task_id: str) -> dict[str, Any]:
    answer = await gw.client.get(f"/v1/tasks/{task_id}")
    assert answer.status_code == 200, answer.text
    task: dict[str, Any] = answer.json()
    return task


async def test_a_card_reads_the_title_and_the_status_line_live(
    dashboard: Dashboard, console: Console
) -> None:
    gw, page, expect = dashboard.gw, dashboard.page, dashboard.expect
    made = await make(gw, JOB_ID, title="Monthly sales export")
    untitled = await create_task(gw, "report-42")
    await dashboard.open(f"?task={JOB_ID}&token={made.subscribe_token}")
    card = dashboard.card(JOB_ID)
    heading = card.locator(".task-id")
    await expect(heading).to_have_text("Monthly sales export")
    await expect(page).to_have_title("Monthly sales export · task-gateway")
    await expect(card.get_by_role("progressbar", name="Progress of Monthly sales export")).to_be_attached()
    # The id is for the technical details (and the heading's tooltip), not what a person reads.
    assert JOB_ID not in await card.locator(".card-head").inner_text()
    await expect(card.locator(".f-id")).to_have_text(JOB_ID)
    await expect(heading).to_have_attribute("title", f"Monthly sales export ({JOB_ID})")
    status = card.locator(".status-line")
    await expect(status).to_be_hidden()  # nothing said yet: no empty line

    await post_callback(gw, JOB_ID, made.callback_token, START)
    await say(gw, made, "Rendering page 3 of 12", page=3)
    await expect(status).to_have_text("Rendering page 3 of 12")
    # New words with the same percentage: the line moves, the bar does not (no history entry).
    await post_callback(gw, JOB_ID, made.callback_token, {"type": "progress", "progress": 25})
    await dashboard.wait_card(JOB_ID, "d.progress === '25'", 10_000)
    await say(gw, made, "Rendering page 4 of 12", page=4)
    await expect(status).to_have_text("Rendering page 4 of 12")
    await expect(card).to_have_attribute("data-version", "2")
    # Its place: under the progress bar.
    below = await card.evaluate(
        "el => el.querySelector('.status-line').getBoundingClientRect().top"
        " > el.querySelector('.bar').getBoundingClientRect().bottom"
    )
    assert below
    await say(gw, made, None)  # null removes the key: no line
    await expect(status).to_be_hidden()
    await say(gw, made, "Uploading the file")
    await post_callback(
        gw,
        JOB_ID,
        made.callback_token,
        {"type": "succeed", "resultRef": "s3://r/1", "resultHash": "sha256:1"},
    )
    await dashboard.wait_card(JOB_ID, "d.state === 'succeeded'", 10_000)
    assert (await server_task(gw, JOB_ID))["metadata"] == {"message": "Uploading the file", "page": 4}
    await expect(status).to_have_text("Uploading the file")

    # A task with no title is named by its id, as before; a page of two tasks says how many.
    await page.goto(f"{gw.url}/?task=report-42&token={untitled.subscribe_token}")
    await expect(dashboard.card("report-42").locator(".task-id")).to_have_text("report-42")
    await expect(page).to_have_title("2 tasks · task-gateway")
    await dashboard.card(JOB_ID).get_by_role("button", name="Stop watching Monthly sales export").click()
    await expect(page).to_have_title("report-42 · task-gateway")
    console.assert_clean()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def exact(dashboard: Dashboard, parent: str, children: list[str]) -> None:
    """The batch card shows what the store holds: the parent's counts, each child's state and status line."""
    page, expect = dashboard.page, dashboard.expect
    card = dashboard.card(parent)
    stored = await server_task(dashboard.gw, parent)
    counts = stored["children"]
    batch = card.locator(".batch")
    for name, value in counts.items():
        await expect(batch).to_have_attribute(f"data-{name}", str(value))
    for child_id in children:
        task = await server_task(dashboard.gw, child_id)
        row = card.locator(f'li.child[data-task-id="{child_id}"]')
        await expect(row).to_have_attribute("data-state", task["state"])
        await expect(row.locator(".child-title")).to_have_text(task["title"])
        line = row.locator(".child-line")
        if task["metadata"].get("message"):
            await expect(line).to_have_text(task["metadata"]["message"])
        if task["state"] == "failed":
            await expect(row.locator(".child-error")).to_have_text(task["error"].capitalize())
    assert await page.locator("article.task-card").count() == 1


@pytest.mark.parametrize("viewport", VIEWPORTS)
async def test_a_batch_is_one_card_counting_its_children_live_through_a_silent_link(
    dashboard: Dashboard, console: Console, viewport: dict[str, int]
) -> None:
    """A batch of 20 made over HTTP (what a Celery group becomes): one card, its counts moving live in words
    and as a bar, its 20 children listed with their titles, states and status lines, live; the link goes
    silent (nothing through, nothing closed) while children move on, and comes back: counts and lines
    exact."""
    gw, page, expect = dashboard.gw, dashboard.page, dashboard.expect
    await page.set_viewport_size(viewport)
    await page.add_init_script(RECORDER)
    parent = await make(gw, "import-7", title="Import of 20 files")
    await post_callback(gw, "import-7", parent.callback_token, START)
    ids = [f"import-7-file-{n:02d}" for n in range(1, 21)]
    kids = {i: await make(gw, i, title=f"file-{n:02d}.csv", parent="import-7") for n, i in enumerate(ids, 1)}

    async with TcpProxy(_port(gw.url)) as relay:
        await page.goto(f"{relay.url}/?task=import-7")
        await page.wait_for_selector("body[data-ready=true]", state="attached")
        card = dashboard.card("import-7")
        batch = card.locator(".batch")
        await expect(card.locator(".task-id")).to_have_text("Import of 20 files")
        await expect(batch.locator(".batch-counts")).to_have_text("0 of 20 done")
        # The only task of the page: its children are unfolded, each named by its title.
        await expect(card.locator("li.child")).to_have_count(20)
        titles = await card.locator(".child-title").all_inner_texts()
        assert titles == [f"file-{n:02d}.csv" for n in range(1, 21)], titles

        # 1. Children start, say where they are and end: the counts and lines move live.
        for i in ids[:8]:
            await post_callback(gw, i, kids[i].callback_token, START)
            await say(gw, kids[i], "Reading rows")
        await expect(batch).to_have_attribute("data-running", "8")
        await expect(card.locator(f'li.child[data-task-id="{ids[0]}"] .child-line')).to_have_text(
            "Reading rows"
        )
        for n, i in enumerate(ids[:5], 1):
            await say(gw, kids[i], f"Wrote {n * 100} rows")
            await post_callback(
                gw,
                i,
                kids[i].callback_token,
                {"type": "succeed", "resultRef": f"s3://{i}", "resultHash": "h"},
            )
        await expect(batch.locator(".batch-counts")).to_have_text("5 of 20 done\u00a0· 3 running")
        await expect(batch.locator(".batch-bar")).to_have_attribute(
            "aria-label", "5 of 20 done\u00a0· 3 running"
        )
        await expect(card.locator(f'li.child[data-task-id="{ids[4]}"] .child-line')).to_have_text(
            "Wrote 500 rows"
        )
        await expect(card.locator(f'li.child[data-task-id="{ids[4]}"]')).to_have_attribute(
            "data-state", "succeeded"
        )
        await exact(dashboard, "import-7", ids)
        await screenshot(page, "batch-card")

        # 2. The link goes silent and the gateway out of reach: the page says so; meanwhile children move on,
        #    one fails, lines change. Back: the counts and every line exact.
        relay.refuse = True
        relay.stall()
        await expect(dashboard.connection).to_have_attribute(
            "data-state", "reconnecting", timeout=STEP_S * 1000
        )
        await expect(card).to_have_attribute("data-stale", "true")
        for i in ids[5:8]:
            await say(gw, kids[i], "Checking totals")
        await post_callback(
            gw,
            ids[5],
            kids[ids[5]].callback_token,
            {"type": "fail", "error": "bad row 12", "retryable": False},
        )
        for i in ids[8:12]:
            await post_callback(gw, i, kids[i].callback_token, START)
            await say(gw, kids[i], "Reading rows")
        relay.refuse = False
        await expect(batch).to_have_attribute("data-failed", "1", timeout=STEP_S * 1000)
        await expect(card).to_have_attribute("data-stale", "false", timeout=STEP_S * 1000)
        await exact(dashboard, "import-7", ids)
        await expect(batch.locator(".batch-counts")).to_have_text(
            "6 of 20 done\u00a0· 1 failed\u00a0· 6 running"
        )

        # 3. The rest run to their end; the parent succeeds after them.
        for i in ids[6:]:
            if i not in ids[6:12]:
                await post_callback(gw, i, kids[i].callback_token, START)
            await say(gw, kids[i], "Done")
            await post_callback(
                gw,
                i,
                kids[i].callback_token,
                {"type": "succeed", "resultRef": f"s3://{i}", "resultHash": "h"},
            )
        await eventually(
            lambda: server_task(gw, "import-7"),
            lambda task: task["children"]["succeeded"] == 19,
            "the parent counting 19 succeeded",
        )
        await post_callback(
            gw,
            "import-7",
            parent.callback_token,
            {"type": "succeed", "resultRef": "s3://all", "resultHash": "h"},
        )
        await dashboard.wait_card("import-7", "d.state === 'succeeded'", 10_000)
        await expect(batch.locator(".batch-counts")).to_have_text("20 of 20 done\u00a0· 1 failed")
        await exact(dashboard, "import-7", ids)

    seen = await page.evaluate("window.__batch")
    ended = seen["ended"]
    assert ended == sorted(ended) and ended[-1] == 20, ended  # only upward, to the end
    assert len({n for n in ended if 0 < n < 20}) >= 3, ended  # live steps, not only the end
    assert "Reading rows" in seen["lines"][ids[0]] and seen["lines"][ids[0]][-1] == "Wrote 100 rows"
    assert (
        await cut_or_off_screen(page, "article.task-card, .batch-counts, .child-title, .child .state-badge")
        == []
    )
    assert await page.evaluate("document.documentElement.scrollWidth <= innerWidth")
    await screenshot(page, "batch-card-done")
    # The refused reconnects are the browser's own console errors ("WebSocket connection ... failed").
    console.errors[:] = [
        e for e in console.errors if not e.startswith(("WebSocket connection to", "Failed to load"))
    ]
    console.assert_clean()


async def test_on_a_tags_page_a_batch_is_one_card_with_its_children(
    dashboard: Dashboard, console: Console
) -> None:
    """Children carrying the page's tag are shown in their parent's card, not as cards of their own; a child
    added while the page is open comes into it; the other tasks of the tag stay cards."""
    gw, page, expect = dashboard.gw, dashboard.page, dashboard.expect
    tag = "owner:u42"
    parent = await make(gw, "report-9", title="Quarterly report", tags=[tag])
    await post_callback(gw, "report-9", parent.callback_token, START)
    sections = [
        await make(gw, f"report-9-s{n}", title=f"Section {n}", parent="report-9", tags=[tag]) for n in (1, 2)
    ]
    await make(gw, "lone-1", title="A lone task", tags=[tag])
    await dashboard.open(f"?tag={tag}")
    card = dashboard.card("report-9")
    await expect(page.locator("article.task-card")).to_have_count(2)
    await expect(card.locator(".batch-counts")).to_have_text("0 of 2 done")
    await card.locator(".batch-children > summary").click()
    await expect(card.locator("li.child")).to_have_count(2)
    await post_callback(gw, "report-9-s1", sections[0].callback_token, START)
    await say(gw, sections[0], "Drawing chart 2 of 5")
    await expect(card.locator('li.child[data-task-id="report-9-s1"] .child-line')).to_have_text(
        "Drawing chart 2 of 5"
    )
    await expect(card.locator(".batch-counts")).to_have_text("0 of 2 done\u00a0· 1 running")
    await make(gw, "report-9-s3", title="Section 3", parent="report-9", tags=[tag])
    await expect(card.locator("li.child")).to_have_count(3)
    await expect(card.locator(".batch-counts")).to_have_text("0 of 3 done\u00a0· 1 running")
    await expect(page.locator("article.task-card")).to_have_count(2)
    await expect(dashboard.card("lone-1").locator(".task-id")).to_have_text("A lone task")
    console.assert_clean()
