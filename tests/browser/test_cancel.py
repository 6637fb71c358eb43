"""Cancel on the dashboard, in headless Chromium against a real gateway: where the management API is open a
live task's card offers "Cancel task", asks once more (with an optional reason) and cancels it; a cancelled
task reads "Cancelled", never as a failure, on its card and in "All tasks"; with an API key (which a browser
does not hold) no card offers Cancel, and a task cancelled by a backend still reads "Cancelled"."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests.support import bearer, create_task, post_callback, running_gateway

if TYPE_CHECKING:
    from tests.browser.conftest import Console, Dashboard

pytestmark = pytest.mark.anyio


async def test_a_live_task_is_cancelled_from_its_card_and_reads_cancelled(
    dashboard: Dashboard, console: Console
) -> None:
    gw, page, expect = dashboard.gw, dashboard.page, dashboard.expect
    made = await create_task(gw, "export-9", max_attempts=3)
    token = made.callback_token
    await post_callback(gw, "export-9", token, {"type": "start", "worker": "w1"})
    await post_callback(gw, "export-9", token, {"type": "progress", "progress": 40, "cursor": "row-400"})

    await dashboard.open(f"?task=export-9&token={made.subscribe_token}")
    card = dashboard.card("export-9")
    await expect(card).to_have_attribute("data-state", "running")
    await expect(page.locator("body")).to_have_attribute("data-manage", "open")
    button = card.get_by_role("button", name="Cancel export-9")
    await expect(button).to_be_visible()

    # Asked once more; "Keep it" goes back and changes nothing.
    await button.click()
    await expect(card.get_by_text("Cancel this task?")).to_be_visible()
    await card.get_by_role("button", name="Keep it").click()
    await expect(card.get_by_text("Cancel this task?")).to_be_hidden()
    await expect(button).to_be_visible()
    assert (await dashboard.server_task("export-9"))["state"] == "running"

    await button.click()
    await card.get_by_label("Reason").fill("started by mistake")
    async with page.expect_response("**/v1/tasks/export-9/cancel") as info:
        await card.get_by_role("button", name="Yes, cancel it").click()
    answer = await info.value
    assert answer.status == 200 and (await answer.json())["reason"] == "cancelled"

    # The card changes by the live stream: "Cancelled", grey, why; no failure box, nothing left to cancel.
    await expect(card).to_have_attribute("data-state", "cancelled")
    await expect(card.locator(".state-badge")).to_have_text("Cancelled")
    await expect(card.locator(".task-cancelled")).to_have_text(
        "Cancelled on request: Started by mistake. It will not be run again."
    )
    await expect(card.locator(".task-failure")).to_be_hidden()
    await expect(card.locator(".cancel-box")).to_be_hidden()
    await expect(card.locator(".f-event")).to_contain_text("cancelled: started by mistake")
    await expect(card.get_by_role("progressbar")).to_have_attribute("aria-valuetext", "40%, Cancelled")
    task = await dashboard.server_task("export-9")
    assert (task["state"], task["error"], task["version"]) == ("failed", "cancelled", 3)
    assert await card.get_attribute("data-version") == "3"
    # Never shown as a failure, not even for a moment.
    seen = await dashboard.seen()
    assert "failed" not in seen["cards"]["export-9"]["state"], seen["cards"]["export-9"]

    # "All tasks" says it in the same word, and its "failed" filter says it holds the cancelled ones.
    section = page.locator("#all-tasks")
    await expect(section).to_have_attribute("data-ready", "true")
    await section.get_by_text("All tasks", exact=True).click()
    await section.get_by_role("button", name="Refresh").click()  # the list is read, not live
    row = section.locator('tr[data-task-id="export-9"]')
    await expect(row.locator(".state-badge")).to_have_text("Cancelled")
    await expect(row).to_have_attribute("data-cancelled", "true")
    await expect(section.get_by_label("Show").locator('option[value="failed"]')).to_have_text(
        "Failed or cancelled"
    )
    console.assert_clean()


async def test_a_refused_cancel_says_why_and_a_task_that_ends_meanwhile_withdraws_the_question(
    dashboard: Dashboard, console: Console
) -> None:
    """A refusal (here a reason too long for the gateway, put in by a script past the input's maxlength) is
    said in words on the card and the question stays open; a task that ends while the question is open
    takes the question away (there is nothing left to cancel)."""
    gw, expect = dashboard.gw, dashboard.expect
    made = await create_task(gw, "q-2")
    await post_callback(gw, "q-2", made.callback_token, {"type": "start", "worker": "w"})
    await dashboard.open(f"?task=q-2&token={made.subscribe_token}")
    card = dashboard.card("q-2")
    await expect(card).to_have_attribute("data-state", "running")
    await card.get_by_role("button", name="Cancel q-2").click()
    reason = card.get_by_label("Reason")
    await reason.evaluate("(el) => el.removeAttribute('maxlength')")
    await reason.fill("x" * 1025)
    await card.get_by_role("button", name="Yes, cancel it").click()
    await expect(card.locator(".cancel-error")).to_contain_text("reason")
    await expect(card.get_by_text("Cancel this task?")).to_be_visible()
    assert (await dashboard.server_task("q-2"))["state"] == "running"

    succeed = {"type": "succeed", "resultRef": "s3://r/q-2", "resultHash": "sha256:1"}
    await post_callback(gw, "q-2", made.callback_token, succeed)
    await expect(card).to_have_attribute("data-state", "succeeded")
    await expect(card.locator(".cancel-box")).to_be_hidden()
    # The 400 is a console error in Chromium (it reports every failed load); nothing else may be.
    assert all("400" in e for e in console.errors), console.errors
    assert console.page_errors == []


async def test_with_an_api_key_no_card_offers_cancel_yet_a_cancelled_task_reads_cancelled(
    context: Any, sqlite_url: str, console: Console
) -> None:
    from playwright.async_api import expect

    async with running_gateway(sqlite_url, api_key="k3y") as gw:
        key = bearer("k3y")
        made = await create_task(gw, "keyed-1", headers=key)
        await post_callback(gw, "keyed-1", made.callback_token, {"type": "start", "worker": "w"})
        page = await context.new_page()
        page.on("console", lambda m: console.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: console.page_errors.append(str(e)))
        await page.goto(f"{gw.url}/?task=keyed-1&token={made.subscribe_token}")
        card = page.locator('article.task-card[data-task-id="keyed-1"]')
        await expect(card).to_have_attribute("data-state", "running")
        await expect(page.locator("body")).to_have_attribute("data-manage", "closed")
        await expect(card.locator(".cancel-box")).to_be_hidden()
        await expect(card.get_by_role("button", name="Cancel keyed-1")).to_have_count(0)

        # A backend cancels it with the key: the card follows live.
        answer = await gw.client.post("/v1/tasks/keyed-1/cancel", json={"reason": "runaway"}, headers=key)
        assert answer.status_code == 200, answer.text
        await expect(card).to_have_attribute("data-state", "cancelled")
        await expect(card.locator(".state-badge")).to_have_text("Cancelled")
        await expect(card.locator(".task-cancelled")).to_contain_text("Runaway")
        await page.close()
    # The refused probe of the management API is the only console error (a 401 the browser reports).
    assert all("401" in e for e in console.errors), console.errors
    assert console.page_errors == []
