"""The hub's side of the state beside the history (``gateway.live.beside_delivery``): a change heard on the
bus goes straight to a socket with room, merged through the writer for one without, never older than what
the client holds; a bare wake-up and a change the bus lost are read from the store (the resync compares
revisions in one query). The decisions themselves are ``gateway.live.beside``'s (test_beside.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import replace

import orjson
import pytest

from gateway.bus.base import News
from gateway.frames import Beside
from gateway.live.feed import Feed
from gateway.live.hub import Hub
from gateway.machine import Task
from tests.unit.fake_book import FakeBook
from tests.unit.fanout_play import unframe_all
from tests.unit.test_hub import FakeSocket, frames, running, take

pytestmark = pytest.mark.anyio


class Besides:
    """The reads of the state beside the history, over the fake book (whose newest state it changes)."""

    def __init__(self, book: FakeBook) -> None:
        self.book = book
        self.calls: list[str] = []

    async def get(self, task_id: str) -> Task:
        self.calls.append(f"get {task_id}")
        return self.book.current(task_id)

    async def revisions_ahead(self, known: Mapping[str, int]) -> dict[str, int]:
        self.calls.append("ahead")
        current = {i: self.book.current(i).revision for i in known}
        return {i: revision for i, revision in current.items() if revision > known[i]}


def change(book: FakeBook, task_id: str, metadata: str, children: tuple[int, ...] | None = None) -> Task:
    """A change beside the history of the task's newest state, committed: one revision more."""
    task = book.current(task_id)
    changed = replace(task, metadata=metadata, children=children, revision=task.revision + 1)  # type: ignore[arg-type]
    book.states[task_id][-1] = changed
    return changed


@pytest.fixture
def book() -> FakeBook:
    book = FakeBook()
    book.create("t")
    return book


@pytest.fixture
async def hub(book: FakeBook) -> AsyncIterator[Hub]:
    async with running(Hub(book, besides=Besides(book))) as hub:
        yield hub


def sent(socket: FakeSocket) -> list[dict[str, object]]:
    return [orjson.loads(frame.text) for data in socket.sent for frame in unframe_all(data)]


async def test_a_change_goes_straight_to_a_socket_with_room_only_the_frames_that_differ(
    book: FakeBook, hub: Hub
) -> None:
    socket = FakeSocket()
    feed = Feed(hub, book)
    feed.direct = socket
    await feed.subscribe("t", 0)
    await take(feed)
    hub.receive(News.besides(change(book, "t", '{"message":"page 1"}')))
    hub.receive(News.besides(change(book, "t", '{"message":"page 1"}', (1, 1, 0, 0, 0, 0))))
    stale = replace(book.current("t"), revision=1, metadata='{"message":"old"}')
    hub.receive(News.besides(stale))  # heard late: older than what the client holds
    assert sent(socket) == [
        {"type": "metadata", "taskId": "t", "revision": 1, "metadata": {"message": "page 1"}},
        {
            "type": "children",
            "taskId": "t",
            "revision": 2,
            "children": {"total": 1, "queued": 1, "running": 0, "succeeded": 0, "failed": 0, "expired": 0},
        },
    ]
    assert not feed.has_work()


async def test_a_slow_socket_gets_the_newest_state_once_from_its_writer(book: FakeBook, hub: Hub) -> None:
    socket = FakeSocket()
    socket.room = False
    feed = Feed(hub, book)
    feed.direct = socket
    await feed.subscribe("t", 0)
    await take(feed)
    for n in range(1, 4):
        hub.receive(News.besides(change(book, "t", f'{{"n":{n}}}')))
    (frame,) = await frames(feed)
    assert orjson.loads(frame.text) == {
        "type": "metadata",
        "taskId": "t",
        "revision": 3,
        "metadata": {"n": 3},
    }
    assert socket.sent == [] and not feed.has_work()


async def test_a_bare_wake_up_and_a_lost_change_are_read_from_the_store(book: FakeBook, hub: Hub) -> None:
    feed = Feed(hub, book)
    await feed.subscribe("t", 0)
    await take(feed)
    big = change(book, "t", orjson.dumps({"k": "x" * 8000}).decode())
    hub.receive(News("t", -1, beside=replace(Beside.of(big), metadata=None)))  # too big for the bus
    (frame,) = await frames(feed)
    assert orjson.loads(frame.text)["revision"] == 1
    change(book, "t", '{"lost":true}')  # its message never came
    hub.resync()
    (frame,) = await frames(feed)
    assert orjson.loads(frame.text) == {
        "type": "metadata",
        "taskId": "t",
        "revision": 2,
        "metadata": {"lost": True},
    }
    hub.receive(News("nobody", -1, beside=Beside("nobody", 1, None)))  # no subscriber here: nothing read
    assert "get nobody" not in hub.besides.calls  # type: ignore[union-attr]
