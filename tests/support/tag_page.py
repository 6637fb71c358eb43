"""The dashboard opened on a tag link, as a page model: its cards, in the order shown, each beside the task
as the store has it. For tests/browser/test_tag_scale_out.py and the bench check ``tag-page-back``
(bench/checks/dead_link_pages.py), which follow one such page through a silent link."""

from __future__ import annotations

from typing import Any

import httpx

CARDS = "#tasks article.task-card"  # the cards in the order shown


class TagPage:
    """The dashboard opened on a tag link, in terms of its cards and the store behind them."""

    def __init__(self, page: Any, client: httpx.AsyncClient, store_url: str) -> None:
        from playwright.async_api import expect

        self.page = page
        self.client = client
        self.store_url = store_url
        self.expect = expect

    def card(self, task_id: str) -> Any:
        return self.page.locator(f'{CARDS}[data-task-id="{task_id}"]')

    async def order(self) -> list[str]:
        ids: list[str] = await self.page.eval_on_selector_all(CARDS, "els => els.map(e => e.dataset.taskId)")
        return ids

    async def stored(self, task_id: str) -> dict[str, Any]:
        answer = await self.client.get(f"{self.store_url}/v1/tasks/{task_id}")
        assert answer.status_code == 200, answer.text
        task: dict[str, Any] = answer.json()
        return task

    async def exact(self, task_id: str, timeout_ms: float) -> None:
        """Wait until the card shows the task as the store has it now (state, progress, version)."""
        task = await self.stored(task_id)
        want = {"state": task["state"], "progress": str(task["progress"]), "version": str(task["version"])}
        try:
            await self.page.wait_for_function(
                """([id, want]) => {
                    const el = document.querySelector(`#tasks article.task-card[data-task-id="${id}"]`);
                    if (!el) return false;
                    const d = el.dataset;
                    return (
                        d.state === want.state && d.progress === want.progress && d.version === want.version
                    );
                }""",
                arg=[task_id, want],
                timeout=max(1.0, timeout_ms),
                polling="raf",
            )
        except Exception:
            shown = await self.card(task_id).evaluate_all("els => els.map(e => ({...e.dataset}))")
            raise AssertionError(f"{task_id}: the card shows {shown}, the store {want}") from None
        await self.expect(self.card(task_id).get_by_role("progressbar")).to_have_attribute(
            "aria-valuenow", want["progress"]
        )
