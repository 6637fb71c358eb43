"""The hub: the asyncio driver of the fan-out core (``gateway.live.fanout``, ``gateway.live.peer``).

The core decides, this module does: it makes the store reads the core asks for, writes the bytes it hands
out, and keeps time. A callback is answered as soon as it is committed, whatever its subscribers do, so
fan-out never holds the event loop for long and yields to callbacks:

- every committed entry reaches :meth:`Hub.receive` through the bus (``gateway.bus``), which never waits;
  the entry's round is offered to its subscriptions from the loop, :data:`FLUSH_SLICE_S` at a time, and not
  while callbacks are being answered (one slice every :data:`FLUSH_MAX_PAUSE_S` at least, so that fan-out
  always progresses): fan-out is shed (several entries in one write, or a conflated snapshot), never
  callbacks;
- a round's bytes go straight to every WebSocket whose buffer has room, as ``websockets``' ``broadcast()``
  does; only a socket that is full takes its connection's queue and writer task
  (``gateway.live.feed.Feed``);
- :meth:`Hub.run`, one task owned by the lifespan, makes the reads a channel needs after a version jump,
  a bare wake-up or a reconnect of the bus, one at a time; each connection's writer makes its own;
- :meth:`Hub.watch_writes`, one timer for all sockets, closes a connection stuck in one send (``4008``) and
  one held to having a subscription that has held none for its deadline (``4408``).

Tag subscriptions (``gateway.live.tagging``) ride on the same: news of a task created with tags comes on the
bus too (:meth:`Hub.receive`), and :meth:`Hub.reconcile` also lists the watched tags again for a creation
whose news was lost.

The store is reached through :class:`BookReads`, the four reads of ``gateway.book.Book`` this needs, and
:class:`TagStore`, the three of ``gateway.book.tag_reads.TagReads``, so that tests drive the hub with an
in-memory book.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import anyio

from gateway.bus.base import News
from gateway.errors import (
    CLOSE_INTERNAL_ERROR,
    GatewayError,
    one_line,
)
from gateway.live.beside_delivery import BesideStore, check_besides, deliver_beside, read_beside
from gateway.live.fanout import Channel, Entries, Fanout, NeedTask, Peer, Read, Subscription, TagSub
from gateway.live.streaming import DirectWriter, StreamStore, check_streams, deliver
from gateway.live.tagging import NEW, Tagging
from gateway.machine import Resume, Task

__all__ = ["BookReads", "Connection", "DirectWriter", "Hub", "StreamStore", "TagStore"]

log = logging.getLogger("gateway.hub")

# The task ids of one reconcile query; the tags of one query of the tags' reconcile.
RECONCILE_CHUNK = 1000
RECONCILE_TAGS_CHUNK = 500
# Fan-out holds the event loop for at most this long at a time (then callbacks and the rest run: a callback
# read or committed meanwhile waits at most this long for its turn; 1 ms costs one more turn of the loop
# per 100 sockets or so), checking the clock every so many subscriptions.
FLUSH_SLICE_S = 0.001
FLUSH_CHECK_EVERY = 32
# While callbacks are being answered, fan-out looks again this often, and takes a slice at least this
# often whatever the callbacks (so that it always progresses, at a tenth of the loop at the least).
FLUSH_YIELD_S = 0.005
FLUSH_MAX_PAUSE_S = 0.05


class BookReads(Protocol):
    """The reads of the store the hub and its feeds make (``gateway.book.Book`` has them)."""

    async def get(self, task_id: str) -> Task: ...

    async def resume(self, task_id: str, cursor: int, epoch: str | None = None) -> Resume: ...

    async def entries_between(self, task_id: str, after: int, upto: int) -> Entries: ...

    async def ahead(self, known: Mapping[str, int]) -> dict[str, int]: ...


class TagStore(Protocol):
    """The reads of tags the hub and its feeds make (``gateway.book.tag_reads.TagReads`` has them)."""

    async def resume_many(
        self, cursors: Mapping[str, int], epochs: Mapping[str, str] | None = None
    ) -> dict[str, Resume]: ...

    async def tagged_since(
        self, tags: Sequence[str], since_ms: int
    ) -> builtins.list[tuple[str, str, str]]: ...

    async def list(self, tag: str, limit: int) -> tuple[builtins.list[str], bool]: ...


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class Connection(Protocol):
    """What the hub does with a connection (``gateway.live.feed.Feed``): writes straight to its socket,
    wakes its writer, closes it."""

    peer: Peer[Connection]
    # Where its socket takes direct writes now; None for SSE, in tests, and once it is cut.
    writer: DirectWriter | None

    def signal(self) -> None:
        """There is work for its writer."""

    def close(self, code: int) -> None: ...

    def finished(self, sub: Subscription[Connection]) -> None:
        """``sub``'s terminal entry was written to its socket directly: end it, as its writer does after
        sending one."""

    def stall(self) -> None:
        """The watchdog cut it (``4008``): cancel its stuck send."""

    def close_idle(self) -> None:
        """It held no subscription for its deadline: say so and close (``4408``)."""


class _Flush:
    """A channel's place in the loop: whether its fan-out is scheduled, and when it last took a slice."""

    __slots__ = ("channel", "flushing", "sliced_at")

    def __init__(self, channel: Channel[Connection]) -> None:
        self.channel = channel
        self.flushing = False
        self.sliced_at = 0.0


class Hub:
    """Subscriptions by task, fed by the bus; reads the store once per task to fill what the bus missed."""

    def __init__(
        self,
        book: BookReads,
        *,
        slice_s: float = FLUSH_SLICE_S,
        check_every: int = FLUSH_CHECK_EVERY,
        yield_s: float = FLUSH_YIELD_S,
        max_pause_s: float = FLUSH_MAX_PAUSE_S,
        clock: Callable[[], float] = time.perf_counter,
        monotonic: Callable[[], float] = time.monotonic,
        tags: TagStore | None = None,
        wall: Callable[[], int] = wall_clock_ms,
        streams: StreamStore | None = None,
        besides: BesideStore | None = None,
    ) -> None:
        """``clock`` times the flush slices; ``monotonic`` is the connections' clock, the one their deadlines
        are measured on (a send that makes no progress, a socket held to having a subscription): read by
        the watchdog and by the endpoints that start those deadlines (tests set it to move time by hand).
        ``tags`` reads tags (none: no tag subscription); ``wall`` is the clock tasks are created by
        (milliseconds, the book's), that the tags' reconcile compares creation times with; ``streams`` reads
        streams (none: no subscription asks for one); ``besides`` the state beside the history (none: only
        what the bus brings)."""
        self.book = book
        self.tags = tags
        self.streams = streams
        self.besides = besides
        self._beside_reads: dict[str, None] = {}  # bare wake-ups of a change beside the history, to read
        self.wall = wall
        self.monotonic = monotonic
        self.fanout: Fanout[Connection] = Fanout()
        self.tagging: Tagging[Connection] = Tagging(self.fanout)
        self.feeds: set[Connection] = set()
        # The connections the watchdog looks at: those that began a send, or were held to having a
        # subscription (:meth:`watch`); it lets go of those with neither. Not every connection: a sweep of
        # every socket each second cost as much as their keepalive pings (bench/hundredk.py).
        self.watched: set[Connection] = set()
        self.conflations = 0
        self.catch_ups = 0
        self.direct_writes = 0
        self._slice_s = slice_s
        self._check_every = check_every
        self._yield_s = yield_s
        self._max_pause_s = max_pause_s
        self._clock = clock
        self._flushes: dict[str, _Flush] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._resync = False
        self._wakeup = asyncio.Event()
        # Whether callbacks are being answered now (the app counts them); fan-out yields to them.
        self.callbacks_waiting: Callable[[], bool] = lambda: False

    # --- news from the bus, and what it missed ---------------------------------------------------------

    def receive(self, news: News) -> None:
        """A committed entry, or a task created with tags, heard on the bus (this process's or another's).
        Never waits."""
        if news.run is not None:
            self.direct_writes += deliver(self.fanout, news.task_id, news.run)
            return
        if news.beside is not None:  # metadata, children counts (gateway.live.beside)
            if not news.beside.bare:
                self.direct_writes += deliver_beside(self.fanout, news.beside)
            elif self.besides is not None and news.task_id in self.fanout.channels:
                self._beside_reads[news.task_id] = None
                self._wakeup.set()
            return
        if news.created:
            self._flush_all(self.tagging.created(news.read()))
            return
        # No subscriber here, or this process's own commit heard again: the message's task is not made.
        if self.fanout.wants(news.task_id, news.version):
            channel = self.fanout.receive(news.read())
            if channel is not None:
                self._flush_soon(channel)
        if self.fanout.reads_due:
            self._wakeup.set()

    def resync(self) -> None:
        """Messages may have been missed (the bus reconnected): check every task against the store."""
        self._resync = True
        self._wakeup.set()

    async def run(self, reconcile_s: float | None = None) -> None:
        """Make the reads the channels need; ``reconcile_s``: also compare every channel with the store that
        often (a shared bus can lose a message; a lost one is then late by at most this)."""
        next_check = None if reconcile_s is None else time.monotonic() + reconcile_s
        self.tagging.reconciled = reconcile_s is not None
        while True:
            timeout = None if next_check is None else max(0.0, next_check - time.monotonic())
            with anyio.move_on_after(timeout):
                await self._wakeup.wait()
            self._wakeup.clear()
            try:
                if next_check is not None and time.monotonic() >= next_check:
                    self._resync = True
                    assert reconcile_s is not None
                    next_check = time.monotonic() + reconcile_s
                if self._resync:
                    self._resync = False
                    await self.reconcile()
                while (read := self.fanout.next_read()) is not None:
                    await self._catch_up(read)
                while self._beside_reads and self.besides is not None:
                    task_id = next(iter(self._beside_reads))
                    self.direct_writes += await read_beside(self.fanout, self.besides, task_id)
                    del self._beside_reads[task_id]
            except Exception as exc:  # a database outage: the next wake-up or check tries again
                log.warning("hub: cannot read the store to catch up (%s)", one_line(exc))
                self._resync = True
                await anyio.sleep(0.5)
                self._wakeup.set()

    async def reconcile(self) -> None:
        """Compare every channel's version with the store's, in one query per chunk of tasks that sends back
        only the tasks ahead (the database compares: most of them are not, and cost no row); then list the
        watched tags' tasks created since the horizon again, in one query per chunk of tags, and announce
        those some subscription did not hear of (their state read in one query)."""
        # No (id, version) tuple per channel: a list of thousands of them took 3% of a worker's samples at
        # 100,000 subscribers (py-spy), most likely the cyclic collector, which counts tuples, not ints.
        known = self.fanout.known()
        ids = list(known)
        for start in range(0, len(ids), RECONCILE_CHUNK):
            chunk = {task_id: known[task_id] for task_id in ids[start : start + RECONCILE_CHUNK]}
            self.fanout.behind(await self.book.ahead(chunk))
        if self.streams is not None:  # the streams' offsets too: an append's message may have been lost
            await check_streams(self.fanout, self.streams)
        if self.besides is not None:  # and the revisions: a change beside the history's message too
            self.direct_writes += await check_besides(self.fanout, self.besides)
        started = self.wall()
        check = self.tagging.checks()
        if check is not None and self.tags is not None:
            tags, since = check
            for start in range(0, len(tags), RECONCILE_TAGS_CHUNK):
                rows = await self.tags.tagged_since(tags[start : start + RECONCILE_TAGS_CHUNK], since)
                missing = self.tagging.unknown(rows)
                if missing:
                    resumes = await self.tags.resume_many(dict.fromkeys(missing, NEW))
                    self._flush_all(self.tagging.found(resume.task for resume in resumes.values()))
        self.tagging.checked(started)

    async def _catch_up(self, read: Read) -> None:
        self.catch_ups += 1
        try:
            if isinstance(read, NeedTask):
                try:
                    task = await self.book.get(read.task_id)
                except GatewayError:  # the task is gone: nothing to hand out
                    self.fanout.read_failed(read)
                    return
                channel = self.fanout.task_read(read, task)
            else:
                entries = await self.book.entries_between(read.task_id, read.after, read.upto)
                channel = self.fanout.entries_read(read, entries)
        except BaseException:
            self.fanout.read_failed(read)
            raise
        if channel is not None:
            self._flush_soon(channel)

    # --- fan-out rounds -------------------------------------------------------------------------------

    def _flush_all(self, channels: Iterable[Channel[Connection]]) -> None:
        """Flush these channels soon, and wake the writers of the connections that got announcements."""
        for channel in channels:
            self._flush_soon(channel)
        for peer in self.tagging.take_woken():
            peer.handle.signal()

    def _flush_soon(self, channel: Channel[Connection]) -> None:
        flush = self._flushes.get(channel.task_id)
        if flush is None or flush.channel is not channel:
            flush = self._flushes[channel.task_id] = _Flush(channel)
        if not flush.flushing:
            flush.flushing = True
            asyncio.get_running_loop().call_soon(self.flush, flush)

    def flush(self, flush: _Flush) -> None:
        """Offer a channel's round to its subscriptions, a slice of at most ``slice_s`` at a time."""
        loop = asyncio.get_running_loop()
        now = self._clock()
        if self.callbacks_waiting() and now - flush.sliced_at < self._max_pause_s:
            # Callbacks first: the entries that pile up meanwhile go out together in the next round.
            loop.call_later(self._yield_s, self.flush, flush)
            return
        flush.sliced_at = now
        channel = flush.channel
        fan_round = channel.next_round()
        if fan_round is None:
            flush.flushing = False
            self._forget(channel.task_id)
            return
        subscriptions = fan_round.subscriptions
        done = fan_round.done
        count = len(subscriptions)
        deadline = now + self._slice_s
        check_every = self._check_every
        clock = self._clock
        while done < count:
            sub = subscriptions[done]
            done += 1
            if sub.active:
                try:
                    data = fan_round.offer(sub)
                    if data is not None:
                        # The fast path: nothing of this connection is queued or in flight: if its socket
                        # has room the bytes go out now, with no wake-up of its writer.
                        writer = sub.peer.handle.writer
                        if writer is not None and writer.can_write(len(data)):
                            writer.write(data)
                            if fan_round.sent(sub):
                                sub.peer.handle.finished(sub)
                        else:
                            fan_round.full(sub)
                except Exception:  # never leave the task's fan-out stuck: this connection starts over
                    log.exception("hub: offering %s to a subscription failed; closing it", sub.task_id)
                    sub.peer.handle.close(CLOSE_INTERNAL_ERROR)
            if done % check_every == 0 and clock() >= deadline:
                break
        fan_round.done = done
        direct_writes, conflations = fan_round.take_counts()
        self.direct_writes += direct_writes
        self.conflations += conflations
        for peer in fan_round.woken:
            peer.handle.signal()
        fan_round.woken.clear()
        loop.call_soon(self.flush, flush)

    def _forget(self, task_id: str) -> None:
        """Drop the loop's state of a channel that is gone, unless its fan-out is still scheduled."""
        flush = self._flushes.get(task_id)
        if flush is None or flush.flushing:
            return
        if self.fanout.channels.get(task_id) is not flush.channel:
            del self._flushes[task_id]

    # --- connections and subscriptions ------------------------------------------------------------------

    def resumed(self, sub: Subscription[Connection], resume: Resume) -> None:
        channel = self.fanout.resumed(sub, resume)
        if channel is not None:
            self._flush_soon(channel)

    def remove(self, sub: Subscription[Connection]) -> None:
        self.fanout.remove(sub)
        self._forget(sub.task_id)
        self._let_go(sub.peer)

    # --- tag subscriptions: subscribe, buffer, read, merge (gateway.live.tagging) ----------------------

    def subscribe_tag(self, peer: Peer[Connection], tag: str) -> TagSub[Connection]:
        """Step 1: the tag subscription, replacing the connection's earlier one to ``tag``."""
        tag_sub, replaced = self.tagging.subscribe(peer, tag, self.wall())
        self._removed(peer, replaced)
        return tag_sub

    def tag_resumed(
        self,
        tag_sub: TagSub[Connection],
        task_ids: Sequence[str],
        more: bool,
        resumes: Mapping[str, Resume],
        cursors: Mapping[str, int],
    ) -> None:
        """Step 5: the tag frame, the resume frames and the announcements of what was created meanwhile."""
        channels, gone = self.tagging.resumed(tag_sub, task_ids, more, resumes, cursors)
        self._flush_all(channels)
        self._removed(tag_sub.peer, gone)

    def unsubscribe_task(self, peer: Peer[Connection], task_id: str) -> None:
        """A client's unsubscribe of a task by its id; a tag of the connection that lists it streams it on."""
        sub = self.tagging.unsubscribe_task(peer, task_id)
        if sub is not None:
            self._removed(peer, [sub])

    def drop_tag(self, tag_sub: TagSub[Connection]) -> None:
        """End a tag subscription and the streams it owns."""
        self._removed(tag_sub.peer, self.tagging.drop(tag_sub))

    def _removed(self, peer: Peer[Connection], subs: Sequence[Subscription[Connection]]) -> None:
        for sub in subs:
            self._forget(sub.task_id)
        self._let_go(peer)

    def _let_go(self, peer: Peer[Connection]) -> None:
        """A subscription of ``peer`` ended: its deadline may run again, for the watchdog to look at."""
        peer.let_go(self.monotonic())
        if peer.idle_since is not None:
            self.watch(peer.handle)

    def stats(self) -> dict[str, int]:
        """Queue sizes, so that tests and metrics can see that memory stays bounded."""
        channels = self.fanout.channels.values()
        subscriptions = [s for c in channels for s in c.subscriptions]
        return {
            "connections": len(self.feeds),
            "subscriptions": len(subscriptions),
            "tag_subscriptions": sum(len(subs) for subs in self.tagging.watched.values()),
            "pending_total": sum(len(s.pending or ()) for s in subscriptions),
            "pending_max": max((len(s.pending or ()) for s in subscriptions), default=0),
            "control_max": max((len(f.peer.control or ()) for f in self.feeds), default=0),
            "stream_backlog_max": max((f.peer.stream_backlog for f in self.feeds), default=0),
            # Gaps too long to fill are counted by each connection; a closed one's count is kept here.
            "conflations": self.conflations + sum(f.peer.conflations for f in self.feeds),
            "catch_ups": self.catch_ups,
            "direct_writes": self.direct_writes,
            "outbox_max": max((len(c.outbox) for c in channels), default=0),
        }

    def attach(self, feed: Connection) -> None:
        self.feeds.add(feed)
        self._idle.clear()

    def detach(self, feed: Connection) -> None:
        self.watched.discard(feed)
        if feed in self.feeds:
            self.feeds.discard(feed)
            self.conflations += feed.peer.conflations
            feed.peer.conflations = 0
        if not self.feeds:
            self._idle.set()

    async def idle(self) -> None:
        """Wait until no connection is left."""
        await self._idle.wait()

    def watch(self, feed: Connection) -> None:
        """The watchdog looks at ``feed`` from now on: it began a send, or is held to having a subscription
        (``Feed`` says so); it stops once the connection has neither, or is detached."""
        if feed in self.feeds:
            self.watched.add(feed)

    async def watch_writes(self, timeout_s: float) -> None:
        """Close every connection whose send has made no progress for ``timeout_s`` (``4008``), and every one
        held to having a subscription that has held none for its deadline (``4408``). Only the connections
        :meth:`watch` named are looked at."""
        while True:
            await asyncio.sleep(min(1.0, timeout_s / 4))
            now = self.monotonic()
            for feed in tuple(self.watched):
                peer = feed.peer
                if peer.stalled(now, timeout_s):
                    feed.stall()
                elif peer.idle_overdue(now):
                    feed.close_idle()
                if peer.writing_since is None and peer.idle_since is None:
                    self.watched.discard(feed)  # in no send, held to nothing: nothing to look at

    def shutdown(self, code: int) -> None:
        for feed in tuple(self.feeds):
            feed.close(code)
