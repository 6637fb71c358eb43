"""The hub's watchdog (``Hub.watch_writes``) looks only at the connections in a send or held to having a
subscription, not at every socket each time: no socket, no database, the connections' clock moved by hand."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

from gateway.errors import CLOSE_NO_SUBSCRIPTION
from gateway.live.feed import Feed
from gateway.live.hub import Hub
from tests.unit.fake_book import FakeBook
from tests.unit.test_hub import DEADLINE_S, running

pytestmark = pytest.mark.anyio

TIMEOUT_S = 0.2  # the watchdog looks every 0.05 s of real time


class Clock:
    """The connections' clock, moved by the test; tells each time it is read (once per watchdog sweep)."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._read = anyio.Event()

    def __call__(self) -> float:
        self._read.set()
        return self.now

    async def sweep(self, hub: Hub) -> None:
        """Until the watchdog has made one whole sweep from now (a sweep reads the clock, then looks at
        every watched connection without waiting)."""
        with anyio.fail_after(DEADLINE_S):
            self._read = anyio.Event()
            await self._read.wait()


@pytest.fixture
def book() -> FakeBook:
    book = FakeBook()
    book.create("t")
    return book


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def hub(book: FakeBook, clock: Clock) -> AsyncIterator[Hub]:
    """A hub with its catch-up loop and its watchdog running."""
    async with running(Hub(book, monotonic=clock)) as hub, anyio.create_task_group() as tg:
        tg.start_soon(hub.watch_writes, TIMEOUT_S)
        yield hub
        tg.cancel_scope.cancel()


async def test_only_a_connection_in_a_send_is_looked_at_until_its_send_ends(
    book: FakeBook, clock: Clock, hub: Hub
) -> None:
    quiet, sending = Feed(hub, book), Feed(hub, book)
    await quiet.subscribe("t", 0)
    await sending.subscribe("t", 0)
    assert hub.watched == set()
    sending.writing_since = clock.now
    assert hub.watched == {sending}
    await clock.sweep(hub)
    assert hub.watched == {sending}  # its send is under way
    sending.writing_since = None
    await clock.sweep(hub)
    assert hub.watched == set()
    assert quiet.close_code is None and sending.close_code is None


async def test_a_connection_held_to_a_subscription_is_watched_again_when_its_last_one_ends(
    book: FakeBook, clock: Clock, hub: Hub
) -> None:
    feed = Feed(hub, book)
    feed.hold_to(10.0, 5)
    assert hub.watched == {feed}
    await feed.subscribe("t", 0)
    await clock.sweep(hub)
    assert hub.watched == set()  # it holds a subscription: no deadline runs
    clock.now += 60
    feed.unsubscribe("t")
    assert hub.watched == {feed}
    await clock.sweep(hub)
    assert feed.close_code is None  # its deadline runs from the unsubscribe
    clock.now += 10
    await clock.sweep(hub)
    with anyio.fail_after(DEADLINE_S):
        while (item := await feed.next()) is not None:
            _, frame = item
    assert frame.type == "error"
    assert feed.close_code == CLOSE_NO_SUBSCRIPTION


async def test_a_connection_let_go_is_no_longer_watched(book: FakeBook, clock: Clock, hub: Hub) -> None:
    feed = Feed(hub, book)
    feed.hold_to(10.0, 5)
    await feed.subscribe("t", 0)
    feed.writing_since = clock.now
    feed.release()
    assert hub.watched == set()
    feed.writing_since = clock.now  # its writer's last send, after the connection was let go
    assert hub.watched == set()
