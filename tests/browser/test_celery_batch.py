"""Issue 34's acceptance in the browser: a Celery group of 20 jobs (tests/jobs/celery_batch.py), run by a real
prefork worker against a ``gateway serve`` keyed with an API key, watched in Chromium on the dashboard with
the parent's subscribe token alone. It is one batch card whose counts move live and which lists each child
by its title with its status line; the page's link goes silent (nothing through, nothing closed, the
gateway out of reach) while jobs run, and comes back; at the end the counts and every line are exactly the
store's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from gateway.integrations.celery import uninstall
from tests.browser.conftest import Console, cut_or_off_screen, screenshot
from tests.jobs.celery_batch import COUNT, TITLE, child_title, publish_batch
from tests.support import STEP_S, TcpProxy, bearer, eventually, http_client, mint
from tests.support.celery_processes import (
    API_KEY,
    celery_worker,
    keyed_gateway,
    publishing_app,
    rabbitmq_broker,
    read_task,
)
from tests.support.processes import SECRET

pytestmark = pytest.mark.anyio

# Every job at its end, a loaded machine included.
SCENARIO_S = 180.0
# Each job's 5 steps this far apart: the group runs for about 20 s on a worker of 2, time for the page to
# show it move, lose its link and get it back.
PAUSE_S = 0.4

# Every value the batch's count of ended children took, from the first script on.
RECORDER = """
(() => {
  window.__ended = [];
  new MutationObserver((records) => {
    for (const r of records) {
      if (r.target.matches(".batch")) window.__ended.push(Number(r.target.dataset.ended));
    }
  }).observe(document, { subtree: true, attributes: true, attributeFilter: ["data-ended"] });
})();
"""


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def ended_children(client: httpx.AsyncClient, parent_id: str) -> int:
    counts = (await read_task(client, parent_id))["children"]
    return int(counts["succeeded"] + counts["failed"] + counts["expired"])


async def test_a_celery_group_is_one_batch_card_live_through_a_silent_link(
    browser: Any, tmp_path: Path, console: Console
) -> None:
    from playwright.async_api import expect

    shared = tmp_path / "shared"
    shared.mkdir()
    context = await browser.new_context(viewport={"width": 1280, "height": 800})
    context.set_default_timeout(15_000)
    await context.add_init_script(RECORDER)
    try:
        with rabbitmq_broker() as broker:
            async with (
                keyed_gateway(tmp_path) as gw,
                http_client(base_url=gw.url, headers=bearer(API_KEY), timeout=30) as client,
                TcpProxy(_port(gw.url)) as relay,
            ):
                app = publishing_app(broker, gw.url, shared)
                try:
                    parent_id, child_ids = await anyio.to_thread.run_sync(
                        lambda: publish_batch(app, pause_s=PAUSE_S)
                    )
                    page = await context.new_page()
                    page.on("console", lambda m: console.errors.append(m.text) if m.type == "error" else None)
                    page.on("pageerror", lambda e: console.page_errors.append(str(e)))
                    token = mint(parent_id, secret=SECRET)  # the parent's subscribe token: one credential
                    await page.goto(f"{relay.url}/?task={parent_id}&token={token}")
                    card = page.locator(f'article.task-card[data-task-id="{parent_id}"]')
                    batch = card.locator(".batch")
                    await expect(card.locator(".task-id")).to_have_text(TITLE)
                    await expect(batch.locator(".batch-counts")).to_have_text(f"0 of {COUNT} done")
                    await expect(card.locator("li.child")).to_have_count(COUNT)
                    titles = await card.locator(".child-title").all_inner_texts()
                    assert sorted(titles) == [child_title(i) for i in range(COUNT)], titles

                    async with celery_worker(broker, gw.url, shared):
                        # 1. The jobs run: the counts move and each running job's line with them.
                        await page.wait_for_function(
                            "() => Number(document.querySelector('.batch')?.dataset.ended) >= 2",
                            timeout=SCENARIO_S * 1000,
                        )
                        await expect(card.locator(".child-line").first).to_have_text(
                            "Item 0: step 5 of 5", timeout=STEP_S * 1000
                        )
                        # The gateway's progress entries for the parent, in words (not "children:2/20").
                        await expect(card.locator(".f-event")).to_contain_text(
                            f"of {COUNT} in the batch done"
                        )
                        await screenshot(page, "celery-batch-card")

                        # 2. The link goes silent while jobs go on ending; the page says so, then the link
                        #    comes back.
                        relay.refuse = True
                        relay.stall()
                        silent_at = await ended_children(client, parent_id)
                        await expect(page.locator("#connection")).to_have_attribute(
                            "data-state", "reconnecting", timeout=STEP_S * 1000
                        )
                        await eventually(
                            lambda: ended_children(client, parent_id),
                            lambda ended: ended >= min(COUNT, silent_at + 4),
                            "jobs ending while the page's link is silent",
                            SCENARIO_S,
                            poll_s=0.2,
                        )
                        relay.refuse = False
                        await expect(card).to_have_attribute("data-stale", "false", timeout=STEP_S * 1000)

                        # 3. The group ends, and its parent with it.
                        await expect(card).to_have_attribute(
                            "data-state", "succeeded", timeout=SCENARIO_S * 1000
                        )
                    parent = await read_task(client, parent_id)
                    counts = parent["children"]
                    assert counts == {
                        "total": COUNT,
                        "queued": 0,
                        "running": 0,
                        "succeeded": COUNT,
                        "failed": 0,
                        "expired": 0,
                    }, parent
                    for name, value in counts.items():
                        await expect(batch).to_have_attribute(f"data-{name}", str(value))
                    await expect(batch.locator(".batch-counts")).to_have_text(f"{COUNT} of {COUNT} done")
                    for index, child_id in enumerate(child_ids):
                        child = await read_task(client, child_id)
                        row = card.locator(f'li.child[data-task-id="{child_id}"]')
                        assert child["metadata"]["message"] == f"Item {index}: step 5 of 5", child
                        await expect(row).to_have_attribute("data-state", child["state"])
                        await expect(row.locator(".child-title")).to_have_text(child["title"])
                        await expect(row.locator(".child-line")).to_have_text(child["metadata"]["message"])
                    assert await page.locator("article.task-card").count() == 1
                    ended = await page.evaluate("window.__ended")
                    assert ended == sorted(ended) and ended[-1] == COUNT, ended  # only upward, to the end
                    assert len({n for n in ended if 0 < n < COUNT}) >= 3, ended  # live, not only the end
                    assert (
                        await cut_or_off_screen(page, "article.task-card, .child-title, .batch-counts") == []
                    )
                    await screenshot(page, "celery-batch-card-done")
                    await page.close()
                finally:
                    uninstall(app)
                    app.close()
    finally:
        await context.close()
    # The browser's own lines: the refused reconnects while the link was silent, and the management API's
    # 401 (the page holds no API key, so it offers no task list).
    console.errors[:] = [
        e for e in console.errors if not e.startswith(("WebSocket connection to", "Failed to load resource"))
    ]
    console.assert_clean()
