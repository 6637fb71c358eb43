"""Live push in the browser through cuts: the WebSocket closed by the server, the browser taken offline,
WebSockets blocked altogether (the SSE fallback), and the SSE stream cut."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from bench.checks.dead_link_pages import noticed_out_of_reach, replaced, replaced_back_online
from gateway.client import Worker
from tests.browser.conftest import VIEWPORTS, cut_or_off_screen, screenshot
from tests.support import STEP_S, TcpProxy, create_task

if TYPE_CHECKING:
    from tests.browser.conftest import Clocked, Console, Dashboard

pytestmark = pytest.mark.anyio

# A WebSocket that never gets through, as on a network that blocks it: it fails as a real one does
# (error, then close 1006) a moment after it is made.
BLOCK_WEBSOCKET = """
window.__blockedSockets = 0;
window.WebSocket = class BlockedWebSocket extends EventTarget {
  static CONNECTING = 0; static OPEN = 1; static CLOSING = 2; static CLOSED = 3;
  constructor(url) {
    super();
    this.url = url;
    this.readyState = 0;
    this.onopen = this.onmessage = this.onerror = this.onclose = null;
    window.__blockedSockets += 1;
    setTimeout(() => {
      this.readyState = 3;
      const error = new Event("error");
      const close = new CloseEvent("close", { code: 1006, wasClean: false });
      this.dispatchEvent(error);
      if (this.onerror) this.onerror(error);
      this.dispatchEvent(close);
      if (this.onclose) this.onclose(close);
    }, 20);
  }
  send() { throw new DOMException("the socket is not open", "InvalidStateError"); }
  close() {}
};
"""


async def test_socket_cut_and_offline_resume_with_delta(dashboard: Dashboard, console: Console) -> None:
    gw = dashboard.gw
    page = dashboard.page
    connection = dashboard.connection
    expect = dashboard.expect
    created = await create_task(gw, "cut-1", max_attempts=2)
    await dashboard.open(f"?task=cut-1&token={created['subscribeToken']}")
    async with Worker(gw.url, "cut-1", created["callbackToken"]) as worker:
        await worker.start("w1")
        await worker.progress(10, "p10")
        await dashboard.wait_card("cut-1", "d.version === '2' && d.resumes === '1'", 10_000)
        await expect(connection).to_have_attribute("data-state", "connected")

        # 1. The server closes every socket (1012, service restart) while the task runs; an entry is
        #    committed meanwhile. The indicator says reconnecting; the client resumes from version 2.
        gw.gateway.hub.shutdown(1012)
        await worker.progress(20, "p20")
        await dashboard.wait_card("cut-1", "d.resumes === '2' && d.version === '3'", 10_000)
        assert "reconnecting" in (await dashboard.seen())["connection"]
        data = await dashboard.dataset("cut-1")
        assert data["resumedFrom"] == "2", data
        # delta when the entry was committed before the new socket subscribed, else caught-up then the
        # entry live; the offline step below makes the delta certain.
        assert data["resume"] in ("delta", "caught-up"), data
        await expect(connection).to_have_attribute("data-state", "connected")

        # 2. The browser goes offline and the socket is cut; two entries are committed while it is away.
        #    Back online, it resumes with a delta of exactly what it missed.
        await page.context.set_offline(True)
        await expect(connection).to_have_attribute("data-state", "offline")
        gw.gateway.hub.shutdown(1012)
        await worker.progress(30, "p30")
        await worker.progress(40, "p40")
        await page.context.set_offline(False)
        await dashboard.wait_card("cut-1", "d.resumes === '3' && d.version === '5'", 10_000)
        data = await dashboard.dataset("cut-1")
        assert (data["resume"], data["resumedFrom"], data["progress"]) == ("delta", "3", "40"), data
        await expect(connection).to_have_attribute("data-state", "connected")
        await expect(dashboard.card("cut-1").locator(".f-resume")).to_contain_text("delta from v3")

        # 3. Offline and back while the socket survives: frames flow again on it, and the indicator
        #    must not stay "offline".
        await page.context.set_offline(True)
        await expect(connection).to_have_attribute("data-state", "offline")
        await worker.progress(50, "p50")
        await page.context.set_offline(False)
        await dashboard.wait_card("cut-1", "d.version === '6'", 10_000)
        await expect(connection).to_have_attribute("data-state", "connected")

        await worker.succeed("s3://results/cut-1", "sha256:00")
    await dashboard.wait_card("cut-1", "d.state === 'succeeded' && d.version === '7'", 10_000)
    await dashboard.assert_matches_server("cut-1")
    assert (await dashboard.dataset("cut-1"))["resumes"] == "3"
    await expect(dashboard.card("cut-1").get_by_role("progressbar")).to_have_attribute("aria-valuenow", "100")
    console.assert_clean()


async def test_sse_fallback_shows_live_progress_to_the_end(dashboard: Dashboard, console: Console) -> None:
    page = dashboard.page
    await page.add_init_script(BLOCK_WEBSOCKET)
    streams: list[str] = []
    page.on("request", lambda r: streams.append(r.url) if "/stream?" in r.url else None)
    await dashboard.open()
    task_id, _ = await dashboard.start_demo()

    await dashboard.expect(dashboard.connection).to_have_attribute("data-transport", "sse")
    await dashboard.wait_card(task_id, "Number(d.progress) > 0")  # live progress while it runs
    await dashboard.expect(dashboard.connection).to_have_attribute("data-state", "connected")
    final = await dashboard.wait_terminal(task_id)
    await dashboard.assert_matches_server(task_id)

    assert await page.evaluate("window.__blockedSockets") >= 2  # sseAfterFailures WebSocket attempts first
    assert streams and all(f"/v1/tasks/{task_id}/stream?" in url for url in streams), streams
    progress = (await dashboard.seen())["cards"][task_id]["progress"]
    assert len({p for p in progress if 0 < p < 100}) >= 2, progress  # the bar moved step by step
    if final == "succeeded":
        await dashboard.expect(dashboard.card(task_id).get_by_role("progressbar")).to_have_attribute(
            "aria-valuenow", "100"
        )
    console.assert_clean()


async def test_sse_stream_cut_resumes_with_delta_to_the_end(dashboard: Dashboard, console: Console) -> None:
    """The SSE stream ends (server restart) while the task runs, and the task finishes before the
    EventSource is back: its resume frame (a delta holding the terminal entry) must be applied."""
    gw = dashboard.gw
    page = dashboard.page
    await page.add_init_script(BLOCK_WEBSOCKET)
    created = await create_task(gw, "sse-cut", max_attempts=2)
    await dashboard.open(f"?task=sse-cut&token={created['subscribeToken']}")
    await dashboard.expect(dashboard.connection).to_have_attribute("data-transport", "sse")
    async with Worker(gw.url, "sse-cut", created["callbackToken"]) as worker:
        await worker.start("w1")
        await worker.progress(10, "p10")
        await dashboard.wait_card("sse-cut", "d.version === '2'", 10_000)

        gw.gateway.hub.shutdown(1012)  # ends the stream; the EventSource reconnects after its retry delay
        await worker.progress(60, "p60")
        await worker.succeed("s3://results/sse-cut", "sha256:01")
    await dashboard.wait_card("sse-cut", "d.state === 'succeeded' && d.resumes === '2'", 15_000)
    data = await dashboard.dataset("sse-cut")
    assert (data["resume"], data["resumedFrom"], data["version"]) == ("delta", "2", "4"), data
    assert "reconnecting" in (await dashboard.seen())["connection"]
    await dashboard.assert_matches_server("sse-cut")
    console.assert_clean()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def test_a_silently_dead_link_is_replaced(dashboard: Dashboard, console: Console) -> None:
    """The page reaches the gateway through a relay that, at some point, stops forwarding both ways without
    closing anything (no FIN), as a phone changing networks or a NAT timing out. The client must notice by
    its heartbeat, say so, mark the card as possibly stale, open a new connection and end exact. How soon
    (within 10 s) is no test, a loaded machine can miss it: it is the bench check ``page-dead-link``
    (bench/checks/dead_link_pages.py), whose steps these are."""
    gw = dashboard.gw
    page = dashboard.page
    connection = dashboard.connection
    expect = dashboard.expect
    card = dashboard.card("dead-1")
    banner = page.locator("#link-banner")
    created = await create_task(gw, "dead-1", max_attempts=2)
    async with TcpProxy(_port(gw.url)) as relay, Worker(gw.url, "dead-1", created["callbackToken"]) as worker:
        await page.goto(f"{relay.url}/?task=dead-1&token={created['subscribeToken']}")
        await page.wait_for_selector("body[data-ready=true]", state="attached")
        await worker.start("w1")
        await worker.progress(10, "p10")
        await dashboard.wait_card("dead-1", "d.version === '2'", 10_000)
        await expect(connection).to_have_attribute("data-state", "connected")
        await expect(banner).to_be_hidden()

        # 1. The link dies silently; new connections get through. The dead socket is noticed and replaced,
        #    and the entry committed meanwhile (lost in the relay) arrives on the new one.
        accepted = relay.accepted
        await replaced(page, relay, worker, 20, 3, STEP_S)
        await expect(connection).to_have_attribute("data-state", "connected")
        seen = await dashboard.seen()
        assert "reconnecting" in seen["connection"], seen["connection"]
        assert "true" in seen["cards"]["dead-1"]["stale"], seen["cards"]["dead-1"]
        assert relay.accepted > accepted

        # 2. Offline, the link dies, online again: reconnectNow() must not trust the old socket (it asks
        #    with a deadline and replaces it), so the indicator does not stay "Offline".
        await replaced_back_online(page, relay, worker, 30, 4, STEP_S)
        await expect(connection).to_have_attribute("data-state", "connected", timeout=1_000)

        # 3. The link dies and the gateway stays out of reach: the indicator says reconnecting, a banner
        #    says the connection is lost, and the card says its data may be out of date.
        await noticed_out_of_reach(page, relay, STEP_S)
        await expect(banner).to_be_visible(timeout=1_000)
        await expect(banner).to_contain_text("Connection lost")
        await expect(card).to_have_attribute("data-stale", "true")
        await expect(card.locator(".stale-note")).to_contain_text("May be out of date")
        await worker.progress(50, "p50")
        relay.refuse = False
        await dashboard.wait_card("dead-1", "d.version === '5' && d.stale === 'false'", 15_000)
        await expect(banner).to_be_hidden()
        await expect(card.locator(".stale-note")).to_be_hidden()

        await worker.progress(80, "p80")
        await worker.succeed("s3://results/dead-1", "sha256:00")
        await dashboard.wait_card("dead-1", "d.state === 'succeeded' && d.version === '7'", 10_000)
        await dashboard.assert_matches_server("dead-1")
    # The refused attempts are the browser's own console errors ("WebSocket connection ... failed").
    console.errors[:] = [e for e in console.errors if not e.startswith("WebSocket connection to")]
    console.assert_clean()


@pytest.mark.parametrize("viewport", VIEWPORTS)
async def test_after_an_outage_the_card_says_in_words_what_it_missed(
    clocked: Clocked, console: Console, viewport: dict[str, int]
) -> None:
    """The link drops while the task's first attempt fails and the task is retried, more entries than a
    delta carries (the gateway keeps deltas to 2): the page comes back with a snapshot, which has the task
    and not the entries, and says what happened from the task ("Attempt 1 failed: timeout; retried.").
    Down again while it succeeds: the succeeded card keeps its attempts, says how long it took, and shows
    the first attempt's error (which the task keeps) as that attempt's, not as the outcome."""
    dashboard, clock = clocked.dashboard, clocked.clock
    gw, page, expect = dashboard.gw, dashboard.page, dashboard.expect
    await page.set_viewport_size(viewport)
    made = (await clocked.create_in_turn("report-7"))["report-7"]
    card = dashboard.card("report-7")

    async def report(*events: dict[str, Any]) -> None:
        await clocked.report(made, *events)

    async with TcpProxy(_port(gw.url)) as relay:
        await page.goto(f"{relay.url}/?task=report-7&token={made.subscribe_token}")
        await page.wait_for_selector("body[data-ready=true]", state="attached")
        await report({"type": "start", "worker": "w1"}, {"type": "progress", "progress": 30, "cursor": "p30"})
        await dashboard.wait_card("report-7", "d.version === '2'", 10_000)
        await expect(card.locator(".history")).to_be_hidden()  # a first attempt has no history

        # 1. Down while attempt 1 fails, attempt 2 starts and reports: three entries missed.
        relay.refuse = True
        relay.cut()
        await report(
            {"type": "fail", "error": "timeout", "retryable": True},
            {"type": "start", "worker": "w2"},
            {"type": "progress", "progress": 50, "cursor": "p50"},
        )
        relay.refuse = False
        await dashboard.wait_card("report-7", "d.version === '5' && d.resume === 'snapshot'", 15_000)
        await expect(card.locator(".state-badge")).to_have_text("Running")
        await expect(card.locator(".history")).to_have_text("Attempt 1 failed: timeout; retried.")
        await expect(card.locator(".f-attempts")).to_have_text("2 of 3")
        await screenshot(page, "card-after-outage-running")

        # 2. Down again while it succeeds, 65 s after it was created.
        relay.refuse = True
        relay.cut()
        clock.advance(65_000)
        await report(
            {"type": "progress", "progress": 70, "cursor": "p70"},
            {"type": "progress", "progress": 90, "cursor": "p90"},
            {"type": "succeed", "resultRef": "s3://results/7", "resultHash": "sha256:07"},
        )
        relay.refuse = False
        await dashboard.wait_card("report-7", "d.version === '8' && d.resume === 'snapshot'", 15_000)
        # How long it took comes from the entry that finished it, which the page reads after the snapshot.
        await expect(card.locator(".f-took")).to_have_text("1\u00a0min\u00a05\u00a0s")
    task = await dashboard.assert_matches_server("report-7")
    assert (task["state"], task["attempts"], task["error"]) == ("succeeded", 2, "timeout")
    await expect(card.locator(".state-badge")).to_have_text("Succeeded")
    await expect(card.locator(".history")).to_have_text("Attempt 1 failed: timeout; retried.")
    await expect(card.locator(".f-attempts")).to_have_text("2 of 3")
    await expect(card.locator(".f-attempts")).to_be_visible()
    await expect(card.locator(".f-took")).to_be_visible()
    # The error is the first attempt's, not the outcome: no failure box, no "Failed" anywhere on the card.
    await expect(card.locator(".task-failure")).to_be_hidden()
    assert "Failed" not in await card.inner_text()
    assert await cut_or_off_screen(page, "article.task-card, article.task-card .state-badge") == []
    await screenshot(page, "card-after-outage")
    # The refused reconnects are the browser's own console errors ("WebSocket connection ... failed"), as is
    # a read of the last entry that the outage cut ("Failed to load resource: net::ERR_EMPTY_RESPONSE"; the
    # page reads it again at the next resume frame).
    outage = ("WebSocket connection to", "Failed to load resource: net::")
    console.errors[:] = [e for e in console.errors if not e.startswith(outage)]
    console.assert_clean()
