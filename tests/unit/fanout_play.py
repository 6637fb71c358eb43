"""Plays the hub's part around the pure fan-out core, in plain calls: no event loop, no socket.

:class:`Play` holds a :class:`~tests.unit.fake_book.FakeBook` (the store), a
:class:`~gateway.live.fanout.Fanout` and the sockets of its connections, and does what
``gateway.live.hub`` does with them: hands committed entries to the core as the bus would, offers rounds,
writes the bytes a round gives to a socket that has room (and says ``full`` for one that has none), drains
a connection's writer and answers the reads the core asks for from the book. Every frame a client receives,
by either way, lands in ``got[subscription]``, where :func:`check_stream` holds it to protocol.md.

Tag subscriptions too (``gateway.live.tagging``): :meth:`Play.create` makes a task and hands the news of
its creation to the core as the bus would, :meth:`Play.subscribe_tag` plays a tag's subscribe (subscribe,
list, subscribe the listed tasks, read, merge) at once, and :class:`Client` checks every frame one
connection receives, tasks and tags alike.

Also the checks themselves: :func:`parse` (a frame against protocol.md's table of server frames),
:func:`check_resume`, :func:`check_event`, :func:`check_stream`, and :func:`unframe` (WebSocket bytes back
to frames, as a client reads them).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import orjson

from gateway.bus.base import News
from gateway.frames import Frame, event_frame
from gateway.live.fanout import Channel, Fanout, NeedTask, Peer, Subscription, TagSub
from gateway.live.published import NeedEntries, PeerRead
from gateway.live.tagging import NEW, Tagging
from gateway.machine import Event, Task, event_to_json, resume_mode, task_to_json
from tests.unit.fake_book import RETENTION, Committed, FakeBook

BACKLOG = 4

FIELDS = {
    "caught-up": {"type", "taskId", "version", "task"},
    "delta": {"type", "taskId", "version", "events", "task"},
    "snapshot": {"type", "taskId", "version", "task", "reason"},
    "event": {"type", "taskId", "version", "event", "task"},
}
RESUME_TYPES = ("caught-up", "delta", "snapshot")


class Play:
    """The hub's part, synchronously: see the module's docstring."""

    def __init__(self, book: FakeBook | None = None) -> None:
        self.book = book if book is not None else FakeBook()
        self.fan: Fanout[str] = Fanout()
        self.tagging: Tagging[str] = Tagging(self.fan)
        self.got: defaultdict[Subscription[str], list[Frame]] = defaultdict(list)
        self.room: dict[Peer[str], bool] = {}  # a direct socket's: whether it takes a write now
        self.writes: dict[Peer[str], list[bytes]] = {}  # what was written straight to each socket
        self.direct_writes = 0
        self.conflations = 0
        self.woken: list[Peer[str]] = []
        # Subscriptions whose stream a direct write ended (the driver ends them: ``Round.sent``).
        self.ended: list[Subscription[str]] = []
        self._names = 0

    # --- connections ----------------------------------------------------------------------------------

    def connect(self, *, direct: bool = False, backlog: int = 256, **limits: int) -> Peer[str]:
        self._names += 1
        peer = Peer(f"c{self._names}", backlog=backlog, **limits)
        if direct:
            peer.direct = True
            self.room[peer] = True
            self.writes[peer] = []
        return peer

    def subscribe(self, peer: Peer[str], task_id: str, cursor: int) -> Subscription[str]:
        """Subscribe and read the resume state at once (``resumed`` separately: the state read later)."""
        sub = self.fan.subscribe(peer, task_id)
        self.resumed(sub, cursor)
        return sub

    def resumed(self, sub: Subscription[str], cursor: int, *, as_of: int | None = None) -> None:
        """The resume read of ``sub``: now, or as it was when the task was at version ``as_of``."""
        try:
            resume = self.book.resume_now(sub.task_id, cursor, as_of=as_of)
        except Exception:
            self.fan.remove(sub)
            raise
        self.flush(self.fan.resumed(sub, resume))

    # --- tags ------------------------------------------------------------------------------------------

    def create(self, task_id: str, tags: Sequence[str] = (), *, publish: bool = True) -> Task:
        """A task created now (the book's clock, moved on by 1 ms), and the news of it (or none: lost)."""
        self.book.clock += 1
        task = self.book.create(task_id, tags=tags)
        if publish:
            self.announce(task)
        return task

    def announce(self, task: Task) -> None:
        """The bus brings the news of ``task``'s creation."""
        for channel in self.tagging.created(News.creation(task)):
            self.flush(channel)

    def subscribe_tag(
        self, peer: Peer[str], tag: str, cursors: Mapping[str, int] | None = None, limit: int = 1000
    ) -> TagSub[str]:
        """A tag's subscribe played at once: subscribe, list, subscribe the listed tasks, read, merge."""
        tag_sub, _ = self.tagging.subscribe(peer, tag, self.book.clock)
        task_ids, more = self.book.list_now(tag, limit)
        self.tagging.listed(tag_sub, task_ids)
        self.tag_resumed(tag_sub, task_ids, more, cursors or {})
        return tag_sub

    def tag_resumed(
        self, tag_sub: TagSub[str], task_ids: Sequence[str], more: bool, cursors: Mapping[str, int]
    ) -> list[Subscription[str]]:
        """The read of the listed tasks (step 4, now) and the merge; returns the subscriptions removed."""
        wanted = {task_id: cursors.get(task_id, NEW) for task_id in task_ids}
        resumes = self.book.resume_many_now(wanted) if wanted else {}
        channels, gone = self.tagging.resumed(tag_sub, task_ids, more, resumes, cursors)
        for channel in channels:
            self.flush(channel)
        return gone

    def reconcile(self) -> None:
        """The periodic check of the tags, its reads answered at once."""
        started = self.book.clock
        check = self.tagging.checks()
        if check is not None:
            rows = self.book.tagged_since_now(*check)
            missing = self.tagging.unknown(rows)
            if missing:
                resumes = self.book.resume_many_now(dict.fromkeys(missing, NEW))
                for channel in self.tagging.found(resume.task for resume in resumes.values()):
                    self.flush(channel)
        self.tagging.checked(started)

    # --- the bus ----------------------------------------------------------------------------------------

    def commit(self, task_id: str, event: Event | None = None, *, publish: bool = True) -> Committed:
        committed = self.book.commit(task_id, event)
        if publish:
            self.publish(committed)
        return committed

    def commit_many(self, task_id: str, n: int, *, publish: bool = True) -> list[Committed]:
        return [self.commit(task_id, publish=publish) for _ in range(n)]

    def publish(self, *committed: Committed) -> None:
        for c in committed:
            self.receive(news(c))

    def receive(self, message: News) -> None:
        self.flush(self.fan.receive(message))

    # --- the loop's work: rounds, catch-up reads, writers ----------------------------------------------

    def flush(self, channel: Channel[str] | None, slice_size: int | None = None) -> None:
        """Offer the channel's rounds to its subscriptions (all of them, or one slice of ``slice_size``)."""
        if channel is None:
            return
        while (fan_round := channel.next_round()) is not None:
            subs = fan_round.subscriptions
            stop = len(subs) if slice_size is None else min(len(subs), fan_round.done + slice_size)
            for sub in subs[fan_round.done : stop]:
                if not sub.active:
                    continue
                data = fan_round.offer(sub)
                if data is None:
                    continue
                if self.room.get(sub.peer, False):
                    self.writes[sub.peer].append(data)
                    self.got[sub].extend(unframe_all(data))
                    if fan_round.sent(sub):
                        self.ended.append(sub)
                else:
                    fan_round.full(sub)
            fan_round.done = stop
            direct_writes, conflations = fan_round.take_counts()
            self.direct_writes += direct_writes
            self.conflations += conflations
            self.woken += fan_round.woken
            fan_round.woken.clear()
            if slice_size is not None:
                return

    def catch_up(self) -> None:
        """Make every read the channels ask for, at once."""
        while (read := self.fan.next_read()) is not None:
            if isinstance(read, NeedTask):
                self.flush(self.fan.task_read(read, self.book.get_now(read.task_id)))
            else:
                entries = self.book.entries_now(read.task_id, read.after, read.upto)
                self.flush(self.fan.entries_read(read, entries))

    def take(self, peer: Peer[str], n: int | None = None) -> list[tuple[Subscription[str] | None, Frame]]:
        """What the connection's writer sends next (up to ``n`` frames), its reads answered at once."""
        sent: list[tuple[Subscription[str] | None, Frame]] = []
        while n is None or len(sent) < n:
            step = peer.next()
            if step is None:
                break
            if isinstance(step, tuple):
                sub, frame = step
                if sub is not None:
                    self.got[sub].append(frame)
                sent.append(step)
            else:
                self.answer(peer, step)
        return sent

    def frames(self, peer: Peer[str], n: int | None = None) -> list[Frame]:
        return [frame for _, frame in self.take(peer, n)]

    def answer(self, peer: Peer[str], read: PeerRead) -> None:
        if isinstance(read, NeedTask):
            peer.task_read(read, self.book.get_now(read.task_id))
        else:
            assert isinstance(read, NeedEntries), "no streams here"
            peer.entries_read(read, self.book.entries_now(read.task_id, read.after, read.upto))

    def reads(self, kind: str) -> list[tuple[str, str, int, int]]:
        return [call for call in self.book.calls if call[0] == kind]

    def stats(self) -> dict[str, int]:
        subs = [s for c in self.fan.channels.values() for s in c.subscriptions]
        return {
            "subscriptions": len(subs),
            "pending_total": sum(len(s.pending or ()) for s in subs),
            "pending_max": max((len(s.pending or ()) for s in subs), default=0),
        }


def news(committed: Committed) -> News:
    return News.of(committed.task, event_frame(committed.task, committed.encoded))


# --- WebSocket bytes, as a client reads them --------------------------------------------------------------


def _frames_of(data: bytes) -> Iterator[bytes]:
    while data:
        n, at = data[1], 2
        if n == 126:
            n, at = int.from_bytes(data[2:4]), 4
        elif n == 127:
            n, at = int.from_bytes(data[2:10]), 10
        yield data[: at + n]
        data = data[at + n :]


def unframe(data: bytes) -> Frame:
    """A server's unmasked text frame back to its JSON (RFC 6455 5.2)."""
    assert data[0] == 0x81 and not data[1] & 0x80  # FIN + text, unmasked
    n, at = data[1], 2
    if n == 126:
        n, at = int.from_bytes(data[2:4]), 4
    elif n == 127:
        n, at = int.from_bytes(data[2:10]), 10
    assert len(data) == at + n
    body = orjson.loads(data[at:])
    return Frame(body["type"], body.get("version", -1), data[at:].decode())  # a chunks frame has none


def unframe_all(data: bytes) -> list[Frame]:
    """One write may carry several frames (a round's entries for one socket)."""
    return [unframe(one) for one in _frames_of(data)]


# --- protocol.md's frames ---------------------------------------------------------------------------------


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


def check_resume(book: FakeBook, task_id: str, frame: Frame, cursor: int, retention: int = RETENTION) -> int:
    """A resume frame for ``cursor``: the mode protocol.md's Resuming chooses at its version; returns the
    version."""
    body = parse(frame)
    assert body["type"] in RESUME_TYPES, body
    assert body["taskId"] == task_id
    version = body["version"]
    assert body["task"] == task_to_json(book.state_at(task_id, version))
    mode, reason = resume_mode(version, cursor, retention)
    assert body["type"] == mode, (body, cursor)
    assert body.get("reason") == reason, (body, cursor)
    if mode == "delta":
        assert [e["version"] for e in body["events"]] == list(range(cursor + 1, version + 1))
        for e in body["events"]:
            assert e["event"] == orjson.loads(book.entry_at(task_id, e["version"]))
    return int(version)


def check_stream(
    book: FakeBook, task_id: str, cursor: int, stream: list[Frame], retention: int = RETENTION
) -> int:
    """One subscription's frames: the resume frame, then a contiguous sequence (conflated snapshots
    allowed) of exact states; returns the version the client holds at the end."""
    assert stream, "no resume frame"
    last = check_resume(book, task_id, stream[0], cursor, retention)
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


class Client:
    """What the client of one connection holds, fed every frame it receives in order, each checked against
    protocol.md: per task, its resume frame first (a task's subscribe, or a ``tag`` frame listing it: from
    the client's cursor, or ``snapshot`` ``new`` for a task not in its map), or after an ``added`` frame its
    ``snapshot`` ``new``; then ``event`` frames with no gap, no repeat, each the exact entry and the task
    after it, a ``conflated`` snapshot the only jump. ``cursors`` is the map it holds (and would send on a
    reconnect), kept up to date; a listed task's resume frame is checked against the map sent with the
    tag's subscribe (:meth:`subscribing_tag`; else ``cursors`` as it was made), unless the client
    subscribed to the task by its id since. An ``added`` frame for a task whose resume frame is awaited
    (another subscription of the connection took the task over) is followed by that resume frame or by
    the announcement's snapshot."""

    def __init__(self, book: FakeBook, cursors: Mapping[str, int] | None = None) -> None:
        self.book = book
        self.cursors: dict[str, int] = dict(cursors or {})
        self.held: dict[str, int] = {}  # the version held of each task streamed on this connection
        self.expect: dict[str, str] = {}  # the next frame of a task: "resume" (listed) or "new" (added)
        self.listed: dict[str, list[str]] = {}  # the last tag frame of each tag
        self.more: dict[str, bool] = {}
        self.added: list[tuple[str, str]] = []
        self.bodies: list[dict[str, Any]] = []
        self.sent: dict[str, list[tuple[int, dict[str, int]]]] = {}  # per tag, the maps sent, in order
        self.resume_from: dict[str, int | None] = {}  # a listed task's cursor as sent (None: not sent)
        self.messages = 0  # subscribes sent
        self.subscribed_at: dict[str, int] = {}  # the last subscribe of each task by its id

    def subscribing(self, task_id: str) -> None:
        """The client sent a task's subscribe (with ``cursors[task_id]``, or 0): its resume frame is next."""
        self.cursors.setdefault(task_id, 0)
        self.expect[task_id] = "resume"
        self.resume_from[task_id] = self.cursors[task_id]
        self.messages += 1
        self.subscribed_at[task_id] = self.messages

    def subscribing_tag(self, tag: str) -> dict[str, int]:
        """The client sends a tag's subscribe with its map as it is now (returned): its tag frame will list
        the tasks whose resume frames follow, from that map."""
        sent = dict(self.cursors)
        self.messages += 1
        self.sent.setdefault(tag, []).append((self.messages, sent))
        return sent

    def feed(self, frames: Sequence[Frame]) -> list[dict[str, Any]]:
        return [self.feed_one(frame) for frame in frames]

    def feed_one(self, frame: Frame) -> dict[str, Any]:
        body: dict[str, Any] = orjson.loads(frame.text)
        self.bodies.append(body)
        kind = body["type"]
        if kind == "tag":
            assert set(body) == {"type", "tag", "taskIds", "more"}, body
            self.listed[body["tag"]], self.more[body["tag"]] = body["taskIds"], body["more"]
            at, sent = self.sent[body["tag"]].pop(0) if self.sent.get(body["tag"]) else (0, self.cursors)
            for task_id in body["taskIds"]:
                if self.subscribed_at.get(task_id, -1) > at:
                    continue  # subscribed to by its id since: that resume frame is the one to come
                self.expect[task_id] = "resume"
                self.resume_from[task_id] = sent.get(task_id)
            return body
        if kind == "added":
            assert set(body) == {"type", "tag", "taskId"}, body
            assert frame.type == "added"
            self.added.append((body["tag"], body["taskId"]))
            self.expect[body["taskId"]] = "either" if self.expect.get(body["taskId"]) else "new"
            return body
        if kind in ("pong", "error"):
            return body
        body = parse(frame)
        task_id, version = body["taskId"], body["version"]
        assert body["task"] == task_to_json(self.book.state_at(task_id, version)), body
        expect = self.expect.pop(task_id, None)
        cursor = self.resume_from.pop(task_id, None) if expect in ("resume", "either") else None
        if expect == "either" and body.get("reason") == "new":
            expect = "new"
        if expect == "new" or (expect in ("resume", "either") and cursor is None):
            assert (kind, body.get("reason")) == ("snapshot", "new"), (expect, body)
        elif expect in ("resume", "either"):
            assert cursor is not None
            check_resume(self.book, task_id, frame, cursor, self.book.retention_versions)
        elif kind == "snapshot":
            assert task_id in self.held, body
            assert body["reason"] == "conflated" and version > self.held[task_id], (self.held, body)
        else:
            assert task_id in self.held, body
            check_event(self.book, task_id, frame, self.held[task_id] + 1)
        self.held[task_id] = self.cursors[task_id] = version
        return body
