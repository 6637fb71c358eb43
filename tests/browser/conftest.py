"""Browser tests: the dashboard and gateway-client.js in real headless Chromium (Debian's), driven by
Playwright's async API against a real gateway (``running_gateway``).

Chromium is launched once per module; each test gets a fresh browser context (its own storage, its own
network emulation) and a page that records console errors, uncaught exceptions and every change of the
state attributes the dashboard exposes (``window.__seen``), so that a state held for a few milliseconds
(``reconnecting``) is still seen. Nothing here sleeps to wait for a condition: the waits are Playwright's
``expect`` and ``wait_for_function`` with timeouts, or a bounded poll of the gateway's HTTP API.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.support import Created, FakeClock, Running, create_task, eventually, post_callback, running_gateway

CHROMIUM = Path(os.environ.get("GATEWAY_TEST_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
# Where to keep screenshots of what the layout tests look at (``screenshot``), for a person to look at too;
# unset: none are taken.
SCREENSHOTS = os.environ.get("GATEWAY_TEST_SCREENSHOTS")
# A desktop and a phone (an iPhone 12 to 15's CSS pixels): the layout tests run at both.
VIEWPORTS = [
    pytest.param({"width": 1280, "height": 800}, id="1280x800"),
    pytest.param({"width": 390, "height": 844}, id="390x844"),
]
TERMINAL = ("succeeded", "failed", "expired")
TERMINAL_RE = re.compile("^(succeeded|failed|expired)$")
# A demo task runs 3 to 10 s (ticks of 0.4 s, maybe a retry); the waits leave room for a slow machine.
DEMO_TIMEOUT_MS = 30_000

# Records every value the dashboard's state attributes take, from the first script on (MutationObserver
# callbacks see each change, even one undone a millisecond later).
RECORDER = """
(() => {
  const seen = { connection: [], transport: [], cards: {} };
  window.__seen = seen;
  const card = (id) => (seen.cards[id] ??= { state: [], progress: [], resume: [], stale: [] });
  const observer = new MutationObserver((records) => {
    for (const r of records) {
      const el = r.target;
      const now = el.getAttribute(r.attributeName);
      const values = r.oldValue === null ? [now] : [r.oldValue, now];
      if (el.id === "connection") {
        if (r.attributeName === "data-state") seen.connection.push(...values);
        if (r.attributeName === "data-transport") seen.transport.push(...values);
        continue;
      }
      const article = el.closest ? el.closest("article.task-card") : null;
      if (!article || !article.dataset.taskId) continue;
      const c = card(article.dataset.taskId);
      if (r.attributeName === "aria-valuenow") c.progress.push(...values.map(Number));
      if (el === article && r.attributeName === "data-state") c.state.push(...values);
      if (el === article && r.attributeName === "data-resume") c.resume.push(...values);
      if (el === article && r.attributeName === "data-stale") c.stale.push(...values);
    }
  });
  observer.observe(document, {
    subtree: true,
    attributes: true,
    attributeOldValue: true,
    attributeFilter: ["data-state", "data-transport", "aria-valuenow", "data-resume", "data-stale"],
  });
})();
"""


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI must run the browser tests)")
    pytest.skip(reason)


def _require_chromium_and_playwright() -> None:
    if not CHROMIUM.exists():
        _unavailable(f"{CHROMIUM} is missing: install Debian's chromium to run the browser tests")
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        _unavailable("the playwright package is not installed: pip install playwright")


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    # Session scope, so that one Chromium serves every browser test of a process (same event loop).
    return "asyncio"


@pytest.fixture(scope="session")
async def browser() -> AsyncIterator[Any]:
    """Debian's Chromium, headless, launched once per process of the suite (each test has a context of its
    own: ``context``). Playwright gives it a fresh temporary user data dir (removed on close); no browser is
    ever downloaded."""
    _require_chromium_and_playwright()
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            yield chromium
        finally:
            await chromium.close()


@pytest.fixture
async def gw(browser: Any, sqlite_url: str) -> AsyncIterator[Running]:
    """A gateway in open mode on loopback: demo tasks on, no API key."""
    async with running_gateway(sqlite_url) as running:
        yield running


@dataclass
class Console:
    """What a page said on its console and what it threw."""

    errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)

    def assert_clean(self) -> None:
        assert self.page_errors == [], f"uncaught exceptions: {self.page_errors}"
        assert self.errors == [], f"console errors: {self.errors}"


@pytest.fixture
async def context(browser: Any) -> AsyncIterator[Any]:
    ctx = await browser.new_context(viewport={"width": 1280, "height": 800})
    ctx.set_default_timeout(15_000)
    await ctx.add_init_script(RECORDER)
    try:
        yield ctx
    finally:
        await ctx.close()


@pytest.fixture
def console() -> Console:
    return Console()


@pytest.fixture
async def page(gw: Running, context: Any, console: Console) -> Any:
    """A page of the test's gateway (set up after it, so closed before it stops)."""
    page = await context.new_page()
    page.on("console", lambda m: console.errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: console.page_errors.append(str(e)))
    return page


class Dashboard:
    """The dashboard page of one gateway, in terms of what a user sees and the DOM attributes it keeps."""

    def __init__(self, page: Any, gw: Running) -> None:
        from playwright.async_api import expect

        self.page = page
        self.gw = gw
        self.expect = expect

    async def open(self, query: str = "") -> None:
        await self.page.goto(self.gw.url + "/" + query)
        await self.page.wait_for_selector("body[data-ready=true]", state="attached")

    def card(self, task_id: str) -> Any:
        return self.page.locator(f'article.task-card[data-task-id="{task_id}"]')

    @property
    def connection(self) -> Any:
        return self.page.locator("#connection")

    async def start_demo(self) -> tuple[str, str]:
        """Click "Start a demo task"; returns the new task's id and subscribe token."""
        button = self.page.get_by_role("button", name="Start a demo task")
        await self.expect(button).to_be_enabled()
        async with self.page.expect_response("**/v1/demo/tasks") as info:
            await button.click()
        answer = await (await info.value).json()
        task_id = answer["task"]["id"]
        await self.expect(self.card(task_id)).to_be_visible()
        return task_id, answer["subscribeToken"]

    async def wait_card(self, task_id: str, condition: str, timeout_ms: int = DEMO_TIMEOUT_MS) -> None:
        """Wait until ``condition`` (a JS expression over ``d``, the card's dataset) holds."""
        await self.page.wait_for_function(
            """([id, condition]) => {
                const el = document.querySelector(`article.task-card[data-task-id="${id}"]`);
                if (!el) return false;
                const d = el.dataset;
                return Function("d", `return (${condition});`)(d);
            }""",
            arg=[task_id, condition],
            timeout=timeout_ms,
            polling="raf",
        )

    async def wait_terminal(self, task_id: str, timeout_ms: int = DEMO_TIMEOUT_MS) -> str:
        await self.expect(self.card(task_id)).to_have_attribute("data-state", TERMINAL_RE, timeout=timeout_ms)
        return str(await self.card(task_id).get_attribute("data-state"))

    async def dataset(self, task_id: str) -> dict[str, str]:
        data: dict[str, str] = await self.card(task_id).evaluate("el => ({...el.dataset})")
        return data

    async def seen(self) -> dict[str, Any]:
        seen: dict[str, Any] = await self.page.evaluate("window.__seen")
        return seen

    async def server_task(self, task_id: str) -> dict[str, Any]:
        answer = await self.gw.client.get(f"/v1/tasks/{task_id}")
        assert answer.status_code == 200, answer.text
        task: dict[str, Any] = answer.json()
        return task

    async def wait_server_version(self, task_id: str, above: int, timeout_s: float = 15) -> dict[str, Any]:
        """Poll the gateway until the task's version passes ``above`` (the worker moved on)."""
        return await eventually(
            lambda: self.server_task(task_id),
            lambda task: task["version"] > above,
            f"{task_id} past version {above}",
            timeout_s,
            poll_s=0.05,
        )

    async def assert_matches_server(self, task_id: str) -> dict[str, Any]:
        """The card shows the task exactly as ``GET /v1/tasks/{id}`` does (call once it is terminal)."""
        task = await self.server_task(task_id)
        data = await self.dataset(task_id)
        assert (data["state"], int(data["version"]), int(data["progress"])) == (
            task["state"],
            task["version"],
            task["progress"],
        ), (data, task)
        bar = self.card(task_id).get_by_role("progressbar")
        await self.expect(bar).to_have_attribute("aria-valuenow", str(task["progress"]))
        attempts = f"{task['attempts']} of {task['maxAttempts']}"
        await self.expect(self.card(task_id).locator(".f-attempts")).to_have_text(attempts)
        return task


@pytest.fixture
def dashboard(gw: Running, page: Any) -> Dashboard:
    return Dashboard(page, gw)


@dataclass
class Clocked:
    """A dashboard of a gateway whose task time is ``clock`` (FakeClock): tasks created a step of it apart,
    or finishing a known time after their creation."""

    dashboard: Dashboard
    clock: FakeClock

    async def create_in_turn(self, *ids: str, tags: Sequence[str] | None = None) -> dict[str, Created]:
        """Tasks ``ids`` (3 attempts each, ``tags`` if given) created in this order, a second apart."""
        created: dict[str, Created] = {}
        for task_id in ids:
            if created:
                self.clock.advance(1_000)
            created[task_id] = await create_task(self.dashboard.gw, task_id, max_attempts=3, tags=tags)
        return created

    async def report(self, made: Created, *events: dict[str, Any]) -> None:
        """Each of ``events``, in order, as ``made``'s worker reports it (its callback token)."""
        for event in events:
            await post_callback(self.dashboard.gw, made.task["id"], made.callback_token, event)


@pytest.fixture
async def clocked(browser: Any, sqlite_url: str, context: Any, console: Console) -> AsyncIterator[Clocked]:
    """As ``dashboard`` (open mode), on a FakeClock, with no sweeps (nothing expires on its own), and a delta
    of at most 2 entries (``GATEWAY_RETENTION_VERSIONS``): a page that missed 3 comes back with a snapshot."""
    clock = FakeClock(int(time.time() * 1000))  # from now: the page's times read as they would live
    async with running_gateway(sqlite_url, clock=clock, sweep_interval_ms=0, retention_versions=2) as gw:
        page = await context.new_page()
        page.on("console", lambda m: console.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: console.page_errors.append(str(e)))
        try:
            yield Clocked(Dashboard(page, gw), clock)
        finally:
            await page.close()


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


async def screenshot(page: Any, name: str, *, full_page: bool = True) -> None:
    """The page as a user sees it (the whole page, or the screen only), as ``<name>-<width>x<height>.png`` in
    GATEWAY_TEST_SCREENSHOTS when it names a folder; nothing otherwise."""
    if not SCREENSHOTS:
        return
    size = page.viewport_size
    folder = anyio.Path(SCREENSHOTS)
    await folder.mkdir(parents=True, exist_ok=True)
    await page.screenshot(
        path=str(folder / f"{name}-{size['width']}x{size['height']}.png"),
        full_page=full_page,
        animations="disabled",  # transitions at their end: the bar as it stands, not on its way
    )


# Each element of a selector that does not fit: its text cut (wider than its box) or its box past the
# viewport's right edge (off screen: the page scrolls sideways, or a scroller hides it). Elements not
# shown (no box) are left out.
CUT_OR_OFF_SCREEN = """
(selector) => [...document.querySelectorAll(selector)]
  .filter((el) => el.getClientRects().length > 0)
  .map((el) => {
    const box = el.getBoundingClientRect();
    return {
      text: el.textContent.trim().slice(0, 40),
      scrollWidth: el.scrollWidth,
      clientWidth: el.clientWidth,
      left: box.left,
      right: box.right,
      viewport: document.documentElement.clientWidth,
    };
  })
  .filter((b) => b.scrollWidth > b.clientWidth || b.left < 0 || b.right > b.viewport + 0.5)
"""


async def cut_or_off_screen(page: Any, selector: str) -> list[dict[str, Any]]:
    """The elements of ``selector`` whose text overflows their box or that stand past the screen's edge."""
    found: list[dict[str, Any]] = await page.evaluate(CUT_OR_OFF_SCREEN, selector)
    return found
