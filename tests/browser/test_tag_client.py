"""gateway-client.js's tag subscription in headless Chromium, against a scripted WebSocket: the frames a
gateway sends are played to it one by one, so that what no real gateway does on cue (an event lost in a
gap, a resume frame that overlaps what was applied, a task made anew) is checked exactly. What it sends
back (the cursors map after a drop, a resubscription after a gap, an unsubscribe) is read from the socket.

The same subscription against a real gateway, through real drops, is in test_tag_following.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.browser.conftest import Console

pytestmark = pytest.mark.anyio

TAG = "owner:u42"

# A WebSocket the test drives: `open()`, `deliver(frame)`, `drop(code)`; what the client sends is in `sent`.
SETUP = """
async () => {
  const { GatewayClient } = await import("/static/gateway-client.js");
  window.sockets = [];
  class ScriptedSocket {
    constructor(url) {
      this.url = url;
      this.readyState = 0;
      this.sent = [];
      this.onopen = this.onmessage = this.onclose = this.onerror = null;
      window.sockets.push(this);
    }
    send(data) { this.sent.push(JSON.parse(data)); }
    close() { this.readyState = 3; }
    open() { this.readyState = 1; this.onopen({}); }
    deliver(frame) { this.onmessage({ data: JSON.stringify(frame) }); }
    drop(code) { this.readyState = 3; this.onclose({ code }); }
  }
  const client = new GatewayClient(location.origin, {
    WebSocket: ScriptedSocket, EventSource: null, storage: null, backoffBaseMs: 1, backoffCapMs: 1,
    heartbeatMs: 600000, deadlineMs: 600000, probeMs: 600000, random: () => 0,
  });
  window.client = client;
  window.states = [];
  client.onState((state) => window.states.push(state));
  window.seen = [];
  window.tagFrames = [];
  window.added = [];
  window.errors = [];
  window.follow = (tag, cursors) => client.subscribeTag(tag, "tag-token", (frame, task) => {
    window.seen.push({
      id: frame.taskId, type: frame.type, version: frame.version, state: task.state,
      events: (frame.events ?? []).map((entry) => entry.version), same: frame.task === task,
    });
  }, {
    cursors,
    onTag: (frame) => window.tagFrames.push(frame),
    onAdded: (frame) => window.added.push(frame),
    onError: (error) => window.errors.push(error),
  });
  window.socket = () => window.sockets[window.sockets.length - 1];
  window.stops = {};
}
"""


def task(
    task_id: str, version: int, state: str = "running", created: int = 0, epoch: str = ""
) -> dict[str, Any]:
    made = {
        "id": task_id,
        "state": state,
        "expiresAtMs": 2_000_000_000_000,
        "attempts": 1 if state != "queued" else 0,
        "maxAttempts": 3,
        "progress": min(100, version * 10),
        "version": version,
        "tags": [TAG],
        "createdAtMs": 1_700_000_000_000 + created,
    }
    if epoch:
        made["epoch"] = epoch
    return made


CREATED = {"a": 1, "b": 2, "c": 3, "d": 4}


def snapshot(
    task_id: str, version: int, reason: str = "new", state: str = "running", epoch: str = ""
) -> dict[str, Any]:
    return {
        "type": "snapshot",
        "taskId": task_id,
        "version": version,
        "reason": reason,
        "task": task(task_id, version, state, CREATED[task_id], epoch),
    }


def event(task_id: str, version: int, state: str = "running", epoch: str = "") -> dict[str, Any]:
    progress = {
        "type": "progress",
        "atMs": 1_700_000_001_000,
        "progress": version * 10,
        "cursor": f"v{version}",
    }
    return {
        "type": "event",
        "taskId": task_id,
        "version": version,
        "event": progress,
        "task": task(task_id, version, state, CREATED[task_id], epoch),
    }


def resume(kind: str, task_id: str, version: int, events: list[int] | None = None) -> dict[str, Any]:
    frame: dict[str, Any] = {"type": kind, "taskId": task_id, "version": version}
    frame["task"] = task(task_id, version, "running", CREATED[task_id])
    if kind == "delta":
        frame["events"] = [{"version": v, "event": event(task_id, v)["event"]} for v in events or []]
    return frame


def listing(*ids: str, more: bool = False) -> dict[str, Any]:
    return {"type": "tag", "tag": TAG, "taskIds": list(ids), "more": more}


class Scripted:
    def __init__(self, page: Any) -> None:
        self.page = page

    async def run(self, script: str, arg: Any = None) -> Any:
        return await self.page.evaluate(script, arg)

    async def follow(self, tag: str = TAG, cursors: dict[str, int | str] | None = None) -> None:
        await self.run(
            "([tag, cursors]) => { window.stops[tag] = window.follow(tag, cursors ?? undefined); }",
            [tag, cursors],
        )

    async def open(self) -> None:
        await self.run("window.socket().open()")

    async def deliver(self, *frames: dict[str, Any]) -> None:
        await self.run("(frames) => frames.forEach((f) => window.socket().deliver(f))", list(frames))

    async def drop(self, code: int = 1006) -> None:
        await self.run("(code) => window.socket().drop(code)", code)

    async def sent(self) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = await self.run("window.socket().sent")
        return sent

    async def sockets(self) -> int:
        count: int = await self.run("window.sockets.length")
        return count

    async def seen(self) -> list[tuple[str, str, int]]:
        seen = await self.run("window.seen")
        return [(s["id"], s["type"], s["version"]) for s in seen]

    async def reconnected(self, count: int) -> None:
        """Wait for the client's next socket (it reconnects after its backoff, 0 ms here)."""
        await self.page.wait_for_function("(n) => window.sockets.length === n", arg=count, timeout=5_000)


@pytest.fixture
async def scripted(gw: Any, page: Any, console: Console) -> Any:
    await page.goto(gw.url + "/docs")  # a page of the gateway, for the module's origin
    await page.evaluate(SETUP)
    yield Scripted(page)
    console.assert_clean()


def subscribe_message(cursors: dict[str, int | str]) -> dict[str, Any]:
    return {"type": "subscribe", "tag": TAG, "token": "tag-token", "cursors": cursors}


async def test_a_drop_resubscribes_with_every_cursor_and_misses_nothing(scripted: Scripted) -> None:
    await scripted.follow()
    await scripted.open()
    assert await scripted.sent() == [subscribe_message({})]
    await scripted.deliver(
        listing("b", "a"),
        snapshot("b", 2),
        snapshot("a", 1, state="succeeded"),
        event("b", 3),
    )
    assert await scripted.seen() == [("b", "snapshot", 2), ("a", "snapshot", 1), ("b", "event", 3)]

    # The link drops; the new socket sends every cursor, the finished task's too. c was created meanwhile.
    await scripted.drop()
    await scripted.reconnected(2)
    await scripted.open()
    assert await scripted.sent() == [subscribe_message({"b": 3, "a": 1})]
    await scripted.deliver(
        listing("c", "b", "a"),
        snapshot("c", 0),
        resume("delta", "b", 5, [4, 5]),
        resume("caught-up", "a", 1),
        event("c", 1),
        event("b", 6),
    )
    seen = (await scripted.seen())[3:]
    assert seen == [
        ("c", "snapshot", 0),
        ("b", "delta", 5),
        ("a", "caught-up", 1),
        ("c", "event", 1),
        ("b", "event", 6),
    ]
    assert await scripted.run("client.tagCursors('owner:u42')") == {"a": 1, "b": 6, "c": 1}
    # Newest first (createdAtMs, then id), each as its last frame left it.
    tasks = await scripted.run("client.tagTasks('owner:u42').map((t) => [t.id, t.version])")
    assert tasks == [["c", 1], ["b", 6], ["a", 1]]
    frames = await scripted.run("window.tagFrames.map((f) => f.taskIds)")
    assert frames == [["b", "a"], ["c", "b", "a"]]
    assert all(s["same"] for s in await scripted.run("window.seen"))


async def test_a_gap_resubscribes_and_nothing_is_handed_twice(scripted: Scripted) -> None:
    await scripted.follow()
    await scripted.open()
    await scripted.deliver(listing("b", "a"), snapshot("b", 3), snapshot("a", 1), event("b", 4))
    # An event lost (5 missing): the client asks again with its cursors, once however many frames follow.
    await scripted.deliver(event("b", 6), event("b", 7), event("a", 2))
    sent = await scripted.sent()
    assert sent[1:] == [subscribe_message({"b": 4, "a": 1})], sent
    # Frames of the old subscription still on their way are applied when they follow on, never twice.
    await scripted.deliver(event("a", 2), event("a", 3))
    # The new subscription: a delta overlapping what was applied is cut to what is new.
    await scripted.deliver(
        listing("b", "a"), resume("delta", "b", 7, [5, 6, 7]), resume("delta", "a", 3, [2, 3])
    )
    await scripted.deliver(event("b", 7), event("b", 8))
    seen = await scripted.run("window.seen.slice(3).map((s) => [s.id, s.type, s.version, s.events])")
    assert seen == [
        ["a", "event", 2, []],
        ["a", "event", 3, []],
        ["b", "delta", 7, [5, 6, 7]],
        ["a", "delta", 3, []],
        ["b", "event", 8, []],
    ]
    assert await scripted.run("client.tagCursors('owner:u42')") == {"b": 8, "a": 3}


async def test_added_tasks_snapshots_and_forgotten_tasks(scripted: Scripted) -> None:
    await scripted.follow(TAG, {"a": 4, "gone": 9})
    await scripted.open()
    assert await scripted.sent() == [subscribe_message({"a": 4, "gone": 9})]
    # "gone" was deleted (retention): not listed, so forgotten. a's cursor is ahead of the task (made anew):
    # its snapshot, at a lower version, replaces it.
    await scripted.deliver(listing("a"), snapshot("a", 2, reason="cursor-ahead"), event("a", 3))
    # A task created with the tag: announced; events before its snapshot are not applied.
    await scripted.deliver(
        {"type": "added", "tag": TAG, "taskId": "d"},
        event("d", 1),
        snapshot("d", 1),
        event("d", 2, state="succeeded"),
    )
    assert await scripted.seen() == [
        ("a", "snapshot", 2),
        ("a", "event", 3),
        ("d", "snapshot", 1),
        ("d", "event", 2),
    ]
    assert await scripted.run("window.added.map((f) => f.taskId)") == ["d"]
    assert await scripted.run("client.tagCursors('owner:u42')") == {"a": 3, "d": 2}
    assert await scripted.run("client.tagTasks('owner:u42').map((t) => t.state)") == ["succeeded", "running"]
    # Frames of other tasks (another subscription's) are none of the tag's business.
    await scripted.deliver(snapshot("c", 1), event("c", 2))
    assert len(await scripted.seen()) == 4


async def test_cursors_carry_their_tasks_epochs_and_a_task_made_again_replaces_the_one_known(
    scripted: Scripted,
) -> None:
    """Each cursor is sent with the epoch of its task (``version:epoch``); a task made again under an id the
    client knew comes as a ``recreated`` snapshot after a reconnect, or as ``added`` then its snapshot while
    it follows: handed on, and what was held of the id replaced (the old one's events on their way are
    dropped)."""
    await scripted.follow(TAG, {"a": "4:e1"})
    await scripted.open()
    assert await scripted.sent() == [subscribe_message({"a": "4:e1"})]
    await scripted.deliver(
        listing("b", "a"),
        snapshot("b", 3, epoch="e3"),
        snapshot("a", 0, reason="recreated", epoch="e2"),
        event("a", 1, epoch="e2"),
        {"type": "added", "tag": TAG, "taskId": "b"},  # b deleted and made again while followed
        event("b", 4, epoch="e3"),
        snapshot("b", 0, epoch="e4"),
        event("b", 1, epoch="e4"),
    )
    assert await scripted.seen() == [
        ("b", "snapshot", 3),
        ("a", "snapshot", 0),
        ("a", "event", 1),
        ("b", "snapshot", 0),
        ("b", "event", 1),
    ]
    assert await scripted.run("window.added.map((f) => f.taskId)") == ["b"]
    assert await scripted.run("client.tagCursors('owner:u42')") == {"a": 1, "b": 1}
    await scripted.drop()
    await scripted.reconnected(2)
    await scripted.open()
    assert await scripted.sent() == [subscribe_message({"b": "1:e4", "a": "1:e2"})]


async def test_more_cursors_than_the_gateway_takes_are_cut_to_the_newest(scripted: Scripted) -> None:
    await scripted.follow()
    await scripted.open()
    await scripted.deliver(listing("b", "a"), snapshot("b", 1), snapshot("a", 1))
    await scripted.deliver({"type": "added", "tag": TAG, "taskId": "c"}, snapshot("c", 0))
    await scripted.drop()
    await scripted.reconnected(2)
    await scripted.open()
    # Three cursors, and the gateway takes two (it listed two, all it had then): refused, the client sends
    # the two newest; refused again, it gives up and says why.
    assert await scripted.sent() == [subscribe_message({"b": 1, "a": 1, "c": 0})]
    refusal = {"type": "error", "code": "invalid-request", "message": "cursors: at most 2", "tag": TAG}
    await scripted.deliver(refusal)
    assert (await scripted.sent())[1:] == [subscribe_message({"c": 0, "b": 1})]
    assert await scripted.run("window.errors") == []
    await scripted.deliver(refusal)
    assert await scripted.run("window.errors") == [
        {"code": "invalid-request", "message": "cursors: at most 2"}
    ]


async def test_a_refused_tag_is_not_retried_and_an_unsubscribe_is_sent(scripted: Scripted) -> None:
    await scripted.follow()
    await scripted.follow("project:7")
    await scripted.open()
    assert [m["tag"] for m in await scripted.sent()] == ["owner:u42", "project:7"]
    forbidden = {
        "type": "error",
        "code": "forbidden",
        "message": "token is for another tag",
        "tag": "project:7",
    }
    await scripted.deliver(forbidden)
    assert await scripted.run("window.errors") == [
        {"code": "forbidden", "message": "token is for another tag"}
    ]
    await scripted.drop()
    await scripted.reconnected(2)
    await scripted.open()
    assert [m["tag"] for m in await scripted.sent()] == ["owner:u42"]  # the refused tag is not asked again
    await scripted.run("window.stops['owner:u42']()")
    assert (await scripted.sent())[1:] == [{"type": "unsubscribe", "tag": "owner:u42"}]
    # Nothing left to watch: the gateway lets the socket go (4408), and the client is idle, not
    # "reconnecting" for ever, and opens no socket until the next subscription.
    await scripted.drop(4408)
    assert await scripted.run("window.client.state") == "idle"
    await scripted.follow()
    assert await scripted.sockets() == 3
    assert await scripted.run("window.states.slice(-2)") == ["idle", "connecting"]


async def test_idle_after_the_last_task_ends_and_the_gateway_closes(scripted: Scripted) -> None:
    """Every task subscription finished, the gateway closes the socket that holds none: idle."""
    await scripted.run("() => { window.client.subscribe('t1', null, () => {}); }")
    await scripted.open()
    done = task("t1", 1, "succeeded")
    await scripted.deliver({"type": "caught-up", "taskId": "t1", "version": 1, "task": done})
    await scripted.drop(4408)
    assert await scripted.run("window.client.state") == "idle"
    assert await scripted.sockets() == 1
    assert await scripted.run("window.states") == ["connected", "idle"]


async def test_the_cursors_sent_fit_the_gateways_limit_on_a_message(scripted: Scripted) -> None:
    """300 tasks known, 42-character ids: a new socket's subscribe fits in 4 KiB (the limit before a
    subscription is authorized) with the newest tasks' cursors; once the socket answered, a resubscribe (a
    gap) takes 64 KiB; a gateway that closes with 1009 (a lower limit) gets messages half as big."""
    ids = [f"nightly-export-of-the-ledger-{n:05d}-eu-west" for n in range(300)]
    assert all(len(i) == 42 for i in ids)
    created = {task_id: n for n, task_id in enumerate(ids)}
    await scripted.follow(TAG, dict.fromkeys(ids, 7))

    async def sent_bytes() -> tuple[int, list[str]]:
        last = "(() => { const s = window.socket().sent.at(-1);"
        last += " return [JSON.stringify(s), Object.keys(s.cursors)]; })()"
        raw = await scripted.run(last)
        return len(raw[0].encode()), raw[1]

    await scripted.open()
    size, first = await sent_bytes()
    assert 3_500 < size <= 4_096 and 50 < len(first) < 300, (size, len(first))
    # Known only by their cursors (no task yet): the order is by id, the newest kept.
    assert first == sorted(ids, reverse=True)[: len(first)]
    frames = [listing(*reversed(ids))]
    for task_id in reversed(ids):
        made = task(task_id, 7, created=created[task_id])
        frames.append({"type": "caught-up", "taskId": task_id, "version": 7, "task": made})
    await scripted.deliver(*frames)
    lost = {"type": "progress", "atMs": 1, "progress": 90, "cursor": ""}
    await scripted.deliver(
        {"type": "event", "taskId": ids[0], "version": 9, "event": lost, "task": task(ids[0], 9)}
    )
    size, again = await sent_bytes()
    assert len(again) == 300 and size <= 65_536, size  # all of them: the socket is authorized

    await scripted.drop(1009)
    await scripted.reconnected(2)
    await scripted.open()
    size, halved = await sent_bytes()
    assert size <= 2_048 and 0 < len(halved) < len(first), (size, len(halved))
    # The newest by creation now that the tasks are known.
    assert halved == [ids[n] for n in range(299, 299 - len(halved), -1)]
