"""gateway-client.js in headless Chromium against a real gateway, when a task's id is made again after
retention deleted the task (protocol.md, Resuming: the epoch): a tag subscription that followed the old
task is told of the new one (``added``, its snapshot) and holds it instead; a cursor of the old task, kept
in ``sessionStorage``, given as an option, or sent over the SSE fallback, resumes into the new task with a
``recreated`` snapshot, never as the old one's next versions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from gateway.jobs.retention import Retention
from tests.browser.test_tag_following import FOLLOW, TAG, holds
from tests.support import Running, drain_all, post_callback
from tests.support.tagged import create_tagged

if TYPE_CHECKING:
    from tests.browser.conftest import Console

pytestmark = pytest.mark.anyio

TASK = "job-X"

# The first frame a new client (its own socket, or server-sent events only) hands over for the task, from a
# cursor given (null: the one kept in sessionStorage), with what it keeps after it.
FIRST_FRAME = """
async ([taskId, cursor, sse]) => {
  const { GatewayClient } = await import("/static/gateway-client.js");
  class Blocked { constructor() { throw new Error("WebSockets are blocked here"); } }
  const options = sse ? { WebSocket: Blocked, sseAfterFailures: 1, backoffBaseMs: 1, random: () => 0 } : {};
  const client = new GatewayClient(location.origin, options);
  const frame = await new Promise((resolve) => {
    const first = (frame, task) => resolve([frame.type, frame.reason, task.epoch, task.version]);
    client.subscribe(taskId, null, first, cursor === null ? {} : { cursor });
  });
  client.close();
  return [...frame, client.transport, sessionStorage.getItem(`task-gateway:cursor:${taskId}`)];
}
"""

# Whether the tag subscription holds the task of this epoch at version 2.
HOLDS_NEW = """
([id, epoch]) => window.client.tagTasks("owner:u42").some(
  (t) => t.id === id && t.epoch === epoch && t.version === 2,
)
"""


async def made_again(gw: Running, old: Any) -> dict[str, Any]:
    """The old task run to its end, its notification drained, deleted by a pass of retention; its id made
    again and run to ``running v2`` (progress 40). Returns the new task."""
    token = old.callback_token
    await post_callback(gw, TASK, token, {"type": "start", "worker": "w1"}, callback_id="old-start")
    done = {"type": "succeed", "resultRef": "s3://x", "resultHash": "sha256:x"}
    await post_callback(gw, TASK, token, done, callback_id="old-done", attempt=1)
    await drain_all(gw, 1)
    assert await Retention(gw.gateway.store, lambda: 10**15, 1, relay=False).sweep() == 1
    new = await create_tagged(gw, TASK, [TAG])
    await post_callback(
        gw, TASK, new.callback_token, {"type": "start", "worker": "w2"}, callback_id="new-start"
    )
    progress = {"type": "progress", "progress": 40, "cursor": "row-40"}
    await post_callback(gw, TASK, new.callback_token, progress, callback_id="new-p40", attempt=1)
    return new.task


async def test_the_js_client_replaces_a_task_made_again_under_an_id_it_knew(
    gw: Running, page: Any, console: Console
) -> None:
    old = await create_tagged(gw, TASK, [TAG])
    first = old.task["epoch"]
    await page.goto(gw.url + "/docs")  # a page of the gateway, for the module's origin
    await page.evaluate(FOLLOW, [TAG, None])
    await holds(page, TASK, 0)
    new = await made_again(gw, old)
    second = new["epoch"]
    await page.wait_for_function(HOLDS_NEW, arg=[TASK, second], timeout=15_000)
    handed = await page.evaluate(
        "window.handed.map((f) => [f.type, f.version ?? null, f.reason ?? null, f.task?.epoch ?? null])"
    )
    assert handed == [
        ["tag", None, None, None],  # listing the old task
        ["snapshot", 0, "new", first],
        ["event", 1, None, first],
        ["event", 2, None, first],
        ["added", None, None, None],
        ["snapshot", 0, "new", second],
        ["event", 1, None, second],
        ["event", 2, None, second],
    ]
    tasks = await page.evaluate("window.client.tagTasks('owner:u42')")
    assert [(t["id"], t["state"], t["progress"]) for t in tasks] == [(TASK, "running", 40)]
    assert await page.evaluate("window.client.tagCursors('owner:u42')") == {TASK: 2}

    # A cursor of the old task: given, kept in sessionStorage, or over server-sent events.
    old_cursor = f"2:{first}"
    got = await page.evaluate(FIRST_FRAME, [TASK, old_cursor, False])
    assert got == ["snapshot", "recreated", second, 2, "websocket", f"2:{second}"]
    await page.evaluate(
        "([id, cursor]) => sessionStorage.setItem(`task-gateway:cursor:${id}`, cursor)", [TASK, old_cursor]
    )
    got = await page.evaluate(FIRST_FRAME, [TASK, None, False])
    assert got == ["snapshot", "recreated", second, 2, "websocket", f"2:{second}"]
    got = await page.evaluate(FIRST_FRAME, [TASK, old_cursor, True])
    assert got[:5] == ["snapshot", "recreated", second, 2, "sse"]
    console.assert_clean()
