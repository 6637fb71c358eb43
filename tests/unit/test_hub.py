"""The hub (``gateway.live.hub``), the asyncio driver of the fan-out core: no socket, no database.

The decisions themselves (the order of frames, the merge, conflation, the 4008 decision) are the pure
core's, tested as plain calls in ``test_fanout.py`` and ``test_fanout_properties.py``. What is left to test
here is what the driver does with them: the store reads it makes (through ``BookReads``, here the in-memory
:class:`~tests.unit.fake_book.FakeBook`), the bytes it writes straight to a socket, the frames a
connection's writer awaits, the loop it shares with callbacks (slices, callbacks first), the catch-up loop,
the write watchdog, shutdown.

Entries reach the hub as the bus hands them over (``Hub.receive``). Every wait is for the event that makes
its outcome (a write, a frame, a read reached), under a deadline; the loop's own timing is the hub's
(``slice_s``, ``clock`` ...), given to it, never patched.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import anyio
import pytest

from gateway.bus.base import News
from gateway.errors import CLOSE_INTERNAL_ERROR, CLOSE_SLOW_CONSUMER, InvalidRequest, UnknownTask
from gateway.frames import PONG, Frame, error_frame
from gateway.live.feed import Feed
from gateway.live.hub import Connection, Hub
from gateway.live.peer import Subscription
from gateway.machine import Succeed
from tests.unit.fake_book import Committed, FakeBook
from tests.unit.fanout_play import check_stream, news, unframe_all

pytestmark = pytest.mark.anyio

DEADLINE_S = 5.0

Item = tuple[Subscription[Connection] | None, Frame]


class Writes:
    """Every direct write to the sockets of a test, in order, and a wait for the n-th."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self._more = anyio.Event()

    def add(self, name: str) -> None:
        self.log.append(name)
        self._more.set()

    async def wait(self, n: int) -> None:
        with anyio.fail_after(DEADLINE_S):
            while len(self.log) < n:
                self._more = anyio.Event()
                await self._more.wait()


class FakeSocket:
    """A socket the hub may write framed bytes to while ``room`` is True."""

    def __init__(self, writes: Writes | None = None, name: str = "") -> None:
        self.room = True
        self.sent: list[bytes] = []
        self.writes = writes if writes is not None else Writes()
        self.name = name

    def can_write(self, size: int) -> bool:
        return self.room

    def write(self, data: bytes) -> None:
        assert self.room
        self.sent.append(data)
        self.writes.add(self.name)

    def versions(self) -> list[list[int]]:
        return [[frame.version for frame in unframe_all(data)] for data in self.sent]

    async def wait_writes(self, n: int) -> None:
        await self.writes.wait(n)


class Clock:
    """The hub's clock for its slices, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Callbacks:
    """Whether callbacks are being answered (the app's count), and each time fan-out asks."""

    def __init__(self) -> None:
        self.waiting = True
        self._asked = anyio.Event()

    def __call__(self) -> bool:
        self._asked.set()
        return self.waiting

    async def asked(self, times: int) -> None:
        """Until fan-out has asked ``times`` more times."""
        with anyio.fail_after(DEADLINE_S):
            for _ in range(times):
                self._asked = anyio.Event()
                await self._asked.wait()


@pytest.fixture
def book() -> FakeBook:
    book = FakeBook()
    book.create("t")
    book.create("u")
    return book


@pytest.fixture
async def hub(book: FakeBook) -> AsyncIterator[Hub]:
    """A hub over the fake book, with its catch-up loop running."""
    async with running(Hub(book)) as hub:
        yield hub


class running:
    """The hub's catch-up loop, for the block's duration."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self._group = anyio.create_task_group()

    async def __aenter__(self) -> Hub:
        await self._group.__aenter__()
        self._group.start_soon(self.hub.run)
        return self.hub

    async def __aexit__(self, *exc: object) -> None:
        self._group.cancel_scope.cancel()
        await self._group.__aexit__(None, None, None)


def commit(book: FakeBook, hub: Hub, task_id: str, n: int = 1, *, publish: bool = True) -> list[Committed]:
    """``n`` commits, each handed to the hub as the bus does (or not: a lost message)."""
    done = [book.commit(task_id) for _ in range(n)]
    if publish:
        for c in done:
            hub.receive(news(c))
    return done


async def take(feed: Feed, n: int = 1) -> list[Item]:
    items: list[Item] = []
    with anyio.fail_after(DEADLINE_S):
        for _ in range(n):
            item = await feed.next()
            assert item is not None, f"feed closed ({feed.close_code}) after {items}"
            items.append(item)
    return items


async def frames(feed: Feed, n: int = 1) -> list[Frame]:
    return [frame for _, frame in await take(feed, n)]


def gate(book: FakeBook, point: str) -> tuple[anyio.Event, anyio.Event]:
    """Make the fake book stop at ``point`` until the test releases it: returns (reached, release)."""
    reached, release = anyio.Event(), anyio.Event()

    async def hook() -> None:
        reached.set()
        await release.wait()

    book.hooks[point] = hook
    return reached, release


async def direct_feed(hub: Hub, book: FakeBook, socket: FakeSocket, **limits: int) -> Feed:
    """A feed whose socket takes direct writes, subscribed to "t" at its version, its resume frame sent."""
    feed = Feed(hub, book, **limits)
    feed.direct = socket
    await feed.subscribe("t", book.current("t").version)
    await take(feed)
    return feed


# --- the resume frame, then the live entries: through the writer and straight to the socket -------------


async def test_a_subscription_gets_its_resume_frame_then_every_entry(book: FakeBook, hub: Hub) -> None:
    commit(book, hub, "t", 3)
    feed = Feed(hub, book)
    sub = await feed.subscribe("t", 1)
    assert feed.subscriptions == {"t": sub}
    commit(book, hub, "t", 2)
    commit(book, hub, "u", 2)  # another task's entries reach no one here
    got = await take(feed, 3)
    assert [s for s, _ in got] == [sub] * 3
    assert check_stream(book, "t", 1, [frame for _, frame in got]) == 5
    assert not feed.has_work()


async def test_entries_go_straight_to_a_socket_with_room_and_through_the_writer_when_it_is_full(
    book: FakeBook, hub: Hub
) -> None:
    socket = FakeSocket()
    feed = await direct_feed(hub, book, socket)
    woken = anyio.Event()
    feed.on_work = woken.set
    commit(book, hub, "t", 3)  # one round: one write
    await socket.wait_writes(1)
    assert socket.versions() == [[1, 2, 3]]
    assert not woken.is_set()  # no wake-up of the writer for them
    socket.room = False
    commit(book, hub, "t", 2)  # 4, 5: queued for the writer, which is woken
    with anyio.fail_after(DEADLINE_S):
        await woken.wait()
    socket.room = True
    assert [f.version for f in await frames(feed, 2)] == [4, 5]
    commit(book, hub, "t")
    await socket.wait_writes(2)
    assert socket.versions() == [[1, 2, 3], [6]]
    assert hub.stats()["direct_writes"] == 4
    # The terminal entry goes straight to the socket too, with no wake-up of the writer; the stream ends
    # after it (a /v1/ws socket's subscription ends: its feed has no ``on_finished``).
    (sub,) = feed.subscriptions.values()
    woken = anyio.Event()
    feed.on_work = woken.set
    done = book.commit("t", Succeed(9_000, "s3://r", "sha256:1"))
    hub.receive(news(done))
    await socket.wait_writes(3)
    assert socket.versions() == [[1, 2, 3], [6], [7]]
    assert sub.finished and feed.subscriptions == {}
    assert not woken.is_set() and not feed.has_work()


async def test_a_terminal_entry_written_straight_to_a_socket_ends_it_as_its_endpoint_says(
    book: FakeBook, hub: Hub
) -> None:
    """The single-task socket closes after the task's last frame (``on_finished``), written straight too,
    here in one write with the entry before it."""
    socket = FakeSocket()
    feed = await direct_feed(hub, book, socket)
    ended: list[list[list[int]]] = []
    feed.on_finished = lambda: ended.append(socket.versions())
    commit(book, hub, "t")  # started
    hub.receive(news(book.commit("t", Succeed(9_000, "s3://r", "sha256:1"))))
    await socket.wait_writes(1)
    assert ended == [[[1, 2]]]  # ended once, after the write


async def test_a_socket_far_behind_gets_one_conflated_snapshot_straight_away(book: FakeBook) -> None:
    """Entries that pile up while callbacks are answered go to each socket together: past its backlog,
    as one snapshot, read from no store."""
    callbacks = Callbacks()
    hub = Hub(book, max_pause_s=3600.0, yield_s=0.001, clock=Clock())
    hub.callbacks_waiting = callbacks
    socket = FakeSocket()
    await direct_feed(hub, book, socket, backlog=2)
    book.calls.clear()
    commit(book, hub, "t", 5)
    await callbacks.asked(2)
    assert socket.sent == []
    callbacks.waiting = False
    await socket.wait_writes(1)
    ((snapshot,),) = [unframe_all(data) for data in socket.sent]
    assert (snapshot.type, snapshot.version) == ("snapshot", 5)
    assert book.calls == []
    assert (hub.stats()["conflations"], hub.stats()["direct_writes"]) == (1, 1)


# --- the loop: slices, callbacks first ------------------------------------------------------------------


async def test_fan_out_takes_the_loop_in_slices_and_entries_that_pile_up_go_out_together(
    book: FakeBook,
) -> None:
    """Fan-out to many sockets runs in slices (here: 4 sockets each), so other work runs in between; the
    entries handed out meanwhile form the next round, and each socket gets them in one write."""
    writes = Writes()
    hub = Hub(book, slice_s=0.0, check_every=4)
    sockets = [FakeSocket(writes, f"s{i}") for i in range(12)]
    for socket in sockets:
        await direct_feed(hub, book, socket)
    commit(book, hub, "t")
    await writes.wait(1)  # woken during the first slice, this task runs before the next one
    writes.log.append("other work")
    commit(book, hub, "t", 2)  # 2, 3: while the round of 1 is under way
    await writes.wait(1 + 2 * len(sockets))
    assert writes.log.index("other work") == 4
    assert all(socket.versions() == [[1], [2, 3]] for socket in sockets)
    joined = {id(socket.sent[1]) for socket in sockets}
    assert len(joined) == 1  # framed and joined once for every socket
    assert hub.stats()["direct_writes"] == 3 * len(sockets)
    assert hub.stats()["pending_total"] == 0  # nothing went the writers' way


async def test_fan_out_waits_while_callbacks_are_answered_but_always_progresses(book: FakeBook) -> None:
    """Callbacks first: while callbacks are answered, fan-out takes a slice only once per ``max_pause_s``
    of its clock; once none waits, it goes on at once."""
    clock = Clock()
    callbacks = Callbacks()
    hub = Hub(book, slice_s=0.0, check_every=4, yield_s=0.001, max_pause_s=1.0, clock=clock)
    hub.callbacks_waiting = callbacks
    writes = Writes()
    for _ in range(12):
        await direct_feed(hub, book, FakeSocket(writes))
    commit(book, hub, "t")
    await writes.wait(4)  # one slice: its first, whatever the callbacks
    await callbacks.asked(3)
    assert len(writes.log) == 4  # then it waits ...
    clock.now += 1.0
    await writes.wait(8)  # ... a slice per pause ...
    await callbacks.asked(3)
    assert len(writes.log) == 8
    callbacks.waiting = False  # ... and goes on at once when no callback waits
    await writes.wait(12)


async def test_an_offer_that_fails_closes_that_connection_only(book: FakeBook, hub: Hub) -> None:
    class Broken(FakeSocket):
        def write(self, data: bytes) -> None:
            raise RuntimeError("a bug in a socket")

    broken = await direct_feed(hub, book, Broken())
    socket = FakeSocket()
    await direct_feed(hub, book, socket)
    commit(book, hub, "t")
    await socket.wait_writes(1)
    assert broken.close_code == CLOSE_INTERNAL_ERROR
    with anyio.fail_after(DEADLINE_S):
        assert await broken.next() is None


# --- the reads: the catch-up loop's, and a writer's ------------------------------------------------------


async def test_what_the_bus_lost_is_read_once_per_task_whatever_the_subscribers(
    book: FakeBook, hub: Hub
) -> None:
    feeds = [Feed(hub, book) for _ in range(5)]
    for feed in feeds:
        await feed.subscribe("t", 0)
        await take(feed)
    commit(book, hub, "t")
    commit(book, hub, "t", publish=False)  # lost
    commit(book, hub, "t")  # reveals the gap
    for feed in feeds:
        assert [f.version for f in await frames(feed, 3)] == [1, 2, 3]
    assert [c[:3] for c in book.calls if c[0] == "entries"] == [("entries", "t", 1)]
    assert hub.stats()["catch_ups"] == 1


async def test_a_bare_wake_up_is_read_from_the_store(book: FakeBook, hub: Hub) -> None:
    feed = Feed(hub, book)
    await feed.subscribe("t", 0)
    stream = await frames(feed)
    (c,) = commit(book, hub, "t", publish=False)
    hub.receive(News("t", c.version))  # too big for the bus: id and version only
    stream += await frames(feed)
    assert check_stream(book, "t", 0, stream) == 1


async def test_a_resync_finds_a_lost_tail_with_one_query_of_the_tasks_ahead(book: FakeBook, hub: Hub) -> None:
    """The bus lost the last entries of two tasks (its listener was reconnecting): nothing later reveals
    the gap; the resync it asks for on reconnect compares every task with the store in one query."""
    feeds = {task_id: Feed(hub, book) for task_id in ("t", "u")}
    for task_id, feed in feeds.items():
        await feed.subscribe(task_id, 0)
        await take(feed)
    commit(book, hub, "t", 3, publish=False)
    commit(book, hub, "u", publish=False)
    book.calls.clear()
    hub.resync()
    assert [f.version for f in await frames(feeds["t"], 3)] == [1, 2, 3]
    assert [f.version for f in await frames(feeds["u"], 1)] == [1]
    assert [c[0] for c in book.calls].count("ahead") == 1
    assert sorted(c[1] for c in book.calls if c[0] == "entries") == ["t", "u"]


async def test_the_catch_up_loop_tries_again_after_the_store_fails(book: FakeBook, hub: Hub) -> None:
    feed = Feed(hub, book)
    await feed.subscribe("t", 0)
    await take(feed)
    failed = anyio.Event()

    async def unreachable() -> None:
        del book.hooks["entries"]  # once
        failed.set()
        raise OSError("the database is unreachable")

    book.hooks["entries"] = unreachable
    commit(book, hub, "t", publish=False)
    hub.receive(News("t", 1))
    with anyio.fail_after(DEADLINE_S):
        await failed.wait()
    assert [f.version for f in await frames(feed)] == [1]  # after the resync that follows


async def test_a_catch_up_that_finds_no_task_gives_up_and_the_loop_goes_on(book: FakeBook, hub: Hub) -> None:
    """The channel has no state yet (its one subscription's state is being read): a bare wake-up makes
    the catch-up read the task, which is gone by then (``UnknownTask``)."""
    feed = Feed(hub, book)
    resuming, resume = gate(book, "resume")
    gone = anyio.Event()

    async def unknown() -> None:
        gone.set()
        raise UnknownTask("t")

    async with anyio.create_task_group() as tg:
        tg.start_soon(feed.subscribe, "t", 0)
        with anyio.fail_after(DEADLINE_S):
            await resuming.wait()
        book.hooks["get"] = unknown
        hub.receive(News("t", 1))
        with anyio.fail_after(DEADLINE_S):
            await gone.wait()
        book.hooks.clear()
        resume.set()
    assert [f.version for f in await frames(feed)] == [0]
    (c,) = commit(book, hub, "t", publish=False)
    hub.receive(News("t", c.version))
    assert [f.version for f in await frames(feed)] == [1]


async def test_a_writer_reads_what_its_frames_need(book: FakeBook, hub: Hub) -> None:
    """A gap (the channel had no state yet, so it handed out the first entry it heard of) and a conflated
    snapshot: the connection's writer makes those reads itself."""
    commit(book, hub, "t", 3)
    feed = Feed(hub, book, backlog=2)
    reached, release = gate(book, "resume:task-read")
    async with anyio.create_task_group() as tg:
        tg.start_soon(feed.subscribe, "t", 3)
        with anyio.fail_after(DEADLINE_S):
            await reached.wait()  # its state is v3; the channel has none until it lands
        commit(book, hub, "t", publish=False)  # 4: lost
        commit(book, hub, "t")  # 5: handed out as it comes
        release.set()
    book.calls.clear()
    got = await frames(feed, 3)
    assert [f.version for f in got] == [3, 4, 5]
    assert [c[:4] for c in book.calls] == [("entries", "t", 3, 4)]  # the writer filled 4
    commit(book, hub, "t", 3)  # past the backlog of 2: one snapshot, read by the writer
    (snapshot,) = await frames(feed)
    assert (snapshot.type, snapshot.version) == ("snapshot", 8)
    assert [c[0] for c in book.calls][-1] == "get"
    assert check_stream(book, "t", 3, [*got, snapshot]) == 8


async def test_a_writer_whose_read_fails_ends_with_the_error(book: FakeBook, hub: Hub) -> None:
    feed = Feed(hub, book, backlog=1)
    await feed.subscribe("t", 0)
    await take(feed)

    async def unreachable() -> None:
        raise OSError("the database is unreachable")

    book.hooks["get"] = unreachable
    commit(book, hub, "t", 2)  # conflated: the writer reads the task
    with anyio.fail_after(DEADLINE_S), pytest.raises(OSError):
        await feed.next()
    assert feed.peer.reading is None
    del book.hooks["get"]
    assert [(f.type, f.version) for f in await frames(feed)] == [("snapshot", 2)]  # on its next turn


# --- subscriptions come and go -----------------------------------------------------------------------------


async def test_a_subscribe_that_fails_or_is_cancelled_leaves_nothing_subscribed(
    book: FakeBook, hub: Hub
) -> None:
    feed = Feed(hub, book, max_subscriptions=1)
    with pytest.raises(UnknownTask):
        await feed.subscribe("nope", 0)
    with pytest.raises(InvalidRequest):
        await feed.subscribe("t", -1)
    assert feed.subscriptions == {} and hub.stats()["subscriptions"] == 0
    reached, _ = gate(book, "resume")
    async with anyio.create_task_group() as tg:
        tg.start_soon(feed.subscribe, "t", 0)
        with anyio.fail_after(DEADLINE_S):
            await reached.wait()
        assert hub.stats()["subscriptions"] == 1
        tg.cancel_scope.cancel()
    assert feed.subscriptions == {} and hub.stats()["subscriptions"] == 0
    book.hooks.clear()
    await feed.subscribe("t", 0)
    with pytest.raises(InvalidRequest):
        await feed.subscribe("u", 0)
    await feed.subscribe("t", 0)  # the same task again replaces it
    assert hub.stats()["subscriptions"] == 1


@pytest.mark.parametrize("how", ["unsubscribe", "release"])
async def test_a_subscription_let_go_while_its_state_is_read_leaves_nothing(
    book: FakeBook, hub: Hub, how: str
) -> None:
    feed = Feed(hub, book)
    reached, release = gate(book, "resume")
    async with anyio.create_task_group() as tg:
        tg.start_soon(feed.subscribe, "t", 0)
        with anyio.fail_after(DEADLINE_S):
            await reached.wait()
        if how == "unsubscribe":
            feed.unsubscribe("t")
        else:
            feed.release()
        release.set()
    commit(book, hub, "t", 2)
    assert feed.subscriptions == {}
    assert hub.stats()["subscriptions"] == 0 and hub.stats()["pending_total"] == 0
    assert not feed.has_work()


async def test_release_and_idle(book: FakeBook, hub: Hub) -> None:
    feed, other = Feed(hub, book), Feed(hub, book)
    await feed.subscribe("t", 0)
    await feed.subscribe("u", 0)
    await other.subscribe("t", 0)
    stats = hub.stats()
    assert set(stats) == {
        "connections",
        "subscriptions",
        "tag_subscriptions",
        "pending_total",
        "pending_max",
        "control_max",
        "stream_backlog_max",
        "conflations",
        "catch_ups",
        "direct_writes",
        "outbox_max",
    }
    assert (stats["connections"], stats["subscriptions"]) == (2, 3)
    feed.unsubscribe("t")
    feed.unsubscribe("nope")
    assert hub.stats()["subscriptions"] == 2
    feed.release()
    other.release()
    other.release()
    assert (hub.stats()["connections"], hub.stats()["subscriptions"]) == (0, 0)
    with anyio.fail_after(DEADLINE_S):
        await hub.idle()


# --- control frames, the close, the watchdog ---------------------------------------------------------------


async def test_control_frames_are_bounded_and_a_reader_waits_for_room(book: FakeBook, hub: Hub) -> None:
    feed = Feed(hub, book, max_control=2)
    sub = await feed.subscribe("t", 0)  # its resume frame is queued: a pong must not overtake it
    error = error_frame("invalid-request", "no", "t")
    assert feed.send_control(PONG)
    assert feed.send_control(error)
    assert not feed.send_control(PONG)  # full: the reader waits for room
    assert hub.stats()["control_max"] == 2
    room = anyio.Event()

    async def wait_for_room() -> None:
        await feed.control_room()
        room.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait_for_room)
        got = await take(feed, 2)
        with anyio.fail_after(DEADLINE_S):
            await room.wait()
    assert got[0][0] is sub and got[0][1].type == "caught-up"
    assert got[1] == (None, PONG)
    assert await take(feed) == [(None, error)]
    await feed.control_room()  # room already: returns at once


@pytest.mark.parametrize("waiting", [False, True], ids=["with-frames-queued", "waiting-for-frames"])
async def test_shutdown_ends_every_feed_with_its_code(book: FakeBook, hub: Hub, waiting: bool) -> None:
    feeds = [Feed(hub, book) for _ in range(2)]
    for feed in feeds:
        await feed.subscribe("t", 0)
        if waiting:
            await take(feed)
    results: list[object] = []
    async with anyio.create_task_group() as tg:
        if waiting:

            async def wait_next(feed: Feed) -> None:
                results.append(await feed.next())

            for feed in feeds:
                tg.start_soon(wait_next, feed)
            await anyio.wait_all_tasks_blocked()
        hub.shutdown(1001)
    with anyio.fail_after(DEADLINE_S):
        results += [await feed.next() for feed in feeds]
    assert results == [None] * len(results)
    assert [feed.close_code for feed in feeds] == [1001, 1001]
    hub.shutdown(4000)
    assert [feed.close_code for feed in feeds] == [1001, 1001]  # the first close code stays


async def test_the_watchdog_closes_only_a_feed_stuck_in_one_send_with_4008(book: FakeBook, hub: Hub) -> None:
    stuck, writing, idle = (Feed(hub, book) for _ in range(3))
    stalled: list[Feed] = []
    done = anyio.Event()

    def on_stall(feed: Feed) -> Callable[[], None]:
        def stall() -> None:
            stalled.append(feed)
            done.set()

        return stall

    for feed in (stuck, writing, idle):
        feed.direct = FakeSocket()
        feed.on_stall = on_stall(feed)
    stuck.writing_since = time.monotonic() - 10  # one send for 10 s
    writing.writing_since = time.monotonic() + 60  # a send that has just begun
    async with anyio.create_task_group() as tg:
        tg.start_soon(hub.watch_writes, 0.2)
        with anyio.fail_after(DEADLINE_S):
            await done.wait()
        tg.cancel_scope.cancel()
    assert stalled == [stuck]
    assert stuck.close_code == CLOSE_SLOW_CONSUMER
    assert stuck.writing_since is None and stuck.direct is None
    assert writing.close_code is None and idle.close_code is None
    with anyio.fail_after(DEADLINE_S):
        assert await stuck.next() is None
