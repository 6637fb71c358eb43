"""Layer-1 tests of the hub (``gateway.live.hub``): no socket, no database.

The store is :class:`tests.unit.fake_book.FakeBook`, an in-memory twin of the three ``Book`` reads the
``Feed`` makes (``resume``, ``get``, ``entries_between``), built with the pure machine. A :class:`Line`
"commits" an event in it and then hands the entry to ``Hub.publish``, as ``Book`` does through its
``on_commit`` (after the commit, never before), or holds the publish back, to publish it later (out of
order) or never (a lost publish). Feeds are drained with ``await feed.next()`` under ``anyio.fail_after``.

What is checked is protocol.md, WebSocket: the resume frame first, then ``event`` frames V+1, V+2, ... with
no gap, no repeat and no reordering (a ``snapshot`` with ``reason: conflated`` being the one other frame
that can follow), each ``event`` frame carrying the task after its entry; a bounded backlog per
subscription; frames encoded once per entry; control frames first and bounded; shutdown.
"""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
import orjson
import pytest

from gateway.bus.base import News
from gateway.errors import InvalidRequest, UnknownTask
from gateway.live.hub import PONG, Feed, Frame, Hub, Subscription, error_frame, event_frame
from gateway.machine import Entry, Progress, Start, Succeed, event_to_json, resume_mode, task_to_json
from tests.unit.fake_book import RETENTION, Committed, FakeBook

pytestmark = pytest.mark.anyio

TIMEOUT_S = 2.0
BACKLOG = 4

FIELDS = {
    "caught-up": {"type", "taskId", "version", "task"},
    "delta": {"type", "taskId", "version", "events", "task"},
    "snapshot": {"type", "taskId", "version", "task", "reason"},
    "event": {"type", "taskId", "version", "event", "task"},
}
RESUME_TYPES = ("caught-up", "delta", "snapshot")

Item = tuple[Subscription | None, Frame]


# --- support ------------------------------------------------------------------------------------------


class Line:
    """Commits go into the fake book; each committed entry is then published to the hub (or held back)."""

    def __init__(self, book: FakeBook, hub: Hub) -> None:
        self.book = book
        self.hub = hub

    def commit(self, task_id: str, event: Any = None, *, publish: bool = True) -> Committed:
        committed = self.book.commit(task_id, event)
        if publish:
            self.publish(committed)
        return committed

    def commit_many(self, task_id: str, n: int, *, publish: bool = True) -> list[Committed]:
        return [self.commit(task_id, publish=publish) for _ in range(n)]

    def publish(self, *committed: Committed) -> None:
        for c in committed:
            self.hub.publish(c.task, c.entry, c.encoded)


@pytest.fixture
def book() -> FakeBook:
    book = FakeBook()
    book.create("t")
    book.create("u")
    return book


@pytest.fixture
async def hub(book: FakeBook) -> AsyncIterator[Hub]:
    """A hub over the fake book, with its catch-up loop running (it fills what publishes miss)."""
    hub = Hub(book)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(hub.run)
        yield hub
        tg.cancel_scope.cancel()


@pytest.fixture
def line(book: FakeBook, hub: Hub) -> Line:
    return Line(book, hub)


async def settle() -> None:
    """Let the hub's fan-out round run: entries handed out are offered on the next turn of the loop."""
    await anyio.lowlevel.checkpoint()


async def take(feed: Feed, n: int = 1) -> list[Item]:
    """The next ``n`` items of the feed; fails if they do not come."""
    items: list[Item] = []
    with anyio.fail_after(TIMEOUT_S):
        for _ in range(n):
            item = await feed.next()
            assert item is not None, f"feed closed ({feed.close_code}) after {items}"
            items.append(item)
    return items


async def frames(feed: Feed, n: int = 1) -> list[Frame]:
    return [frame for _, frame in await take(feed, n)]


async def assert_quiet(feed: Feed, wait_s: float = 0.02) -> None:
    """Nothing more to send (the feed waits for work: cancelling that wait is harmless)."""
    with anyio.move_on_after(wait_s):
        item = await feed.next()
        pytest.fail(f"unexpected item {item!r}")


def parse(frame: Frame) -> dict[str, Any]:
    """The frame's JSON, checked against protocol.md's table of server frames."""
    body: dict[str, Any] = orjson.loads(frame.text)
    kind = body["type"]
    assert kind in FIELDS, body
    assert set(body) == FIELDS[kind], body
    assert kind == frame.type
    assert body["version"] == frame.version
    assert body["task"]["version"] == body["version"]
    assert body["task"]["id"] == body["taskId"]
    return body


def check_event(book: FakeBook, task_id: str, frame: Frame, version: int) -> dict[str, Any]:
    """An ``event`` frame at ``version``: that entry's event and the task after it."""
    body = parse(frame)
    assert body["type"] == "event", body
    assert body["taskId"] == task_id
    assert body["version"] == version, (body["version"], version)
    assert body["event"] == orjson.loads(book.entry_at(task_id, version))
    assert body["event"] == event_to_json(book.events[task_id][version - 1])
    assert body["task"] == task_to_json(book.state_at(task_id, version))
    return body


def check_resume(book: FakeBook, task_id: str, frame: Frame, cursor: int) -> int:
    """A resume frame for ``cursor``: the mode the reference chooses at its version; returns the version."""
    body = parse(frame)
    assert body["type"] in RESUME_TYPES, body
    assert body["taskId"] == task_id
    version = body["version"]
    assert body["task"] == task_to_json(book.state_at(task_id, version))
    mode, reason = resume_mode(version, cursor, RETENTION)
    assert body["type"] == mode, (body, cursor)
    assert body.get("reason") == reason, (body, cursor)
    if mode == "delta":
        assert [e["version"] for e in body["events"]] == list(range(cursor + 1, version + 1))
        for e in body["events"]:
            assert e["event"] == orjson.loads(book.entry_at(task_id, e["version"]))
    return int(version)


def check_stream(book: FakeBook, task_id: str, cursor: int, stream: list[Frame]) -> int:
    """One subscription's frames: the resume frame, then a contiguous sequence (conflated snapshots
    allowed) of exact states; returns the version the client holds at the end."""
    assert stream, "no resume frame"
    last = check_resume(book, task_id, stream[0], cursor)
    for frame in stream[1:]:
        if frame.type == "snapshot":
            body = parse(frame)
            assert body["reason"] == "conflated", body
            assert body["version"] > last, (body["version"], last)
            assert body["task"] == task_to_json(book.state_at(task_id, body["version"]))
            last = body["version"]
        else:
            check_event(book, task_id, frame, last + 1)
            last += 1
    return last


def gate(book: FakeBook, point: str) -> tuple[anyio.Event, anyio.Event]:
    """Make the fake book stop at ``point`` until the test releases it: returns (reached, release)."""
    reached, release = anyio.Event(), anyio.Event()

    async def hook() -> None:
        reached.set()
        await release.wait()

    book.hooks[point] = hook
    return reached, release


# --- resume frame first, then the live entries ------------------------------------------------------


@pytest.mark.parametrize(
    ("history", "cursor", "mode", "reason"),
    [
        (0, 0, "caught-up", None),
        (20, 20, "caught-up", None),
        (20, 19, "delta", None),
        (20, 15, "delta", None),
        (20, 20 - RETENTION, "delta", None),
        (20, 20 - RETENTION - 1, "snapshot", "retention"),
        (20, 0, "snapshot", "retention"),
        (5, 0, "delta", None),
        (20, 21, "snapshot", "cursor-ahead"),
        (0, 7, "snapshot", "cursor-ahead"),
    ],
)
async def test_resume_frame_first_then_the_following_events_in_order(
    book: FakeBook, hub: Hub, line: Line, history: int, cursor: int, mode: str, reason: str | None
) -> None:
    line.commit_many("t", history)
    feed = Feed(hub, book, backlog=BACKLOG)  # type: ignore[arg-type]
    sub = await feed.subscribe("t", cursor)
    assert feed.subscriptions == {"t": sub}

    ((got_sub, resume),) = await take(feed)
    assert got_sub is sub
    body = parse(resume)
    assert (body["type"], body.get("reason")) == (mode, reason)
    assert body["version"] == history
    assert check_resume(book, "t", resume, cursor) == history
    if mode == "delta":
        assert body["events"] == [
            {"version": v, "event": event_to_json(book.events["t"][v - 1])}
            for v in range(cursor + 1, history + 1)
        ]

    line.commit_many("t", 3)
    line.commit_many("u", 2)  # another task's entries reach no one here
    got = await take(feed, 3)
    assert all(s is sub for s, _ in got)
    for i, (_, frame) in enumerate(got, start=1):
        check_event(book, "t", frame, history + i)
    assert sub.last == book.current("t")
    await assert_quiet(feed)


async def test_event_frame_text_is_the_protocol_shape(book: FakeBook, hub: Hub, line: Line) -> None:
    line.commit("t", Start(1_500, "w1"))
    feed = Feed(hub, book)  # type: ignore[arg-type]
    await feed.subscribe("t", 1)
    await take(feed)
    line.commit("t", Progress(1_600.5, 40, "c1"))
    line.commit("t", Succeed(1_700, "ref", "hash"))
    first, second = await frames(feed, 2)
    assert orjson.loads(first.text) == {
        "type": "event",
        "taskId": "t",
        "version": 2,
        "event": {"type": "progress", "atMs": 1_600.5, "progress": 40, "cursor": "c1"},
        "task": task_to_json(book.state_at("t", 2)),
    }
    body = check_event(book, "t", second, 3)
    assert body["task"]["state"] == "succeeded"
    assert body["task"]["resultRef"] == "ref"


async def test_unknown_task_or_bad_cursor_leaves_nothing_subscribed(book: FakeBook, hub: Hub) -> None:
    feed = Feed(hub, book)  # type: ignore[arg-type]
    with pytest.raises(UnknownTask):
        await feed.subscribe("nope", 0)
    with pytest.raises(InvalidRequest):
        await feed.subscribe("t", -1)
    assert feed.subscriptions == {}
    assert hub.stats()["subscriptions"] == 0
    await assert_quiet(feed)


# --- entries committed while the resume state is read ------------------------------------------------


@pytest.mark.parametrize("point", ["resume", "resume:task-read"], ids=["before-read", "after-task-read"])
@pytest.mark.parametrize("cursor", [0, 5, 10, 12], ids=["retention", "delta", "caught-up", "ahead"])
async def test_entries_committed_while_the_resume_state_is_read_no_gap_no_repeat(
    book: FakeBook, hub: Hub, line: Line, point: str, cursor: int
) -> None:
    line.commit_many("t", 10)
    feed = Feed(hub, book)  # type: ignore[arg-type]
    reached, release = gate(book, point)
    subscribed: list[Subscription] = []

    async def subscribe() -> None:
        subscribed.append(await feed.subscribe("t", cursor))

    async with anyio.create_task_group() as tg:
        tg.start_soon(subscribe)
        with anyio.fail_after(TIMEOUT_S):
            await reached.wait()
        # Three entries while the state is read: published at once, one held back, one published later.
        line.commit("t")  # 11
        held = line.commit("t", publish=False)  # 12
        line.commit("t")  # 13
        await settle()
        # Live entries collect from the start: 11 in the backlog; 13 waits in the task's channel for 12.
        assert hub.stats()["pending_max"] == 1
        release.set()
    line.publish(held)
    line.commit_many("t", 2)  # 14, 15

    sub = subscribed[0]
    stream = [f for s, f in await take(feed, 1)]
    resumed_at = check_resume(book, "t", stream[0], cursor)
    # Before the task is read: the resume frame covers the entries; after it: they follow it.
    assert resumed_at == (13 if point == "resume" else 10)
    stream += await frames(feed, 15 - resumed_at)
    assert check_stream(book, "t", cursor, stream) == 15
    assert [f.version for f in stream[1:]] == list(range(resumed_at + 1, 16))
    assert sub.last == book.current("t")
    await assert_quiet(feed)


# --- publishes out of order, publishes lost -------------------------------------------------------------


async def test_publishes_out_of_order_are_sent_in_order(book: FakeBook, hub: Hub, line: Line) -> None:
    line.commit_many("t", 3)
    feed = Feed(hub, book)  # type: ignore[arg-type]
    await feed.subscribe("t", 3)
    await take(feed)
    c4, c5, c6 = line.commit_many("t", 3, publish=False)
    line.publish(c6, c5, c4)  # v+3 and v+2 before v+1
    got = await frames(feed, 3)
    for frame, version in zip(got, (4, 5, 6), strict=True):
        check_event(book, "t", frame, version)
    # The later ones waited in the task's channel for the first: at most one read of the store.
    assert len([call for call in book.calls if call[0] == "entries"]) <= 1
    await assert_quiet(feed)


@pytest.mark.parametrize("subscribers", [1, 20])
async def test_a_lost_publish_costs_one_store_read_per_task_whatever_the_subscribers(
    book: FakeBook, hub: Hub, line: Line, subscribers: int
) -> None:
    """The bus lost entry 2 (a Redis hiccup, a listener reconnecting): the hub reads it once for the task,
    not once per subscriber, and every subscriber gets 1, 2, 3 in order."""
    feeds = [Feed(hub, book) for _ in range(subscribers)]  # type: ignore[arg-type]
    for feed in feeds:
        await feed.subscribe("t", 0)
        await take(feed)
    line.commit("t")
    line.commit("t", publish=False)
    line.commit("t")
    for feed in feeds:
        got = await frames(feed, 2 + 1)
        assert [f.version for f in got] == [1, 2, 3]
        for frame, version in zip(got, (1, 2, 3), strict=True):
            check_event(book, "t", frame, version)
    assert [call[:3] for call in book.calls if call[0] == "entries"] == [("entries", "t", 1)]
    for feed in feeds:
        await assert_quiet(feed)


async def test_a_later_entry_published_first_is_still_sent_live(book: FakeBook, hub: Hub, line: Line) -> None:
    feed = Feed(hub, book)  # type: ignore[arg-type]
    await feed.subscribe("t", 0)
    await take(feed)
    c1, c2 = line.commit_many("t", 2, publish=False)
    line.publish(c2)
    filled, live = await frames(feed, 2)
    check_event(book, "t", filled, 1)
    check_event(book, "t", live, 2)
    assert live.text == event_frame(c2.task, c2.encoded).text
    line.publish(c1)  # already sent: dropped
    await assert_quiet(feed)


@pytest.mark.parametrize("lost", [[1], [1, 2, 3, 4], [2, 4, 5], [1, 3, 6, 7, 8]])
async def test_lost_publishes_are_filled_from_the_store(
    book: FakeBook, hub: Hub, line: Line, lost: list[int]
) -> None:
    feed = Feed(hub, book)  # type: ignore[arg-type]
    await feed.subscribe("t", 0)
    stream = await frames(feed)
    for version in range(1, 10):
        line.commit("t", publish=version not in lost)
    stream += await frames(feed, 9)
    assert check_stream(book, "t", 0, stream) == 9
    assert [f.type for f in stream] == ["caught-up"] + ["event"] * 9
    await assert_quiet(feed)


async def test_a_resync_finds_a_lost_tail_that_no_later_entry_reveals(
    book: FakeBook, hub: Hub, line: Line
) -> None:
    """The bus lost the last entries of two tasks (its listener was reconnecting): nothing later comes to
    reveal the gap, so the resync the bus asks for on reconnect must find them: one query for the versions
    of every task, then one read per task that is behind."""
    feeds = {task_id: Feed(hub, book) for task_id in ("t", "u")}  # type: ignore[arg-type]
    for task_id, feed in feeds.items():
        line.commit(task_id)
        await feed.subscribe(task_id, 1)
        await take(feed)
    line.commit_many("t", 3, publish=False)  # 2..4 lost
    line.commit("u", publish=False)  # 2 lost
    await assert_quiet(feeds["t"])
    book.calls.clear()
    hub.resync()
    for task_id, last in (("t", 4), ("u", 2)):
        got = await frames(feeds[task_id], last - 1)
        assert [f.version for f in got] == list(range(2, last + 1))
        for frame in got:
            check_event(book, task_id, frame, frame.version)
    assert [c[0] for c in book.calls].count("versions") == 1
    assert sorted(c[1] for c in book.calls if c[0] == "entries") == ["t", "u"]
    for feed in feeds.values():
        await assert_quiet(feed)


async def test_a_later_resume_read_does_not_hide_an_entry_from_an_earlier_one(
    book: FakeBook, hub: Hub, line: Line
) -> None:
    """Two connections subscribe to a task no one here watched: B reads v3, then v4 is committed, A reads
    v4, and only then is v4 published. The channel must not take A's newer state as where everyone
    stands: B would drop nothing and never get v4 (it is terminal: nothing later would reveal the gap)."""
    line.commit_many("t", 3)
    reached, release = gate(book, "resume:task-read")
    first, second = Feed(hub, book), Feed(hub, book)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(first.subscribe, "t", 3)
        with anyio.fail_after(TIMEOUT_S):
            await reached.wait()  # B has read v3
        book.hooks.clear()
        last = line.commit("t", Succeed(2_000, "s3://r", "sha256:1"), publish=False)  # v4
        await second.subscribe("t", 3)  # A reads v4
        line.publish(last)
        release.set()
    b_frames = await frames(first, 2)
    assert [(f.type, f.version) for f in b_frames] == [("caught-up", 3), ("event", 4)]
    check_event(book, "t", b_frames[1], 4)
    assert [(f.type, f.version) for f in await frames(second)] == [("delta", 4)]
    await assert_quiet(first)
    await assert_quiet(second)


async def test_a_bare_wake_up_is_handed_out_when_a_resume_lands_during_its_read(
    book: FakeBook, hub: Hub, line: Line
) -> None:
    """A message too big for the bus arrives as id and version only, while the one subscription's resume
    read (v3) is in flight; the hub reads v4 from the store and, meanwhile, the resume completes. v4 must
    still be handed out at once, not left for the next periodic check."""
    line.commit_many("t", 3)
    resumed, resume_release = gate(book, "resume:task-read")
    feed = Feed(hub, book)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(feed.subscribe, "t", 3)
        with anyio.fail_after(TIMEOUT_S):
            await resumed.wait()
        reading, read_release = gate(book, "entries")
        line.commit("t", Succeed(2_000, "s3://r", "sha256:1"), publish=False)
        hub.receive(News("t", 4))  # a bare wake-up
        with anyio.fail_after(TIMEOUT_S):
            await reading.wait()  # the hub has read the task; its entry is next
        resume_release.set()
    read_release.set()
    got = await frames(feed, 2)
    assert [(f.type, f.version) for f in got] == [("caught-up", 3), ("event", 4)]
    check_event(book, "t", got[1], 4)
    await assert_quiet(feed)


async def test_gap_filled_while_more_entries_arrive(book: FakeBook, hub: Hub, line: Line) -> None:
    """Entries published while the gap is being read from the store go after the filled ones."""
    feed = Feed(hub, book)  # type: ignore[arg-type]
    await feed.subscribe("t", 0)
    stream = await frames(feed)
    reached, release = gate(book, "entries")
    line.commit_many("t", 2, publish=False)
    line.commit("t")  # 3: a gap of 1..2
    got: list[Frame] = []
    async with anyio.create_task_group() as tg:

        async def drain() -> None:
            got.extend(await frames(feed, 6))

        tg.start_soon(drain)
        with anyio.fail_after(TIMEOUT_S):
            await reached.wait()
        c4 = line.commit("t", publish=False)
        line.commit("t")  # 5 is published while 1..2 are read, 4 after it
        line.publish(c4)
        line.commit("t")  # 6
        book.hooks.clear()
        release.set()
    assert check_stream(book, "t", 0, stream + got) == 6
    assert [f.version for f in got] == [1, 2, 3, 4, 5, 6]


# --- conflation: a bounded backlog -------------------------------------------------------------------


@pytest.mark.parametrize("extra", [1, 2, 15])
async def test_a_backlog_past_its_bound_collapses_into_one_conflated_snapshot(
    book: FakeBook, hub: Hub, line: Line, extra: int
) -> None:
    line.commit_many("t", 2)
    feed = Feed(hub, book, backlog=BACKLOG)  # type: ignore[arg-type]
    await feed.subscribe("t", 2)
    stream = await frames(feed)
    for _ in range(BACKLOG + extra):
        line.commit("t")
        await settle()
        assert hub.stats()["pending_max"] <= BACKLOG
    assert hub.stats()["conflations"] == 1
    newest = book.current("t").version
    assert newest == 2 + BACKLOG + extra

    (snapshot,) = await frames(feed)
    body = parse(snapshot)
    assert (body["type"], body["reason"], body["version"]) == ("snapshot", "conflated", newest)
    assert body["task"] == task_to_json(book.current("t"))
    await assert_quiet(feed)

    line.commit_many("t", 2)
    stream += [snapshot, *await frames(feed, 2)]
    assert check_stream(book, "t", 2, stream) == newest + 2
    assert [f.version for f in stream[-2:]] == [newest + 1, newest + 2]
    await assert_quiet(feed)


async def test_a_backlog_at_its_bound_is_not_conflated(book: FakeBook, hub: Hub, line: Line) -> None:
    feed = Feed(hub, book, backlog=BACKLOG)  # type: ignore[arg-type]
    await feed.subscribe("t", 0)
    stream = await frames(feed)
    line.commit_many("t", BACKLOG)
    await settle()
    assert hub.stats()["pending_max"] == BACKLOG
    stream += await frames(feed, BACKLOG)
    assert hub.stats()["conflations"] == 0
    assert check_stream(book, "t", 0, stream) == BACKLOG
    assert all(f.type == "event" for f in stream[1:])


async def test_conflated_snapshot_covers_entries_committed_but_not_yet_published(
    book: FakeBook, hub: Hub, line: Line
) -> None:
    feed = Feed(hub, book, backlog=BACKLOG)  # type: ignore[arg-type]
    await feed.subscribe("t", 0)
    stream = await frames(feed)
    line.commit_many("t", BACKLOG + 1)  # 1..5: conflated
    late = line.commit_many("t", 2, publish=False)  # 6, 7: in the store, published after the snapshot
    (snapshot,) = await frames(feed)
    assert snapshot.version == 7
    line.publish(*reversed(late))
    await assert_quiet(feed)
    line.commit("t")
    stream += [snapshot, *await frames(feed)]
    assert check_stream(book, "t", 0, stream) == 8


@pytest.mark.parametrize("point", ["resume", "resume:task-read"], ids=["before-read", "after-task-read"])
async def test_conflation_while_the_resume_state_is_read(
    book: FakeBook, hub: Hub, line: Line, point: str
) -> None:
    feed = Feed(hub, book, backlog=BACKLOG)  # type: ignore[arg-type]
    reached, release = gate(book, point)
    async with anyio.create_task_group() as tg:
        tg.start_soon(feed.subscribe, "t", 0)
        with anyio.fail_after(TIMEOUT_S):
            await reached.wait()
        line.commit_many("t", BACKLOG + 3)
        assert hub.stats()["pending_max"] <= BACKLOG
        release.set()
    book.hooks.clear()
    stream = await frames(feed)
    if point == "resume":  # the resume frame is already at the newest version: no snapshot after it
        assert check_resume(book, "t", stream[0], 0) == BACKLOG + 3
    else:
        assert check_resume(book, "t", stream[0], 0) == 0
        stream += await frames(feed)
        assert (stream[1].type, stream[1].version) == ("snapshot", BACKLOG + 3)
    await assert_quiet(feed)
    line.commit("t")
    stream += await frames(feed)
    assert check_stream(book, "t", 0, stream) == BACKLOG + 4


async def test_a_slow_subscriber_does_not_hold_back_a_fast_one(book: FakeBook, hub: Hub, line: Line) -> None:
    slow = Feed(hub, book, backlog=BACKLOG)  # type: ignore[arg-type]
    fast = Feed(hub, book, backlog=BACKLOG)  # type: ignore[arg-type]
    await slow.subscribe("t", 0)
    await fast.subscribe("t", 0)
    fast_stream = await frames(fast)
    for _ in range(5 * BACKLOG):
        line.commit("t")
        fast_stream += await frames(fast)
        assert hub.stats()["pending_max"] <= BACKLOG
    assert check_stream(book, "t", 0, fast_stream) == 5 * BACKLOG
    assert all(f.type == "event" for f in fast_stream[1:])
    slow_stream = await frames(slow, 2)
    assert [f.type for f in slow_stream] == ["caught-up", "snapshot"]
    assert check_stream(book, "t", 0, slow_stream) == 5 * BACKLOG
    await assert_quiet(slow)


# --- one encoding per entry -------------------------------------------------------------------------------


async def test_a_frame_is_encoded_once_per_entry(book: FakeBook, hub: Hub, line: Line) -> None:
    feeds = [Feed(hub, book) for _ in range(3)]  # type: ignore[arg-type]
    for feed in feeds:
        await feed.subscribe("t", 0)
        await take(feed)
    committed = line.commit("t")
    sent = [(await frames(feed))[0] for feed in feeds]
    assert sent[0] is sent[1] is sent[2]
    check_event(book, "t", sent[0], 1)
    assert sent[0].text == event_frame(committed.task, committed.encoded).text


# --- subscriptions come and go ------------------------------------------------------------------------------


async def test_unsubscribe_and_release_remove_subscriptions(book: FakeBook, hub: Hub, line: Line) -> None:
    feed = Feed(hub, book)  # type: ignore[arg-type]
    other = Feed(hub, book)  # type: ignore[arg-type]
    assert hub.stats()["connections"] == 2
    await feed.subscribe("t", 0)
    u = await feed.subscribe("u", 0)
    await other.subscribe("t", 0)
    assert hub.stats()["subscriptions"] == 3

    line.commit("t")  # queued for feed, never sent: unsubscribed below
    feed.unsubscribe("t")
    assert hub.stats()["subscriptions"] == 2
    assert set(feed.subscriptions) == {"u"}
    got = await take(feed)
    assert got[0][0] is u
    line.commit("t")
    await assert_quiet(feed)
    assert [f.version for f in await frames(other, 3)] == [0, 1, 2]

    feed.release()
    assert feed.subscriptions == {}
    assert hub.stats()["connections"] == 1
    assert hub.stats()["subscriptions"] == 1
    other.release()
    assert hub.stats()["subscriptions"] == 0
    assert hub.stats()["connections"] == 0
    with anyio.fail_after(TIMEOUT_S):
        await hub.idle()
    line.commit("t")  # nobody listens: nothing to do
    assert hub.stats()["pending_total"] == 0


async def test_subscribing_again_replaces_the_subscription(book: FakeBook, hub: Hub, line: Line) -> None:
    line.commit_many("t", 3)
    feed = Feed(hub, book)  # type: ignore[arg-type]
    first = await feed.subscribe("t", 0)
    line.commit("t")  # queued behind the first subscription's resume frame
    second = await feed.subscribe("t", 4)
    assert first.active is False
    assert hub.stats()["subscriptions"] == 1
    assert feed.subscriptions == {"t": second}
    line.commit("t")
    got = await take(feed, 2)
    assert all(s is second for s, _ in got)
    assert check_stream(book, "t", 4, [f for _, f in got]) == 5
    await assert_quiet(feed)


async def test_at_most_max_subscriptions_per_connection(book: FakeBook, hub: Hub) -> None:
    feed = Feed(hub, book, max_subscriptions=1)  # type: ignore[arg-type]
    await feed.subscribe("t", 0)
    with pytest.raises(InvalidRequest):
        await feed.subscribe("u", 0)
    await feed.subscribe("t", 0)  # the same task again replaces it
    assert hub.stats()["subscriptions"] == 1


async def test_subscriptions_of_one_connection_take_turns(book: FakeBook, hub: Hub, line: Line) -> None:
    feed = Feed(hub, book)  # type: ignore[arg-type]
    t = await feed.subscribe("t", 0)
    u = await feed.subscribe("u", 0)
    line.commit_many("t", 3)
    line.commit_many("u", 3)
    got = await take(feed, 8)
    order = [s for s, _ in got]
    assert order == [t, u] * 4
    assert check_stream(book, "t", 0, [f for s, f in got if s is t]) == 3
    assert check_stream(book, "u", 0, [f for s, f in got if s is u]) == 3


async def test_unsubscribe_while_the_resume_state_is_read_cancels_the_subscription(
    book: FakeBook, hub: Hub, line: Line
) -> None:
    feed = Feed(hub, book)  # type: ignore[arg-type]
    reached, release = gate(book, "resume")
    async with anyio.create_task_group() as tg:
        tg.start_soon(feed.subscribe, "t", 0)
        with anyio.fail_after(TIMEOUT_S):
            await reached.wait()
        feed.unsubscribe("t")
        release.set()
    line.commit("t")
    assert feed.subscriptions == {}
    assert hub.stats()["subscriptions"] == 0
    await assert_quiet(feed)


async def test_release_while_the_resume_state_is_read_leaves_nothing_in_the_hub(
    book: FakeBook, hub: Hub, line: Line
) -> None:
    feed = Feed(hub, book, backlog=BACKLOG)  # type: ignore[arg-type]
    reached, release = gate(book, "resume")
    async with anyio.create_task_group() as tg:
        tg.start_soon(feed.subscribe, "t", 0)
        with anyio.fail_after(TIMEOUT_S):
            await reached.wait()
        feed.release()
        release.set()
    line.commit_many("t", 2)
    assert hub.stats()["connections"] == 0
    assert hub.stats()["subscriptions"] == 0
    assert hub.stats()["pending_total"] == 0


async def test_a_failed_resume_read_leaves_nothing_subscribed(book: FakeBook, hub: Hub, line: Line) -> None:
    feed = Feed(hub, book)  # type: ignore[arg-type]
    reached, release = gate(book, "resume")

    async def subscribe_and_fail() -> None:
        with pytest.raises(UnknownTask):
            await feed.subscribe("t", 0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(subscribe_and_fail)
        with anyio.fail_after(TIMEOUT_S):
            await reached.wait()
        line.commit("t")
        del book.states["t"]  # the task is gone when the read goes on
        release.set()
    assert hub.stats()["subscriptions"] == 0
    assert feed.subscriptions == {}


async def test_a_cancelled_subscribe_leaves_nothing_subscribed(book: FakeBook, hub: Hub) -> None:
    feed = Feed(hub, book)  # type: ignore[arg-type]
    reached, _ = gate(book, "resume")
    async with anyio.create_task_group() as tg:
        tg.start_soon(feed.subscribe, "t", 0)
        with anyio.fail_after(TIMEOUT_S):
            await reached.wait()
        assert hub.stats()["subscriptions"] == 1
        tg.cancel_scope.cancel()
    assert hub.stats()["subscriptions"] == 0
    assert feed.subscriptions == {}


# --- shutdown and control frames ------------------------------------------------------------------------


@pytest.mark.parametrize("waiting", [False, True], ids=["with-frames-queued", "waiting-for-frames"])
async def test_shutdown_ends_every_feed_with_its_code(
    book: FakeBook, hub: Hub, line: Line, waiting: bool
) -> None:
    feeds = [Feed(hub, book) for _ in range(2)]  # type: ignore[arg-type]
    for feed in feeds:
        await feed.subscribe("t", 0)
        if waiting:
            await take(feed)
    if not waiting:
        line.commit("t")
        feeds[0].send_control(PONG)
    results: list[object] = []
    async with anyio.create_task_group() as tg:
        if waiting:

            async def wait_next(feed: Feed) -> None:
                results.append(await feed.next())

            for feed in feeds:
                tg.start_soon(wait_next, feed)
            await anyio.wait_all_tasks_blocked()
        hub.shutdown(1001)
    with anyio.fail_after(TIMEOUT_S):
        results += [await feed.next() for feed in feeds]
    assert results == [None] * len(results)
    assert [feed.close_code for feed in feeds] == [1001, 1001]
    hub.shutdown(4000)
    assert [feed.close_code for feed in feeds] == [1001, 1001]  # the first close code stays


async def test_close_code_set_first_is_kept(book: FakeBook, hub: Hub) -> None:
    feed = Feed(hub, book)  # type: ignore[arg-type]
    feed.close(4008)
    hub.shutdown(1001)
    with anyio.fail_after(TIMEOUT_S):
        assert await feed.next() is None
    assert feed.close_code == 4008


async def test_control_frames_follow_what_was_queued_before_them_and_are_bounded(
    book: FakeBook, hub: Hub, line: Line
) -> None:
    feed = Feed(hub, book, max_control=3)  # type: ignore[arg-type]
    sub = await feed.subscribe("t", 0)  # its resume frame is queued: a pong must not overtake it
    line.commit_many("t", 2)
    error = error_frame("invalid-request", "no", "t")
    assert feed.send_control(PONG)
    assert feed.send_control(error)
    assert feed.send_control(PONG)
    assert not feed.send_control(PONG)  # past max_control: the reader waits for room
    assert hub.stats()["control_max"] == 3
    room = anyio.Event()

    async def wait_for_room() -> None:
        await feed.control_room()
        room.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_for_room)
        await anyio.wait_all_tasks_blocked()
        assert not room.is_set()
        got = await take(feed, 4)
        with anyio.fail_after(TIMEOUT_S):
            await room.wait()
    assert got[0][0] is sub and got[0][1].type == "caught-up"
    resume = got[0][1]
    assert got[1:] == [(None, PONG), (None, error), (None, PONG)]
    assert hub.stats()["control_max"] == 0
    assert feed.send_control(PONG)
    got = await take(feed, 2)
    assert got[0][0] is sub
    assert got[1] == (None, PONG)
    assert orjson.loads(error.text) == {
        "type": "error",
        "code": "invalid-request",
        "message": "no",
        "taskId": "t",
    }
    stream = [resume, got[0][1], *await frames(feed, 1)]
    assert check_stream(book, "t", 0, stream) == 2


async def test_the_watchdog_stalls_only_a_feed_stuck_in_one_send(book: FakeBook, hub: Hub) -> None:
    stuck, writing, idle = (Feed(hub, book) for _ in range(3))  # type: ignore[arg-type]
    stalled: list[str] = []
    done = anyio.Event()

    def on_stall(name: str) -> Callable[[], None]:
        def stall() -> None:
            stalled.append(name)
            done.set()

        return stall

    stuck.on_stall, writing.on_stall, idle.on_stall = on_stall("stuck"), on_stall("writing"), on_stall("idle")
    stuck.writing_since = time.monotonic() - 10  # one send for 10 s
    writing.writing_since = time.monotonic() + 60  # a send that has just begun
    async with anyio.create_task_group() as tg:
        tg.start_soon(hub.watch_writes, 0.2)
        with anyio.fail_after(TIMEOUT_S):
            await done.wait()
        tg.cancel_scope.cancel()
    assert stalled == ["stuck"]
    assert stuck.writing_since is None


# --- property: random interleavings ----------------------------------------------------------------------


class Credit:
    """How many frames a consumer may take: a slow reader gets a few now and then, at the end all."""

    def __init__(self) -> None:
        self.n = 0
        self.unlimited = False
        self._changed = anyio.Event()

    def grant(self, n: int) -> None:
        self.n += n
        self._changed.set()

    def open(self) -> None:
        self.unlimited = True
        self._changed.set()

    async def take(self) -> None:
        while not self.unlimited and self.n == 0:
            self._changed = anyio.Event()
            await self._changed.wait()
        if not self.unlimited:
            self.n -= 1


class Signal:
    """Something happened (a frame was taken): waiters look again."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def set(self) -> None:
        self._event.set()

    def clear(self) -> None:
        self._event = anyio.Event()

    async def wait(self) -> None:
        await self._event.wait()


@dataclass
class Client:
    """One connection: a feed, its reader (subscribe/unsubscribe, one at a time, as the socket's reader
    task does) and its writer (``feed.next()``), with what it was sent."""

    feed: Feed
    took: Signal
    credit: Credit = field(default_factory=Credit)
    sent: list[Item] = field(default_factory=list)
    opened: dict[Subscription, tuple[str, int]] = field(default_factory=dict)
    commands: list[tuple[str, str, int]] = field(default_factory=list)
    wakeup: anyio.Event = field(default_factory=anyio.Event)
    done: bool = False  # no more commands: the reader ends once it has read them all
    read_all: anyio.Event = field(default_factory=anyio.Event)

    def command(self, kind: str, task_id: str, cursor: int = 0) -> None:
        self.commands.append((kind, task_id, cursor))
        self.wakeup.set()

    async def read(self) -> None:
        while True:
            while not self.commands:
                if self.done:
                    self.read_all.set()
                    return
                self.wakeup = anyio.Event()
                await self.wakeup.wait()
            kind, task_id, cursor = self.commands.pop(0)
            if kind == "unsubscribe":
                self.feed.unsubscribe(task_id)
                continue
            try:
                sub = await self.feed.subscribe(task_id, cursor)
            except InvalidRequest:
                assert cursor < 0
                assert task_id not in self.feed.subscriptions
                continue
            self.opened[sub] = (task_id, cursor)

    async def write(self) -> None:
        while True:
            await self.credit.take()
            item = await self.feed.next()
            if item is None:
                return
            self.sent.append(item)
            self.took.set()


async def run_interleaving(seed: int) -> None:
    rng = random.Random(seed)
    book = FakeBook(rng=rng)
    hub = Hub(book)  # type: ignore[arg-type]
    line = Line(book, hub)
    task_ids = ["a", "b", "c"][: rng.randint(1, 3)]
    for task_id in task_ids:
        book.create(task_id)
        for _ in range(rng.randint(0, 12)):
            if not book.current(task_id).terminal:
                line.commit(task_id)
    backlog = rng.randint(1, 6)
    held: list[Committed] = []  # committed, not yet published
    clients: list[Client] = []
    took = Signal()
    steps = rng.randint(10, 120)

    def pick_cursor(task_id: str) -> int:
        version = book.current(task_id).version
        return rng.choice(
            [
                0,
                version,
                max(0, version - rng.randint(1, 12)),
                version + rng.randint(1, 3),
                -1 if rng.random() < 0.1 else 0,
            ]
        )

    async def pause() -> None:
        for _ in range(rng.randint(0, 3)):
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg, anyio.create_task_group() as catching_up:
        catching_up.start_soon(hub.run)

        def connect() -> Client:
            client = Client(Feed(hub, book, backlog=backlog), took)  # type: ignore[arg-type]
            clients.append(client)
            tg.start_soon(client.read)
            tg.start_soon(client.write)
            return client

        for _ in range(steps):
            action = rng.choices(
                ["commit", "publish", "lose", "duplicate", "subscribe", "unsubscribe", "drain", "pause"],
                weights=[30, 20, 4, 2, 8, 2, 15, 10],
            )[0]
            if action == "commit":
                live = [t for t in task_ids if not book.current(t).terminal]
                if live:
                    committed = line.commit(rng.choice(live), publish=False)
                    if rng.random() < 0.6:
                        line.publish(committed)
                    else:
                        held.append(committed)
            elif action == "publish" and held:
                line.publish(held.pop(rng.randrange(len(held))))  # any held entry: out of order
            elif action == "lose" and held:
                # Lose a publish, never the newest entry of its task: a later one will be published.
                c = held[rng.randrange(len(held))]
                if c.version < book.current(c.task.id).version:
                    held.remove(c)
            elif action == "duplicate":
                task_id = rng.choice(task_ids)
                version = book.current(task_id).version
                if version > 0:
                    v = rng.randint(1, version)
                    if not any(c.task.id == task_id and c.version == v for c in held):
                        hub.publish(
                            book.state_at(task_id, v), _entry(book, task_id, v), book.entry_at(task_id, v)
                        )
            elif action == "subscribe":
                client = rng.choice(clients) if clients and rng.random() < 0.5 else connect()
                task_id = rng.choice(task_ids)
                client.command("subscribe", task_id, pick_cursor(task_id))
            elif action == "unsubscribe" and clients:
                rng.choice(clients).command("unsubscribe", rng.choice(task_ids))
            elif action == "drain" and clients:
                rng.choice(clients).credit.grant(rng.randint(1, 2 * backlog + 2))
            assert hub.stats()["pending_max"] <= backlog
            await pause()

        # The end: every command read, every held publish made (in random order), every client drained.
        with anyio.fail_after(TIMEOUT_S):
            for client in clients:
                client.done = True
                client.wakeup.set()
            for client in clients:
                await client.read_all.wait()
            rng.shuffle(held)
            for committed in held:
                line.publish(committed)
                await pause()
            for client in clients:
                client.credit.open()
            while True:
                took.clear()
                if all(_caught_up(book, client) for client in clients):
                    break
                await took.wait()
        assert hub.stats()["pending_max"] <= backlog
        hub.shutdown(1001)
        catching_up.cancel_scope.cancel()

    for client in clients:
        streams: dict[Subscription, list[Frame]] = {}
        for sub, frame in client.sent:
            assert sub is not None
            streams.setdefault(sub, []).append(frame)
        assert set(streams) <= set(client.opened)
        for sub, (task_id, cursor) in client.opened.items():
            stream = streams.get(sub, [])
            if client.feed.subscriptions.get(task_id) is sub:
                assert check_stream(book, task_id, cursor, stream) == book.current(task_id).version
            elif stream:  # unsubscribed or replaced: what it was sent is still a valid beginning
                check_stream(book, task_id, cursor, stream)
        client.feed.release()
    assert hub.stats()["subscriptions"] == 0
    assert hub.stats()["connections"] == 0


def _entry(book: FakeBook, task_id: str, version: int) -> Entry:
    return Entry(version, book.events[task_id][version - 1])


def _caught_up(book: FakeBook, client: Client) -> bool:
    last: dict[Subscription, int] = {}
    for sub, frame in client.sent:
        if sub is not None:
            last[sub] = frame.version
    return all(
        last.get(sub) == book.current(task_id).version for task_id, sub in client.feed.subscriptions.items()
    )


@pytest.mark.parametrize("batch", range(10))
async def test_random_interleavings_keep_every_stream_whole(batch: int) -> None:
    """300 seeded runs of random commits on 1-3 tasks, publishes made at once, held back and made out of
    order, lost (never the newest entry) or repeated, connections subscribing (random cursors: 0, current,
    older, ahead, invalid), resubscribing and unsubscribing one message at a time, and writers draining a
    few frames now and then, with a backlog of 1-6; the fake book yields at random points of its reads.

    Every subscription still open at the end was sent its resume frame, then a contiguous sequence of
    exact states (conflated snapshots allowed) up to the final version and the final task; every other one
    a valid beginning of such a sequence; no backlog ever passed its bound.
    """
    for seed in range(batch * 30, batch * 30 + 30):
        try:
            await run_interleaving(seed)
        except Exception as exc:  # say which seed, to replay it alone
            raise AssertionError(f"seed {seed}") from exc


async def test_fake_book_answers_as_book(book: FakeBook, line: Line) -> None:
    """The twin itself: resume modes, delta entries bounded by the version read, entries_between."""
    line.commit_many("t", 10)
    resume = await book.resume("t", 4)
    assert (resume.mode, resume.reason, resume.task.version) == ("delta", None, 10)
    assert [v for v, _ in resume.entries] == list(range(5, 11))
    assert (await book.resume("t", 1)).mode == "snapshot"
    assert (await book.resume("t", 11)).reason == "cursor-ahead"
    assert (await book.resume("t", 10)).entries == []
    assert [v for v, _ in await book.entries_between("t", 2, 5)] == [3, 4, 5]
    assert await book.get("t") == book.state_at("t", 10)
    with pytest.raises(UnknownTask):
        await book.get("nope")


# --- the direct path: entries written straight to a socket that has room -------------------------------


class FakeSocket:
    """A socket the hub may write framed bytes to while ``room`` is True (its buffer has space)."""

    def __init__(self) -> None:
        self.room = True
        self.limit = 1 << 30  # bytes one write may take now
        self.sent: list[bytes] = []

    def can_write(self, size: int) -> bool:
        return self.room and size <= self.limit

    def write(self, data: bytes) -> None:
        assert self.room
        self.sent.append(data)


def split_frames(data: bytes) -> list[bytes]:
    """One write may carry several frames (a round's entries for one socket): split them."""
    frames: list[bytes] = []
    while data:
        n, at = data[1], 2
        if n == 126:
            n, at = int.from_bytes(data[2:4]), 4
        elif n == 127:
            n, at = int.from_bytes(data[2:10]), 10
        frames.append(data[: at + n])
        data = data[at + n :]
    return frames


def unframe(data: bytes) -> Frame:
    """A server's unmasked text frame back to its JSON (RFC 6455 5.2), as a client would read it."""
    assert data[0] == 0x81 and not data[1] & 0x80  # FIN + text, unmasked
    n, at = data[1], 2
    if n == 126:
        n, at = int.from_bytes(data[2:4]), 4
    elif n == 127:
        n, at = int.from_bytes(data[2:10]), 10
    assert len(data) == at + n
    body = orjson.loads(data[at:])
    return Frame(body["type"], body["version"], data[at:].decode())


async def test_entries_go_straight_to_a_socket_with_room_and_queue_in_order_when_it_has_none(
    book: FakeBook, hub: Hub, line: Line
) -> None:
    """The stream a client reads is whole whichever way each frame went: written directly (no wake-up of
    the connection's writer) while the socket has room, queued for the writer while it has none, and a
    later entry never overtakes a queued one."""
    feed = Feed(hub, book)  # type: ignore[arg-type]
    sock = FakeSocket()
    feed.direct = sock
    await feed.subscribe("t", 0)
    received = await frames(feed)  # the resume frame goes through the writer
    line.commit_many("t", 3)  # 1..3: straight to the socket, in one write
    await settle()
    assert [unframe(f).version for b in sock.sent for f in split_frames(b)] == [1, 2, 3]
    await assert_quiet(feed)
    sock.room = False
    line.commit_many("t", 2)  # 4, 5: no room, queued
    await settle()
    sock.room = True
    line.commit("t")  # 6: room again, but 4 and 5 wait in the queue: it must not overtake them
    await settle()
    direct = [unframe(f) for b in sock.sent for f in split_frames(b)]
    assert len(direct) == 3
    received += direct + await frames(feed, 3)
    assert check_stream(book, "t", 0, received) == 6
    assert [f.version for f in received] == [0, 1, 2, 3, 4, 5, 6]
    line.commit("t")  # 7: the queue is empty again: straight to the socket
    await settle()
    assert [unframe(f).version for b in sock.sent for f in split_frames(b)] == [1, 2, 3, 7]
    assert hub.stats()["direct_writes"] == 4
    # The terminal entry goes through the writer, which ends the stream after it.
    line.commit("t", Succeed(9_000, "s3://r", "sha256:1"))
    (last,) = await frames(feed)
    check_event(book, "t", last, 8)


async def test_fan_out_yields_the_loop_and_entries_that_pile_up_go_out_together(
    book: FakeBook, hub: Hub, line: Line, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fan-out to many subscribers runs in slices, so other work (a callback's answer) runs in between;
    entries committed while a round is under way form the next one, and each socket gets them in one write:
    the more fan-out falls behind, the less it costs per entry. (A slice of zero seconds makes the slicing
    visible: it yields after every few subscriptions.)"""
    import gateway.live.hub as hub_module

    monkeypatch.setattr(hub_module, "FLUSH_SLICE_S", 0.0)
    sockets: list[FakeSocket] = []
    for _ in range(10 * hub_module.FLUSH_CHECK_EVERY):
        feed = Feed(hub, book)  # type: ignore[arg-type]
        feed.direct = sock = FakeSocket()
        sockets.append(sock)
        await feed.subscribe("t", 0)
        await take(feed)
    line.commit("t")  # 1
    await settle()
    reached = sum(1 for sock in sockets if sock.sent)
    assert 0 < reached < len(sockets)  # a slice, not the whole round: the loop ran other work since
    line.commit_many("t", 2)  # 2, 3: while the round of 1 is still going
    with anyio.fail_after(TIMEOUT_S):
        while not all(len(sock.sent) == 2 for sock in sockets):
            await settle()
    for sock in sockets:
        first, second = ([unframe(f).version for f in split_frames(b)] for b in sock.sent)
        assert (first, second) == ([1], [2, 3])
    assert hub.stats()["direct_writes"] == 3 * len(sockets)
    assert hub.stats()["pending_total"] == 0  # nothing went the slow way


async def test_fan_out_waits_while_callbacks_are_answered_but_always_progresses(
    book: FakeBook, hub: Hub, line: Line, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Callbacks first: while callbacks wait for their answers, fan-out takes only a slice now and then
    (here: every 0.3 s) instead of one per turn of the loop; once none waits, it goes on at once. (Slices of
    zero seconds make the slicing visible.)"""
    import gateway.live.hub as hub_module

    monkeypatch.setattr(hub_module, "FLUSH_SLICE_S", 0.0)
    monkeypatch.setattr(hub_module, "FLUSH_YIELD_S", 0.001)
    monkeypatch.setattr(hub_module, "FLUSH_MAX_PAUSE_S", 0.3)
    waiting = [True]
    hub.callbacks_waiting = lambda: waiting[0]
    sockets = []
    for _ in range(4 * hub_module.FLUSH_CHECK_EVERY):
        feed = Feed(hub, book)  # type: ignore[arg-type]
        feed.direct = sock = FakeSocket()
        sockets.append(sock)
        await feed.subscribe("t", 0)
        await take(feed)
    line.commit("t")
    for _ in range(20):
        await settle()
    assert sum(1 for sock in sockets if sock.sent) == hub_module.FLUSH_CHECK_EVERY  # one slice, then waiting
    with anyio.fail_after(TIMEOUT_S):  # it still progresses, a slice per pause
        while sum(1 for sock in sockets if sock.sent) < 2 * hub_module.FLUSH_CHECK_EVERY:  # noqa: ASYNC110
            await anyio.sleep(0.01)
    waiting[0] = False
    with anyio.fail_after(TIMEOUT_S):
        while not all(sock.sent for sock in sockets):  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def test_a_socket_far_behind_within_one_round_gets_one_conflated_snapshot_without_a_store_read(
    book: FakeBook, hub: Hub, line: Line
) -> None:
    feed = Feed(hub, book, backlog=BACKLOG)  # type: ignore[arg-type]
    feed.direct = sock = FakeSocket()
    await feed.subscribe("t", 0)
    await take(feed)
    book.calls.clear()
    line.commit_many("t", BACKLOG + 3)  # one round of more entries than the backlog holds
    await settle()
    (write,) = sock.sent
    (frame,) = [unframe(f) for f in split_frames(write)]
    body = parse(frame)
    assert (body["type"], body["reason"], body["version"]) == ("snapshot", "conflated", BACKLOG + 3)
    assert body["task"] == task_to_json(book.current("t"))
    assert [c for c in book.calls if c[0] in ("get", "entries")] == []
    line.commit("t")
    await settle()
    assert unframe(sock.sent[-1]).version == BACKLOG + 4  # and then on, entry by entry


async def test_after_a_stalled_send_nothing_is_written_directly(book: FakeBook, hub: Hub, line: Line) -> None:
    """The watchdog cancelled a send that had taken entry 1 from the queue (the peer stopped reading): that
    frame is never written, so entry 2 must not go out directly either (the peer would see a gap before
    its 4008); the connection is on its way to closing."""
    feed = Feed(hub, book)  # type: ignore[arg-type]
    feed.direct = sock = FakeSocket()
    await feed.subscribe("t", 0)
    await take(feed)
    sock.room = False
    line.commit("t")  # 1: queued
    await settle()
    await take(feed)  # the writer took it ...
    feed.writing_since = time.monotonic()  # ... and its send is stuck
    feed.stall()  # the watchdog cancels it
    sock.room = True
    line.commit("t")  # 2
    await settle()
    assert sock.sent == []


async def test_a_write_that_would_overfill_the_socket_takes_the_queue(
    book: FakeBook, hub: Hub, line: Line
) -> None:
    feed = Feed(hub, book)  # type: ignore[arg-type]
    feed.direct = sock = FakeSocket()
    await feed.subscribe("t", 0)
    received = await frames(feed)
    sock.limit = 10  # less than one frame fits
    line.commit_many("t", 2)
    await settle()
    assert sock.sent == []
    received += await frames(feed, 2)
    assert check_stream(book, "t", 0, received) == 2
