"""A task's streams in headless Chromium against a real gateway: gateway-client.js's ``onChunks`` (over the
WebSocket, across a dropped socket, and over the SSE fallback) and the dashboard's output box end with the
text the gateway holds, a retry's output replacing the failed attempt's, and the stream's end after the
task's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from tests.browser.conftest import VIEWPORTS, cut_or_off_screen, screenshot
from tests.support import Running, bearer, create_task, post_callback

if TYPE_CHECKING:
    from tests.browser.conftest import Console

pytestmark = pytest.mark.anyio

START = {"type": "start", "worker": "w1"}
RETRY = {"type": "fail", "error": "boom", "retryable": True}
SUCCEED = {"type": "succeed", "resultRef": "s3://r", "resultHash": "sha256:1"}

# A client of its own following the task's stream "output" (over SSE only where `sse`): window.seen keeps
# what onChunks handed over, window.text the text it makes of it.
FOLLOW = """
async ([taskId, token, sse]) => {
  const { GatewayClient } = await import("/static/gateway-client.js");
  class Blocked { constructor() { throw new Error("WebSockets are blocked here"); } }
  const options = sse ? { WebSocket: Blocked, sseAfterFailures: 1, backoffBaseMs: 1, random: () => 0 } : {};
  window.client = new GatewayClient(location.origin, { ...options, storage: null });
  window.seen = [];
  window.text = "";
  window.ended = false;
  window.client.subscribe(taskId, token, () => {}, {
    streams: ["output"],
    onChunks: (u) => {
      window.seen.push([u.attempt, u.offset, u.chunks.length, u.replace, u.ended]);
      window.text = (u.replace ? "" : window.text) + u.chunks.join("");
      if (u.ended) window.ended = true;
    },
  });
}
"""


async def append(gw: Running, task_id: str, token: str, attempt: int, seq: int, *chunks: str) -> None:
    body = {"attempt": attempt, "seq": seq, "chunks": list(chunks)}
    answer = await gw.client.post(f"/v1/tasks/{task_id}/streams/output", json=body, headers=bearer(token))
    assert answer.status_code == 200, answer.text


async def text_of(gw: Running, task_id: str) -> str:
    answer = await gw.client.get(f"/v1/tasks/{task_id}/streams/output/text")
    assert answer.status_code == 200, answer.text
    return answer.text


@pytest.mark.parametrize("sse", [False, True], ids=["websocket", "sse"])
async def test_the_js_client_hands_over_a_streams_chunks_in_order_and_a_retry_replaces_them(
    gw: Running, page: Any, console: Console, sse: bool
) -> None:
    made = await create_task(gw, "answer-1", max_attempts=2)
    token = made.callback_token
    await post_callback(gw, "answer-1", token, START)
    await append(gw, "answer-1", token, 1, 0, "Once ", "upon ")
    await page.goto(gw.url + "/docs")  # a page of the gateway, for the module's origin
    await page.evaluate(FOLLOW, ["answer-1", made.subscribe_token, sse])
    await page.wait_for_function("window.text === 'Once upon '")
    if not sse:
        await page.evaluate("window.client._ws.close()")  # a dropped socket: resumed from offset 2
    await append(gw, "answer-1", token, 1, 1, "a ", "time")
    await page.wait_for_function("window.text === 'Once upon a time'")
    await post_callback(gw, "answer-1", token, RETRY)
    await post_callback(gw, "answer-1", token, START)
    await append(gw, "answer-1", token, 2, 0, "There ", "was ", "a ", "king.")
    await post_callback(gw, "answer-1", token, SUCCEED, attempt=2)
    await page.wait_for_function("window.ended")
    assert await page.evaluate("window.text") == await text_of(gw, "answer-1") == "There was a king."
    seen = await page.evaluate("window.seen")
    # Every chunk once, in order; the retry's first frame starts the text over; the end at the last offset.
    assert seen[0][:4] == [1, 0, 2, False]
    assert [s for s in seen if s[3]] == [[2, 4, 4, True, False]]
    assert seen[-1] == [2, 8, 0, False, True]
    assert sum(s[2] for s in seen) == 8
    assert console.errors == []


@pytest.mark.parametrize("viewport", VIEWPORTS)
async def test_the_dashboard_shows_a_tasks_output_as_it_is_written_and_a_retrys_instead(
    gw: Running, page: Any, console: Console, viewport: dict[str, int]
) -> None:
    made = await create_task(gw, "answer-2", max_attempts=2)
    token = made.callback_token
    await post_callback(gw, "answer-2", token, START)
    await page.set_viewport_size(viewport)
    await page.goto(f"{gw.url}/?task=answer-2&token={made.subscribe_token}")
    card = page.locator('.task-card[data-task-id="answer-2"]')
    output = card.locator(".task-output")
    assert await output.is_hidden()  # nothing written yet: no empty box
    await append(gw, "answer-2", token, 1, 0, "line 1\n", "line 2\n")
    await output.locator(".output-text").filter(has_text="line 2").wait_for()
    long_line = "a-very-long-token-with-no-space-" * 20  # wrapped in the box, never past the screen
    await append(gw, "answer-2", token, 1, 1, *(f"line {n}: {long_line}\n" for n in range(3, 40)))
    await output.locator(".output-text").filter(has_text="line 39").wait_for()
    assert await cut_or_off_screen(page, ".task-card, .task-output, .output-text") == []
    # The last lines in view: the box scrolled to its end, the whole text a scroll away.
    assert await output.locator(".output-text").evaluate(
        "(pre) => pre.scrollHeight > pre.clientHeight"
        " && pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 2"
    )
    await screenshot(page, "task-output")
    await post_callback(gw, "answer-2", token, RETRY)
    await post_callback(gw, "answer-2", token, START)
    await append(gw, "answer-2", token, 2, 0, "again 1\n")
    await post_callback(gw, "answer-2", token, SUCCEED, attempt=2)
    await page.locator('.task-card[data-task-id="answer-2"] .task-output[data-ended="true"]').wait_for()
    assert await output.locator(".output-text").text_content() == await text_of(gw, "answer-2") == "again 1\n"
    assert await output.locator(".output-attempt").text_content() == "(attempt 2)"
    assert console.errors == []
