"""gateway-client.js's handling of what changes beside a task's history (issue 34): `metadata` and `children`
frames, and the `metadata`, `children` and `revision` a task's frames carry. Frames are fed to the client in
Chromium through a WebSocket of the test's own, in orders a real gateway can produce across processes and
reconnects (an older revision after a newer one): the client keeps the newest by revision, tells
`onMetadata` and `onChildren` of each change once, and hands every listener the task with the newest."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.browser.conftest import Console
    from tests.support import Running

pytestmark = pytest.mark.anyio

# A WebSocket that opens at once and whose frames the test sends (window.deliver); each socket made is kept
# (window.sockets), the last one is the client's.
SCRIPTED = """
async ([tagged]) => {
  const { GatewayClient } = await import("/static/gateway-client.js");
  window.sockets = [];
  class Scripted {
    constructor(url) {
      this.url = url;
      this.readyState = 0;
      this.sent = [];
      window.sockets.push(this);
      setTimeout(() => { this.readyState = 1; this.onopen && this.onopen(); }, 0);
    }
    send(message) { this.sent.push(JSON.parse(message)); }
    close() { this.readyState = 3; }
  }
  window.deliver = (frame) => window.sockets.at(-1).onmessage({ data: JSON.stringify(frame) });
  window.drop = () => {
    const socket = window.sockets.at(-1);
    socket.readyState = 3;
    socket.onclose({ code: 1006 });
  };
  const client = new GatewayClient(location.origin, {
    WebSocket: Scripted, EventSource: null, storage: null, backoffBaseMs: 1, backoffCapMs: 1, random: () => 0,
    heartbeatMs: 600000, deadlineMs: 600000,
  });
  window.client = client;
  window.told = [];
  const tell = (...what) => window.told.push(what);
  const frame = (f, task) => tell("frame", f.type, task.revision, task.metadata, task.children ?? null);
  const options = {
    onMetadata: (u) => tell("metadata", u.taskId, u.revision, u.metadata, u.task ? u.task.metadata : null),
    onChildren: (u) => tell("children", u.taskId, u.revision, u.children, u.task ? u.task.children : null),
  };
  if (tagged) client.subscribeTag("owner:u42", null, frame, options);
  else client.subscribe("batch-1", null, frame, options);
}
"""

COUNTS_3 = {"total": 3, "queued": 3, "running": 0, "succeeded": 0, "failed": 0, "expired": 0}
COUNTS_2 = {"total": 3, "queued": 1, "running": 1, "succeeded": 1, "failed": 0, "expired": 0}
COUNTS_1 = {"total": 3, "queued": 0, "running": 1, "succeeded": 1, "failed": 1, "expired": 0}


def task(
    version: int, revision: int, metadata: dict[str, Any], children: dict[str, int] | None
) -> dict[str, Any]:
    made = {
        "id": "batch-1",
        "state": "running",
        "expiresAtMs": 1_900_000_000_000,
        "attempts": 1,
        "maxAttempts": 1,
        "progress": 0,
        "version": version,
        "tags": ["owner:u42"],
        "createdAtMs": 1_800_000_000_000,
        "epoch": "0123456789ab",
        "title": "Import of 3 files",
        "metadata": metadata,
        "revision": revision,
    }
    if children is not None:
        made["children"] = children
    return made


async def told(page: Any, count: int) -> list[list[Any]]:
    await page.wait_for_function("(n) => window.told.length >= n", arg=count, timeout=5_000)
    said: list[list[Any]] = await page.evaluate("window.told.splice(0)")
    return said


async def sent(page: Any, count: int, sockets: int = 1) -> list[dict[str, Any]]:
    """What the client sent on its socket number ``sockets`` (from 1), once it has sent ``count`` messages."""
    await page.wait_for_function(
        "([n, s]) => window.sockets.length >= s && window.sockets[s - 1].sent.length >= n",
        arg=[count, sockets],
        timeout=5_000,
    )
    messages: list[dict[str, Any]] = await page.evaluate("(s) => window.sockets[s - 1].sent", sockets)
    return messages


@pytest.mark.parametrize("tagged", [False, True], ids=["task", "tag"])
async def test_the_client_keeps_the_newest_metadata_and_counts_by_revision_across_a_reconnect(
    gw: Running, page: Any, console: Console, tagged: bool
) -> None:
    await page.goto(gw.url + "/docs")  # a page of the gateway, for the module's origin
    await page.evaluate(SCRIPTED, [tagged])
    await sent(page, 1)
    if tagged:
        await page.evaluate("deliver({type: 'tag', tag: 'owner:u42', taskIds: ['batch-1'], more: false})")
        resume = {"type": "snapshot", "reason": "new", "taskId": "batch-1", "version": 1}
    else:
        resume = {"type": "caught-up", "taskId": "batch-1", "version": 1}

    # The first frame: the task's metadata and counts are told once, after the frame.
    first = task(1, 2, {"message": "Reading"}, COUNTS_3)
    await page.evaluate("(f) => deliver(f)", {**resume, "task": first})
    assert await told(page, 3) == [
        ["frame", resume["type"], 2, {"message": "Reading"}, COUNTS_3],
        ["metadata", "batch-1", 2, {"message": "Reading"}, {"message": "Reading"}],
        ["children", "batch-1", 2, COUNTS_3, COUNTS_3],
    ]

    # A metadata frame at revision 4, then an older one (3): the older is dropped, not told.
    newer = {"type": "metadata", "taskId": "batch-1", "revision": 4, "metadata": {"message": "Page 4"}}
    older = {"type": "metadata", "taskId": "batch-1", "revision": 3, "metadata": {"message": "Page 3"}}
    await page.evaluate("([a, b]) => { deliver(a); deliver(b); }", [newer, older])
    assert await told(page, 1) == [["metadata", "batch-1", 4, {"message": "Page 4"}, {"message": "Page 4"}]]

    # Counts at revision 5; then an event whose task is of revision 3 (sent before both): the task handed
    # over carries the newest metadata and counts, and nothing is told again.
    counts = {"type": "children", "taskId": "batch-1", "revision": 5, "children": COUNTS_2}
    event = {
        "type": "event",
        "taskId": "batch-1",
        "version": 2,
        "event": {"type": "progress", "atMs": 1, "progress": 10, "cursor": ""},
        "task": task(2, 3, {"message": "Page 3"}, COUNTS_3),
    }
    await page.evaluate("([a, b]) => { deliver(a); deliver(b); }", [counts, event])
    assert await told(page, 2) == [
        ["children", "batch-1", 5, COUNTS_2, COUNTS_2],
        ["frame", "event", 5, {"message": "Page 4"}, COUNTS_2],
    ]
    # The same counts again (another process's copy of the frame): nothing to tell.
    await page.evaluate("(f) => deliver(f)", counts)

    # The link drops; the client subscribes again from its cursor, and the resume frame's task (revision 7,
    # changed while it was away) is the newest: told as changes.
    await page.evaluate("drop()")
    again = await sent(page, 1, sockets=2)
    if tagged:
        assert again[0]["cursors"] == {"batch-1": "2:0123456789ab"}, again
        await page.evaluate("deliver({type: 'tag', tag: 'owner:u42', taskIds: ['batch-1'], more: false})")
    else:
        assert again[0]["cursor"] == "2:0123456789ab", again
    back = task(2, 7, {"message": "Page 9", "pages": 12}, COUNTS_1)
    resumed = {"type": "caught-up", "taskId": "batch-1", "version": 2, "task": back}
    await page.evaluate("(f) => deliver(f)", resumed)
    assert await told(page, 3) == [
        ["frame", "caught-up", 7, {"message": "Page 9", "pages": 12}, COUNTS_1],
        ["metadata", "batch-1", 7, {"message": "Page 9", "pages": 12}, {"message": "Page 9", "pages": 12}],
        ["children", "batch-1", 7, COUNTS_1, COUNTS_1],
    ]
    # A frame of before the drop, late: older than what is held.
    await page.evaluate("(f) => deliver(f)", {**newer, "revision": 6})
    held = await page.evaluate(
        "(tagged) => tagged ? client.tagTasks('owner:u42')[0] : client._subs.get('batch-1').task", tagged
    )
    assert (held["metadata"], held["children"], held["revision"]) == (back["metadata"], COUNTS_1, 7)
    assert await page.evaluate("window.told") == []
    console.assert_clean()


# A batch subscription on a scripted socket: every frame handed over and every batch frame, kept.
BATCH = """
async () => {
  const { GatewayClient } = await import("/static/gateway-client.js");
  window.sockets = [];
  class Scripted {
    constructor() {
      this.readyState = 0;
      this.sent = [];
      window.sockets.push(this);
      setTimeout(() => { this.readyState = 1; this.onopen && this.onopen(); }, 0);
    }
    send(message) { this.sent.push(JSON.parse(message)); }
    close() { this.readyState = 3; }
  }
  window.deliver = (frame) => window.sockets.at(-1).onmessage({ data: JSON.stringify(frame) });
  const client = new GatewayClient(location.origin, {
    WebSocket: Scripted, EventSource: null, storage: null, heartbeatMs: 600000, deadlineMs: 600000,
  });
  window.client = client;
  window.told = [];
  const tell = (...what) => window.told.push(what);
  client.subscribeBatch("import-7", "tok", (f, task) => tell("frame", f.type, task.id, task.title), {
    onBatch: (f) => tell("batch", f.parent, f.taskIds),
    onAdded: (f) => tell("added", f.parent, f.taskId),
    onChildren: (u) => tell("children", u.taskId, u.children.total),
    onError: (e) => tell("error", e.code),
  });
}
"""


def child(task_id: str, title: str, **fields: Any) -> dict[str, Any]:
    return {
        **task(0, 0, {}, None),
        "id": task_id,
        "title": title,
        "version": 0,
        "parent": "import-7",
        **fields,
    }


async def test_a_batch_subscription_follows_the_parent_and_its_children_with_one_token(
    gw: Running, page: Any, console: Console
) -> None:
    await page.goto(gw.url + "/docs")
    await page.evaluate(BATCH)
    assert await sent(page, 1) == [{"type": "subscribe", "parent": "import-7", "token": "tok", "cursors": {}}]
    parent = {**task(1, 1, {}, COUNTS_3), "id": "import-7"}
    frames = [
        {"type": "batch", "parent": "import-7", "taskIds": ["import-7", "f-2", "f-1"], "more": False},
        {"type": "snapshot", "reason": "new", "taskId": "import-7", "version": 1, "task": parent},
        {"type": "snapshot", "reason": "new", "taskId": "f-2", "version": 0, "task": child("f-2", "file 2")},
        {"type": "snapshot", "reason": "new", "taskId": "f-1", "version": 0, "task": child("f-1", "file 1")},
        {"type": "added", "parent": "import-7", "taskId": "f-3"},
        {"type": "snapshot", "reason": "new", "taskId": "f-3", "version": 0, "task": child("f-3", "file 3")},
        {"type": "children", "taskId": "import-7", "revision": 2, "children": {**COUNTS_3, "total": 4}},
    ]
    await page.evaluate("(frames) => frames.forEach(deliver)", frames)
    assert await told(page, 8) == [
        ["batch", "import-7", ["import-7", "f-2", "f-1"]],
        ["frame", "snapshot", "import-7", "Import of 3 files"],
        ["children", "import-7", 3],
        ["frame", "snapshot", "f-2", "file 2"],
        ["frame", "snapshot", "f-1", "file 1"],
        ["added", "import-7", "f-3"],
        ["frame", "snapshot", "f-3", "file 3"],
        ["children", "import-7", 4],
    ]
    held = await page.evaluate("client.batchTasks('import-7').map(t => t.id)")
    assert sorted(held) == ["f-1", "f-2", "f-3", "import-7"]
    # A tag's subscription of the same client is another thing: the batch's frames are not its.
    assert await page.evaluate("client.tagTasks('import-7')") == []
    await page.evaluate("client.unsubscribeBatch('import-7')")
    assert (await sent(page, 2))[1] == {"type": "unsubscribe", "parent": "import-7"}
    console.assert_clean()
