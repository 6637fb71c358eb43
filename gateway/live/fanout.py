"""The fan-out core: which entries each subscriber gets, decided without I/O.

The order protocol.md promises (a resume frame, then every version once, in order, a ``conflated`` snapshot
the only jump) depends on interleavings: a message arriving while a resume read is in flight, a read answered
after more commits, a socket that fills up in the middle of a round. Here those decisions take values in
and hand values out, as websockets' ``protocol.py`` does for its frames, so that a test can play any
interleaving as plain calls; ``gateway.live.hub`` is the asyncio driver that makes the reads, the writes and
the timing. One connection's side of it is ``gateway.live.peer``.

In: committed entries or bare "version V exists" wake-ups (:meth:`Fanout.receive`), resume answers
(:meth:`Fanout.resumed`), store reads answered (``task_read``, ``entries_read``), whether a socket took a
direct write (:meth:`Round.sent`, :meth:`Round.full`). Out: bytes to write straight to a socket
(:meth:`Round.offer`), reads to make (:class:`NeedTask`, :class:`NeedEntries`), rounds due, and the counts
of what was decided (:meth:`Round.take_counts`).

Per task, a :class:`Channel` hands entries out in version order, whatever order the bus brings them in:
a message ahead of a missing version waits while the store is read, once for the task however many
subscribers it has, and a lost one is found by comparing versions with the store (:meth:`Fanout.behind`).
Entries handed out during a round form the next one, so when fan-out falls behind, each socket gets them
in one write, or past its backlog one snapshot: the work per entry shrinks as the load grows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from typing import Final, Generic, Protocol, TypeVar

from gateway.frames import Frame, event_frame, resume_frame
from gateway.live.peer import Peer, Subscription, TagSub
from gateway.live.published import Entries, NeedEntries, NeedTask, Published, Read, replay
from gateway.machine import RECREATED, TERMINAL, Resume, Task

__all__ = [
    "Channel",
    "Entries",
    "Fanout",
    "Message",
    "NeedEntries",
    "NeedTask",
    "Peer",
    "Published",
    "Read",
    "Round",
    "Subscription",
    "TagSub",
    "replay",
]

# Messages one channel keeps that arrived ahead of a missing version, while the store is read.
MAX_AHEAD: Final = 64
# ``upto`` of a read for every entry there is.
NEWEST: Final = 2**62

H = TypeVar("H")  # what the driver keeps with a connection (its socket, its writer): never looked at here


class Message(Protocol):
    """News of a committed entry (``gateway.bus.base.News`` is one): ``task`` and ``frame`` unless it is a
    bare wake-up, which says only that ``version`` exists. News of a task ``created`` is no entry: it is
    for the subscriptions of its tags (``gateway.live.tagging``)."""

    @property
    def task_id(self) -> str: ...
    @property
    def version(self) -> int: ...
    @property
    def task(self) -> Task | None: ...
    @property
    def frame(self) -> Frame | None: ...
    @property
    def created(self) -> bool: ...


class Round(Generic[H]):
    """One fan-out round of a channel: the entries handed out since the last round, offered to every
    subscription the channel had when it began. A round's entries go to each socket in one write, so the
    further fan-out falls behind, the less each entry costs; ``joined`` keeps those bytes by starting
    entry, shared by every socket at the same point."""

    __slots__ = (
        "conflations",
        "direct_writes",
        "done",
        "ends",
        "first",
        "items",
        "joined",
        "newest",
        "open",
        "subscriptions",
        "woken",
    )

    def __init__(self, subscriptions: tuple[Subscription[H], ...], items: list[Published]) -> None:
        self.subscriptions = subscriptions
        self.items = items
        self.first = items[0].task.version
        self.newest = items[-1].task
        # A round with an earlier history's end inside (the id made again) takes the writers' way.
        self.ends = self.newest.terminal  # the driver ends a stream it writes this to (:meth:`sent`)
        self.open = not any(item.task.terminal for item in items[:-1])
        self.done = 0  # subscriptions offered so far (the driver's slices)
        self.joined: dict[int, bytes] = {}
        self.direct_writes = 0
        self.conflations = 0
        self.woken: list[Peer[H]] = []  # connections that got work while idle: wake their writers

    def offer(self, sub: Subscription[H]) -> bytes | None:
        """The round's entries for ``sub``. Bytes: write them straight to its socket if it has room, then
        say :meth:`sent`, else :meth:`full`. ``None``: queued for its connection's writer, or nothing to
        do."""
        last = sub.last
        peer = sub.peer
        if (
            self.open
            and last is not None
            and peer.direct
            and sub.pending is None
            and sub.head is None
            and not sub.conflated
            and peer.quiet()
            # A terminal entry for a subscription with streams: its writer sends the streams' last chunks
            # and their end frames after it, then ends the stream.
            and not (self.ends and sub.streams is not None)
        ):
            items = self.items
            start = last.version + 1 - self.first
            if 0 <= start < len(items):
                if len(items) - start > sub.backlog:
                    # Fan-out fell this far behind: the newest state instead (one snapshot, framed once for
                    # the whole round), as a backlog past its bound would get; no store read.
                    return items[-1].conflated_wire
                if start == len(items) - 1:
                    return items[start].wire
                data = self.joined.get(start)
                if data is None:
                    data = self.joined[start] = b"".join(item.wire for item in items[start:])
                return data
        self.full(sub)
        return None

    def sent(self, sub: Subscription[H]) -> bool:
        """The bytes :meth:`offer` gave were written to the socket. ``True``: they ended the task, and the
        driver ends the stream as a writer does after a terminal frame (closes, or unsubscribes)."""
        assert sub.last is not None
        count = self.newest.version - sub.last.version
        if count > sub.backlog:
            self.conflations += 1
            self.direct_writes += 1
        else:
            self.direct_writes += count
        sub.last = self.newest
        return self.ends

    def full(self, sub: Subscription[H]) -> None:
        """The socket had no room: queue the entries for the connection's writer, within the backlog."""
        if sub.conflated:
            return
        pending = sub.pending
        if pending is None:
            pending = sub.pending = deque()
        for item in self.items:
            if len(pending) >= sub.backlog:
                sub.pending = None
                sub.conflated = True
                self.conflations += 1
                break
            pending.append(item)
        if sub.last is not None and sub.peer.wake(sub):
            self.woken.append(sub.peer)

    def take_counts(self) -> tuple[int, int]:
        """Direct writes (entries) and conflations since the last call."""
        counts = self.direct_writes, self.conflations
        self.direct_writes = self.conflations = 0
        return counts


class Channel(Generic[H]):
    """One task's live stream in this process: its subscriptions and the last state handed to them.

    Entries reach the subscriptions in version order with no gap: a message ahead of a missing version
    waits in ``ahead`` while the store is read, once for the task however many subscribers it has."""

    __slots__ = (
        "ahead",
        "base",
        "due",
        "last",
        "newest",
        "outbox",
        "reading",
        "recheck",
        "revision",
        "round",
        "subscriptions",
        "task_id",
    )

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        # In the order they subscribed (a dict, not a set: a set of these orders them by address, so a
        # round would offer its subscriptions in an order that changes from one run to the next).
        self.subscriptions: dict[Subscription[H], None] = {}
        # The last state handed out; None until a message or the subscriptions' resume states tell.
        self.last: Task | None = None
        self.ahead: dict[int, Message] = {}
        self.outbox: list[Published] = []  # handed out, not yet offered: the next round
        self.round: Round[H] | None = None
        self.due = False  # waiting for its turn to read the store
        self.recheck = False  # asked to read again while a read was under way
        self.reading: Read | None = None
        self.base: Task | None = None  # the state the entries being read follow on from
        self.newest: Task | None = None  # the stored task whose entry is being read (no state yet)
        self.revision = -1  # the newest state beside the history handed out (gateway.live.beside_delivery)

    @property
    def version(self) -> int:
        return -1 if self.last is None else self.last.version

    def hand_out(self, task: Task, frame: Frame) -> None:
        self.last = task
        self.outbox.append(Published(task, frame))

    def drain_ahead(self) -> None:
        ahead = self.ahead
        while ahead:
            message = ahead.pop(self.version + 1, None)
            if message is None:
                break
            assert message.task is not None and message.frame is not None
            self.hand_out(message.task, message.frame)
        for version in [v for v in ahead if v <= self.version]:
            del ahead[version]

    def seed(self, epoch: str) -> None:
        """Once every subscription has its resume state, the oldest of them is where a channel that has
        heard nothing yet stands (each subscription drops what it already has). Never newer: a subscription
        whose read was older would miss the entries in between, since only what follows is handed out. Only
        those of the history ``epoch`` (the one just resumed) count: a subscription of the task that the id
        named before (deleted since, its last frames not sent yet) stands in another history."""
        if self.last is not None:
            return
        states = [s.last for s in self.subscriptions]
        known = [state for state in states if state is not None]
        if len(known) == len(states):
            self.last = min((s for s in known if s.epoch == epoch), key=lambda state: state.version)
            self.drain_ahead()

    def moved_on(self, task: Task) -> bool:
        """Whether ``task`` is of a later history than the state last handed out: that one ended (a task is
        deleted only once it has), and the id was made again since. Versions of the two are not comparable,
        so the channel starts again from the new one (:meth:`restart`)."""
        last = self.last
        return last is not None and last.terminal and last.epoch != task.epoch

    def restart(self) -> None:
        """Forget the state of the history that ended: the next one's entries are handed out from here, as
        to a channel that has heard nothing yet. The subscriptions of the old one have their terminal frame
        (sent, or queued with them) and go after it."""
        self.last = None
        self.ahead.clear()

    def next_round(self) -> Round[H] | None:
        """The round to offer now: the unfinished one, else one of the entries handed out since."""
        current = self.round
        if current is not None and current.done < len(current.subscriptions):
            return current
        if not self.outbox:
            self.round = None
            return None
        items, self.outbox = self.outbox, []
        self.round = Round(tuple(self.subscriptions), items)
        return self.round

    def catch_up(self) -> Read:
        if (self.last is None or self.last.terminal) and self.newest is None:
            # Nothing handed out yet: the subscriptions' resume reads cover the past. The newest entry is
            # handed out, so that one whose read came before it still gets it (it fills any gap itself).
            self.reading = NeedTask(self.task_id)
        elif self.last is None:
            assert self.newest is not None
            self.reading = NeedEntries(self.task_id, self.newest.version - 1, self.newest.version)
        else:
            self.base = self.last
            self.newest = None
            self.reading = NeedEntries(self.task_id, self.last.version, NEWEST)
        return self.reading


class Fanout(Generic[H]):
    """Every channel of this process, fed by the bus; which of them must read the store, and when."""

    def __init__(self) -> None:
        self.channels: dict[str, Channel[H]] = {}
        self._due: deque[Channel[H]] = deque()

    # --- subscriptions ------------------------------------------------------------------------------------

    def subscribe(self, peer: Peer[H], task_id: str, owner: TagSub[H] | None = None) -> Subscription[H]:
        """A subscription collecting live entries from now on, replacing the connection's earlier one to the
        same task (one socket streams a task once); read its resume state next and give it to
        :meth:`resumed`. One an ``owner`` (a tag subscription) streams does not count toward the limit."""
        earlier = peer.subscriptions.get(task_id)
        if owner is None:  # refused, it replaces nothing
            peer.make_room(1 if earlier is not None and earlier.owner is None else 0)
        self.unsubscribe(peer, task_id)
        sub = Subscription(task_id, peer, owner)
        if earlier is not None and earlier.head:
            # A tag's announcement of the task the earlier one had not sent: its ``added`` frames still go,
            # ahead of this one's resume frame (a tag's tasks are never hidden by a replacement).
            carried = [frame for frame in earlier.head if frame.type == "added"]
            sub.head = deque(carried) if carried else None
        if owner is not None:
            owner.streams[task_id] = sub
            peer.owned += 1
        peer.subscriptions[task_id] = sub
        channel = self.channels.get(task_id)
        if channel is None:
            channel = self.channels[task_id] = Channel(task_id)
        channel.subscriptions[sub] = None
        return sub

    def resumed(self, sub: Subscription[H], resume: Resume, first: Sequence[Frame] = ()) -> Channel[H] | None:
        """Its resume state: the resume frame goes first (after ``first``: a tag's ``added`` frames). Returns
        the channel if that gave it entries to hand out (a round is due)."""
        if not sub.active:  # unsubscribed or released while the state was being read
            return None
        sub.peer.held()
        if resume.reason == RECREATED and sub.streams is not None:  # not the client's task: from the first
            sub.peer.stream_backlog += sub.streams.restart()
        sub.last = resume.task
        carried, sub.head = sub.head or (), None
        sub.put_head((*carried, *first, resume_frame(resume)))
        # Entries committed while the state was read are already in the resume frame.
        sub.drop_pending_through(resume.task.version)
        sub.peer.wake(sub)
        channel = self.channels[sub.task_id]
        channel.seed(resume.task.epoch)
        return channel if channel.outbox else None

    def remove(self, sub: Subscription[H]) -> None:
        peer, owner = sub.peer, sub.owner
        if sub.active and sub.streams is not None:  # its live chunks no longer wait for the connection
            peer.stream_backlog -= sub.streams.outs.backlog
        sub.active = False
        if peer.subscriptions.get(sub.task_id) is sub:
            del peer.subscriptions[sub.task_id]
            if owner is not None:
                peer.owned -= 1
        if owner is not None and owner.streams.get(sub.task_id) is sub:
            del owner.streams[sub.task_id]
        channel = self.channels.get(sub.task_id)
        if channel is not None:
            channel.subscriptions.pop(sub, None)
            if not channel.subscriptions:
                del self.channels[sub.task_id]

    def unsubscribe(self, peer: Peer[H], task_id: str) -> None:
        sub = peer.subscriptions.get(task_id)
        if sub is not None:
            self.remove(sub)

    def release(self, peer: Peer[H]) -> None:
        for sub in tuple(peer.subscriptions.values()):
            self.remove(sub)

    # --- news from the bus, and what it missed --------------------------------------------------------------

    def wants(self, task_id: str, version: int) -> bool:
        """Whether news of ``version`` of ``task_id`` is anything to this process: it has a subscriber of the
        task and has not handed that version out already (what :meth:`receive` drops without a look), or
        what it handed out last ended the task, so news of it may be of the id made again."""
        channel = self.channels.get(task_id)
        return channel is not None and (version > channel.version or _ended(channel))

    def receive(self, message: Message) -> Channel[H] | None:
        """A committed entry heard on the bus (this process's or another's). Returns the channel if it has
        entries to hand out (a round is due); a version jump or a bare wake-up makes it read the store."""
        channel = self.channels.get(message.task_id)
        if channel is None or message.created:
            return None  # no subscriber here, or no entry
        if message.version <= channel.version:
            if message.task is None and _ended(channel):
                self._make_due(channel)  # a bare wake-up: of the history that ended, or of the next?
            if message.task is None or not channel.moved_on(message.task):
                return None  # already handed out (the echo of this process's own commit)
            channel.restart()
        elif message.task is not None and channel.moved_on(message.task):
            channel.restart()
        if message.task is not None and message.frame is not None:
            if channel.last is None or message.version == channel.version + 1:
                channel.hand_out(message.task, message.frame)
                channel.drain_ahead()
                return channel
            if len(channel.ahead) < MAX_AHEAD:
                channel.ahead[message.version] = message
        self._make_due(channel)
        return None

    def known(self) -> dict[str, int]:
        """Each channel's version the store's is compared with (:meth:`behind`), -1 (any) where it ended."""
        lasts = ((t, channel.last) for t, channel in self.channels.items())
        return {t: -1 if last is None or last.state in TERMINAL else last.version for t, last in lasts}

    def behind(self, stored: Mapping[str, int]) -> None:
        """Stored versions of some channels' tasks (a check after the bus reconnected, or a periodic one):
        those behind read the store."""
        for task_id, version in stored.items():
            channel = self.channels.get(task_id)
            if channel is not None and (version > channel.version or _ended(channel)):
                self._make_due(channel)  # an ended one's id may have been made again: its read tells

    @property
    def reads_due(self) -> bool:
        return bool(self._due)

    def next_read(self) -> Read | None:
        """The next read a channel needs (one at a time per channel), or ``None``."""
        while self._due:
            channel = self._due.popleft()
            channel.due = False
            if self.channels.get(channel.task_id) is not channel:
                continue  # its last subscription went
            if channel.reading is not None:
                channel.recheck = True
                continue
            return channel.catch_up()
        return None

    def task_read(self, read: NeedTask, task: Task) -> Channel[H] | None:
        """The answer to a :class:`NeedTask` of :meth:`next_read`."""
        channel = self._answered(read)
        if channel is not None:
            if channel.moved_on(task):
                channel.restart()
            if channel.last is None:
                if task.version > 0:  # hand out its newest entry: read that next
                    channel.newest = task
                    self._make_due(channel)
            elif task.version > channel.version:  # a state was handed out or seeded during the read
                self._make_due(channel)
        return self._finished(channel)

    def entries_read(self, read: NeedEntries, entries: Entries) -> Channel[H] | None:
        """The answer to a :class:`NeedEntries` of :meth:`next_read`. Returns the channel if it has entries
        to hand out."""
        channel = self._answered(read)
        if channel is None:
            return None
        base, newest = channel.base, channel.newest
        channel.base = channel.newest = None
        if base is None:  # the newest entry of a channel that had no state
            assert newest is not None
            if channel.last is None:
                if entries and entries[-1][0] == newest.version:
                    channel.hand_out(newest, event_frame(newest, entries[-1][1]))
            else:  # a state was handed out or seeded during the reads: go on from it
                self._make_due(channel)
        else:
            for task, frame in replay(base, entries):
                if task.version == channel.version + 1:
                    channel.hand_out(task, frame)
        return self._finished(channel)

    def read_failed(self, read: Read) -> None:
        """The read was not made (the store is unreachable, the task gone): the channel waits for the next
        message or check."""
        channel = self._answered(read)
        if channel is not None:
            channel.base = channel.newest = None
            channel.recheck = False

    def _answered(self, read: Read) -> Channel[H] | None:
        channel = self.channels.get(read.task_id)
        if channel is None or channel.reading is not read:
            return None
        channel.reading = None
        return channel

    def _finished(self, channel: Channel[H] | None) -> Channel[H] | None:
        if channel is None:
            return None
        channel.drain_ahead()
        if channel.recheck:
            channel.recheck = False
            self._make_due(channel)
        return channel if channel.outbox else None

    def _make_due(self, channel: Channel[H]) -> None:
        if not channel.due:
            channel.due = True
            self._due.append(channel)


def _ended(channel: Channel[H]) -> bool:
    """Whether the state a channel handed out last ended its task: no entry follows it in its history, so
    news of the task beyond it is of the id made again (a later history, :meth:`Channel.moved_on`)."""
    return channel.last is not None and channel.last.terminal
