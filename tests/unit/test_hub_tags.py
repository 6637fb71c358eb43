"""Tag subscriptions driven by the hub (``gateway.live.hub``, ``gateway.live.feed``): no socket, no database.

The decisions (what is listed, buffered, announced, once) are the pure core's, tested as plain calls in
``test_tagging.py``. What is left here is what the driver does with them: the store reads a tag's
subscribe makes (two, however many tasks: the listing and one read of every resume state), creations
heard while they are under way, a subscribe that fails or is cancelled, the ``tag`` frame waiting for room
as any answer, and the reconcile that lists the watched tags again for a creation whose news was lost.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import orjson
import pytest

from gateway.bus.base import News
from gateway.errors import InvalidRequest
from gateway.frames import PONG, Frame
from gateway.live.feed import Feed
from gateway.live.hub import Hub
from tests.unit.fake_book import FakeBook
from tests.unit.fanout_play import Client, news
from tests.unit.test_hub import DEADLINE_S, gate, running

pytestmark = pytest.mark.anyio

TAG = "owner:u42"
LIMIT = 1000


@pytest.fixture
def book() -> FakeBook:
    return FakeBook()


@pytest.fixture
async def hub(book: FakeBook) -> AsyncIterator[Hub]:
    """A hub over the fake book (which reads tags too), its clock the book's, its catch-up loop running."""
    async with running(Hub(book, tags=book, wall=lambda: book.clock)) as hub:
        yield hub


def create(book: FakeBook, hub: Hub, task_id: str, tags: list[str], *, publish: bool = True) -> None:
    """A task created now, and the news of it handed to the hub as the bus does (or lost)."""
    book.clock += 1
    task = book.create(task_id, tags=tags)
    if publish:
        hub.receive(News.creation(task))


def commit(book: FakeBook, hub: Hub, task_id: str, *, publish: bool = True) -> None:
    done = book.commit(task_id)
    if publish:
        hub.receive(news(done))


async def frames(feed: Feed, n: int) -> list[Frame]:
    got: list[Frame] = []
    with anyio.fail_after(DEADLINE_S):
        for _ in range(n):
            item = await feed.next()
            assert item is not None, f"feed closed ({feed.close_code}) after {got}"
            got.append(item[1])
    return got


async def bodies(feed: Feed, client: Client, n: int) -> list[dict[str, Any]]:
    return client.feed(await frames(feed, n))


def reads(book: FakeBook) -> list[str]:
    return [call[0] for call in book.calls]


async def test_a_tag_subscribe_reads_the_store_twice_however_many_tasks(book: FakeBook, hub: Hub) -> None:
    ids = [f"t{i:03d}" for i in range(200)]
    for task_id in ids:
        create(book, hub, task_id, [TAG])
    for task_id in ids[:100]:
        commit(book, hub, task_id)
    cursors = {task_id: 0 for task_id in ids[::2]}
    feed = Feed(hub, book)
    book.calls.clear()
    await feed.subscribe_tag(TAG, cursors, LIMIT)
    assert reads(book) == ["list", "resume_many"]  # the listing, then every resume state in one read
    client = Client(book, cursors)
    got = await bodies(feed, client, 201)
    assert got[0] == {"type": "tag", "tag": TAG, "taskIds": ids[::-1], "more": False}
    assert [b["taskId"] for b in got[1:]] == ids[::-1]
    assert {(b["type"], b.get("reason")) for b in got[1:]} == {
        ("delta", None),  # behind by one: the first hundred, in the map
        ("caught-up", None),  # the others in the map
        ("snapshot", "new"),  # not in the map
    }
    assert hub.stats()["subscriptions"] == 200 and hub.stats()["tag_subscriptions"] == 1
    assert feed.peer.owned == 200 and set(feed.peer.tags) == {TAG}
    commit(book, hub, "t150")
    assert [(b["taskId"], b["version"]) for b in await bodies(feed, client, 1)] == [("t150", 1)]
    feed.release()
    assert hub.stats()["subscriptions"] == hub.stats()["tag_subscriptions"] == 0


@pytest.mark.parametrize("point", ["list", "resume_many"])
async def test_a_task_created_while_the_tag_is_read_is_streamed_once(
    book: FakeBook, hub: Hub, point: str
) -> None:
    """Created (and an entry committed) just before the listing: it is listed; between the listing and the
    read of the resume states: announced after the resume frames, its entry after its snapshot."""
    create(book, hub, "old", [TAG])
    feed = Feed(hub, book)
    reached, release = gate(book, point)
    async with anyio.create_task_group() as tg:
        tg.start_soon(feed.subscribe_tag, TAG, {}, LIMIT)
        with anyio.fail_after(DEADLINE_S):
            await reached.wait()
        create(book, hub, "new", [TAG])
        commit(book, hub, "new")  # its entry, held for it until the merge
        release.set()
    client = Client(book)
    if point == "list":
        got = await bodies(feed, client, 3)
        assert got[0]["taskIds"] == ["new", "old"]
        assert [(b["type"], b.get("taskId"), b.get("version")) for b in got[1:]] == [
            ("snapshot", "new", 1),
            ("snapshot", "old", 0),
        ]
        assert client.added == []
    else:
        got = await bodies(feed, client, 5)
        assert got[0]["taskIds"] == ["old"]
        assert [(b["type"], b.get("taskId"), b.get("version")) for b in got[1:]] == [
            ("snapshot", "old", 0),
            ("added", "new", None),
            ("snapshot", "new", 0),
            ("event", "new", 1),
        ]
        assert client.added == [(TAG, "new")]
    assert not feed.has_work()


async def test_a_tag_subscribe_that_fails_or_is_cancelled_leaves_nothing(book: FakeBook, hub: Hub) -> None:
    create(book, hub, "t", [TAG])
    feed = Feed(hub, book, max_subscriptions=1)

    async def unreachable() -> None:
        raise OSError("the database is unreachable")

    book.hooks["resume_many"] = unreachable
    with pytest.raises(OSError):
        await feed.subscribe_tag(TAG, {}, LIMIT)
    assert (feed.peer.tags, feed.subscriptions, hub.tagging.watched) == ({}, {}, {})
    reached, _ = gate(book, "list")
    async with anyio.create_task_group() as tg:
        tg.start_soon(feed.subscribe_tag, TAG, {}, LIMIT)
        with anyio.fail_after(DEADLINE_S):
            await reached.wait()
        assert set(feed.peer.tags) == {TAG}
        tg.cancel_scope.cancel()
    assert (feed.peer.tags, feed.subscriptions, hub.tagging.watched) == ({}, {}, {})
    book.hooks.clear()
    await feed.subscribe("t", 0)
    with pytest.raises(InvalidRequest, match="at most 1 subscriptions"):
        await feed.subscribe_tag(TAG, {}, LIMIT)
    assert set(feed.subscriptions) == {"t"} and feed.peer.tags == {}
    assert [f.type for f in await frames(feed, 1)] == ["caught-up"]


async def test_unsubscribing_a_tag_ends_the_streams_it_owns_and_lets_the_connection_go(
    book: FakeBook, hub: Hub
) -> None:
    create(book, hub, "a", [TAG])
    create(book, hub, "b", [TAG])
    feed = Feed(hub, book)
    feed.peer.hold_to(hub.monotonic(), 3600.0, 5)
    await feed.subscribe_tag(TAG, {}, LIMIT)
    await frames(feed, 3)
    assert feed.peer.idle_since is None
    feed.unsubscribe_tag("project:7")  # none: nothing happens
    feed.unsubscribe_tag(TAG)
    assert feed.subscriptions == {} and hub.stats()["subscriptions"] == 0
    assert feed.peer.idle_since is not None  # its deadline runs again
    commit(book, hub, "a")
    create(book, hub, "c", [TAG])
    assert not feed.has_work()


async def test_the_tag_frame_waits_for_room_as_any_answer(book: FakeBook, hub: Hub) -> None:
    create(book, hub, "t", [TAG])
    feed = Feed(hub, book, max_control=1)
    assert feed.send_control(PONG)
    done = anyio.Event()

    async def subscribe() -> None:
        await feed.subscribe_tag(TAG, {}, LIMIT)
        done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(subscribe)
        await anyio.wait_all_tasks_blocked()
        assert not done.is_set()  # waiting for room behind the pong
        got = await frames(feed, 1)
        with anyio.fail_after(DEADLINE_S):
            await done.wait()
    assert got == [PONG]
    assert [f.type for f in await frames(feed, 2)] == ["tag", "snapshot"]


async def test_a_connection_closed_while_its_tag_frame_waits_for_room_keeps_nothing(
    book: FakeBook, hub: Hub
) -> None:
    create(book, hub, "t", [TAG])
    feed = Feed(hub, book, max_control=1)
    assert feed.send_control(PONG)
    async with anyio.create_task_group() as tg:
        tg.start_soon(feed.subscribe_tag, TAG, {}, LIMIT)
        await anyio.wait_all_tasks_blocked()
        feed.close(1001)
    assert feed.peer.tags == {} and feed.subscriptions == {}


async def test_the_reconcile_finds_a_creation_whose_news_was_lost(book: FakeBook, hub: Hub) -> None:
    feed = Feed(hub, book)
    await feed.subscribe_tag(TAG, {}, LIMIT)
    client = Client(book)
    await bodies(feed, client, 1)
    create(book, hub, "lost", [TAG], publish=False)
    commit(book, hub, "lost")  # heard by no subscription here
    book.calls.clear()
    hub.resync()  # the bus reconnected (or the periodic check)
    got = await bodies(feed, client, 2)
    assert [(b["type"], b.get("version")) for b in got] == [("added", None), ("snapshot", 1)]
    assert reads(book)[:2] == ["tagged_since", "resume_many"]
    # Entries may have come between the reconcile's read and the announcement, unheard: the writer reads
    # the task once more (here after the next one) and sends what it finds newer, then entries follow.
    commit(book, hub, "lost")
    assert [(b["type"], b["version"]) for b in await bodies(feed, client, 1)] == [("snapshot", 2)]
    assert reads(book)[-1] == "get"
    commit(book, hub, "lost")
    assert [(b["type"], b["version"]) for b in await bodies(feed, client, 1)] == [("event", 3)]
    assert client.added == [(TAG, "lost")]
    assert hub.tagging.horizon_ms is not None


async def test_news_of_a_creation_is_no_entry_of_a_task_subscription(book: FakeBook, hub: Hub) -> None:
    book.create("t", tags=[TAG])
    feed = Feed(hub, book)
    await feed.subscribe("t", 0)
    hub.receive(News.creation(book.current("t")))
    commit(book, hub, "t")
    got = [orjson.loads(f.text) for f in await frames(feed, 2)]
    assert [(b["type"], b["version"]) for b in got] == [("caught-up", 0), ("event", 1)]
