"""Tag subscriptions on ``/v1/ws``, decided without I/O like ``gateway.live.fanout``, whose subscriptions
stream their tasks (protocol.md, Live: tags).

A tag subscription (:class:`~gateway.live.peer.TagSub`) is one tag on one connection. The tasks it streams
are ordinary subscriptions of the fan-out core, each marked with the tag subscription that owns it, so that
every order rule of a task's stream holds for them (no gap, no repeat, conflation, the terminal frame ending
that task's stream); they do not count toward the connection's limit, the tag counts as one. One socket
streams each task once: a later subscribe to a task (by its id, or by a tag that lists it or announces it)
replaces the subscription that streamed it (``added`` frames it had not sent still go). Unsubscribing a tag
ends the streams it owns, but those of tasks another tag of the connection listed or announced, which that
one streams on.

A subscribe is subscribe, buffer, read, merge, as a task's is:

1. :meth:`Tagging.subscribe`: the tag subscription exists; from now on news of a task created with the tag
   (:meth:`Tagging.created`) is buffered, the task's subscription collecting its entries;
2. the driver lists the tag (its tasks, newest first, up to a limit);
3. :meth:`Tagging.listed`: a subscription per listed task, collecting its live entries from now on;
4. the driver reads every listed task's resume state, in one read;
5. :meth:`Tagging.resumed`: the ``tag`` frame (on the connection's control queue: it answers the message),
   then each listed task's resume frame in the listing's order, then each task created meanwhile and not
   listed, announced: ``added``, its ``snapshot`` (``reason: "new"``), then its entries.

Each created task is announced at most once per tag subscription: it remembers the tasks it listed and
announced, each with its epoch, so that a task made again under the id of one it knew (deleted by retention
since) is another task, announced as any. A connection with several tags gets one announcement of a task
created with several of them: an ``added`` frame per tag, then one snapshot. A creation whose news the
bus lost is found by the reconcile (:meth:`Tagging.checks`, :meth:`Tagging.unknown`, :meth:`Tagging.found`,
:meth:`Tagging.checked`): the driver lists again the watched tags' tasks created since a horizon and reads
those some subscription does not know, which are then announced. A task created before the horizon is
never listed again, so a tag subscription forgets it: what it remembers stays bounded.

A batch is followed the same way (protocol.md, Batches): a subscription to a parent is a tag subscription
under the parent's key (``gateway.tag_names.parent_key``), which lists the parent and its children and
announces each child created later.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Generic, TypeVar

from gateway.frames import added_frame, tag_frame
from gateway.live.fanout import Channel, Fanout, Message
from gateway.live.peer import Peer, Subscription, TagSub
from gateway.machine import Resume, Task
from gateway.tag_names import watched_keys

__all__ = ["MARGIN_MS", "NEW", "Tagging"]

H = TypeVar("H")  # what the driver keeps with a connection: never looked at here

# How much earlier than a subscribe (by the gateway's clock) a task created after it may be stamped: a
# creation's time is taken before its transaction commits, up to GATEWAY_DB_DEADLINE_MS (10 s) later, maybe
# on a process whose clock is behind this one's. The reconcile lists again the tasks created since.
MARGIN_MS: Final = 60_000
# Tasks a tag subscription remembers before it forgets those created before the horizon (then twice as
# many as it keeps, so that forgetting costs a constant per task).
MIN_REMEMBERED: Final = 1024
# The cursor a listed task the client does not know is read with: past any version, so that the store
# answers the task alone (``cursor-ahead``, no entries), sent as a snapshot with ``reason: "new"``.
NEW: Final = 2**53 - 1
# What a tag subscription knows of a task it listed before its state is read: (createdAtMs, epoch).
LISTED: Final = (0, "")


def knows(tag_sub: TagSub[H], task: Task) -> bool:
    """Whether ``tag_sub`` listed or announced ``task``: its id, in this history (not a task made again under
    the id of one it knew)."""
    known = tag_sub.known.get(task.id)
    return known is not None and known[1] == task.epoch


class Tagging(Generic[H]):
    """Every tag subscription of this process, by tag, over the fan-out core."""

    def __init__(self, fanout: Fanout[H], *, margin_ms: int = MARGIN_MS) -> None:
        self.fanout = fanout
        self.margin_ms = margin_ms
        # In the order they subscribed (a dict, as the channels' subscriptions, for a stable order).
        self.watched: dict[str, dict[TagSub[H], None]] = {}
        # Whether the driver reconciles (a bus shared with other processes). Then a tag subscription forgets
        # a task once the reconcile's horizon has passed its creation; else once it is ``margin_ms`` older
        # than the newest it heard of (news of a creation comes once, at once).
        self.reconciled = False
        self.horizon_ms: int | None = None  # the reconcile lists no task created before this again
        self.woken: dict[Peer[H], None] = {}  # connections that got an announcement: wake their writers

    # --- subscribe, buffer, read, merge --------------------------------------------------------------------

    def subscribe(self, peer: Peer[H], tag: str, now_ms: int) -> tuple[TagSub[H], list[Subscription[H]]]:
        """Step 1, at ``now_ms`` (the gateway's clock): a tag subscription replacing the connection's earlier
        one to the same tag, whose streams are returned, removed. Raises ``InvalidRequest`` at the
        connection's limit, leaving everything as it was."""
        peer.make_room(1 if tag in peer.tags else 0)
        removed = self.unsubscribe(peer, tag)
        tag_sub = TagSub(tag, peer, now_ms - self.margin_ms)
        peer.tags[tag] = tag_sub
        self.watched.setdefault(tag, {})[tag_sub] = None
        return tag_sub, removed

    def listed(self, tag_sub: TagSub[H], task_ids: Sequence[str]) -> None:
        """Step 3: the tag's tasks as listed; each gets a subscription collecting its entries from now on
        (replacing the connection's earlier one to it). Read their resume states next."""
        if not tag_sub.active:  # unsubscribed or replaced during the listing
            return
        for task_id in task_ids:
            tag_sub.known.setdefault(task_id, LISTED)
            self.fanout.subscribe(tag_sub.peer, task_id, tag_sub)

    def resumed(
        self,
        tag_sub: TagSub[H],
        task_ids: Sequence[str],
        more: bool,
        resumes: Mapping[str, Resume],
        cursors: Mapping[str, int],
    ) -> tuple[list[Channel[H]], list[Subscription[H]]]:
        """Step 5: the listed tasks' resume states (read from the client's ``cursors``, or with :data:`NEW`
        for a task not in them): queue the ``tag`` frame, the resume frames and the announcements of the
        tasks created meanwhile. The driver makes room in the connection's control queue first.

        Returns the channels that have entries to hand out (rounds due), and the subscriptions of listed
        tasks that were gone by the read (deleted), removed."""
        if not tag_sub.active:
            return [], []
        tag_sub.listing = False
        peer = tag_sub.peer
        peer.held()  # a tag with no task holds the connection too
        found = [task_id for task_id in task_ids if task_id in resumes]
        queued = peer.send_control(tag_frame(tag_sub.tag, found, more))
        assert queued, "the driver makes room in the control queue first"
        channels: list[Channel[H] | None] = []
        gone: list[Subscription[H]] = []
        for task_id in task_ids:
            resume = resumes.get(task_id)
            sub = tag_sub.streams.get(task_id)
            if resume is None:
                del tag_sub.known[task_id]
                if sub is not None:
                    self.fanout.remove(sub)
                    gone.append(sub)
                continue
            tag_sub.known[task_id] = (resume.task.created_at_ms, resume.task.epoch)
            if task_id not in cursors:
                resume = Resume("snapshot", "new", resume.task, ())
            if sub is not None:
                channels.append(self.fanout.resumed(sub, resume))
            else:  # another of the connection's tags announced it since: this one subscribed last
                channels.append(self._take_back(tag_sub, resume))
        if more and found:
            oldest = resumes[found[-1]].task
            tag_sub.floor = (oldest.created_at_ms, oldest.id)
        listed = set(task_ids)
        for task_id, task in tag_sub.buffered.items():
            if task_id in listed:
                resume = resumes.get(task_id)
                if resume is not None and resume.task.epoch == task.epoch:
                    continue  # its resume frame is its announcement
                # The listing found a task of this id that was deleted, and the id made again since: the new
                # one is announced (its subscription resumed the other, or is gone with it).
                tag_sub.known[task_id] = (task.created_at_ms, task.epoch)
                channels.append(self._take_over([tag_sub], task, recheck=True))
                continue
            sub = tag_sub.streams.get(task_id)
            if sub is not None:  # it collected the task's entries since its creation
                channels.append(self._announce([tag_sub], sub, task, recheck=False))
            else:  # another of the connection's tags announced it since, and streams it: take it over
                channels.append(self._take_over([tag_sub], task, recheck=True))
        tag_sub.buffered = {}
        tag_sub.cap = max(MIN_REMEMBERED, 2 * len(tag_sub.known))
        return [channel for channel in channels if channel is not None], gone

    def created(self, message: Message) -> list[Channel[H]]:
        """News of a task created (``message.created``): announced to every subscription of its tags that
        does not know it yet (a task made again under the id of one it knew is another task), buffered by
        one whose listing is under way. Returns the channels that have entries to hand out."""
        task = message.task
        if task is None:  # too big for a message: the reconcile finds it
            return []
        groups: dict[Peer[H], list[TagSub[H]]] = {}
        for tag in watched_keys(task.tags, task.parent):  # a child is news for its parent's followers too
            for tag_sub in self.watched.get(tag, ()):
                if not knows(tag_sub, task):
                    groups.setdefault(tag_sub.peer, []).append(tag_sub)
        channels: list[Channel[H] | None] = []
        for peer, tag_subs in groups.items():
            ready = [tag_sub for tag_sub in tag_subs if not tag_sub.listing]
            for tag_sub in tag_subs:
                self._remember(tag_sub, task)
                if tag_sub.listing:
                    tag_sub.buffered[task.id] = task
            if ready:
                channels.append(self._take_over(ready, task, recheck=False))
            else:  # its entries collect until the listing is merged
                self.fanout.subscribe(peer, task.id, tag_subs[-1])
        return [channel for channel in channels if channel is not None]

    def _take_over(self, tag_subs: Sequence[TagSub[H]], task: Task, *, recheck: bool) -> Channel[H] | None:
        """Announce ``task`` to ``tag_subs`` (of one connection) on a subscription of the last of them that
        replaces the connection's stream of the task, if any (the ``added`` frames that one had not sent yet,
        another tag's announcement of it, go first)."""
        owner = tag_subs[-1]
        earlier = owner.peer.subscriptions.get(task.id)
        last = None if earlier is None else earlier.last
        if last is not None and last.epoch == task.epoch and last.version > task.version:
            task = last  # the connection has it further on already: its snapshot never steps back
        sub = self.fanout.subscribe(owner.peer, task.id, owner)
        return self._announce(tag_subs, sub, task, recheck=recheck)

    def _take_back(self, tag_sub: TagSub[H], resume: Resume) -> Channel[H] | None:
        """A listed task that another tag of the connection announced during the listing: streamed from its
        resume state after all (that announcement's ``added`` frames first, if unsent), on a new subscription
        that did not collect what came since the read, so its writer reads the task again."""
        sub = self.fanout.subscribe(tag_sub.peer, resume.task.id, tag_sub)
        channel = self.fanout.resumed(sub, resume)
        sub.conflated = True
        self.woken[sub.peer] = None
        return channel

    def _announce(
        self, tag_subs: Sequence[TagSub[H]], sub: Subscription[H], task: Task, *, recheck: bool
    ) -> Channel[H] | None:
        """``added`` for each of ``tag_subs`` (of one connection), then the task's ``snapshot`` (reason
        ``new``) at ``task``, then its entries, streamed by ``sub``. ``recheck``: ``sub`` did not collect
        the entries committed since ``task`` was read, so its writer reads the task again (a ``conflated``
        snapshot follows if it is newer); so too where the channel handed out entries it does not have."""
        frames = [added_frame(tag_sub.tag, task.id) for tag_sub in tag_subs]
        channel = self.fanout.resumed(sub, Resume("snapshot", "new", task, ()), frames)
        self.woken[sub.peer] = None
        newest = sub.pending[-1].task.version if sub.pending else task.version
        if recheck or self.fanout.channels[task.id].version > newest:
            sub.conflated = True
        return channel

    def take_woken(self) -> list[Peer[H]]:
        """The connections that got announcements since the last call: their writers have work."""
        woken, self.woken = list(self.woken), {}
        return woken

    def _remember(self, tag_sub: TagSub[H], task: Task) -> None:
        known = tag_sub.known
        known[task.id] = (task.created_at_ms, task.epoch)
        if len(known) <= tag_sub.cap or tag_sub.listing:
            return
        horizon = self.horizon_ms if self.reconciled else task.created_at_ms - self.margin_ms
        if horizon is not None:
            tag_sub.known = {i: seen for i, seen in known.items() if seen[0] >= horizon}
        tag_sub.cap = max(MIN_REMEMBERED, 2 * len(tag_sub.known))

    # --- the end of a tag subscription ---------------------------------------------------------------------

    def unsubscribe(self, peer: Peer[H], tag: str) -> list[Subscription[H]]:
        """End the connection's subscription to ``tag``, if any; returns its streams, removed."""
        tag_sub = peer.tags.get(tag)
        return [] if tag_sub is None else self.drop(tag_sub)

    def drop(self, tag_sub: TagSub[H]) -> list[Subscription[H]]:
        """End a tag subscription (unsubscribed, replaced, or its subscribe failed) and the streams it owns,
        but those of tasks another tag of the connection has listed or announced: that one streams them on
        (frames already queued included). Returns the streams removed."""
        if not tag_sub.active:
            return []
        tag_sub.active = False
        peer = tag_sub.peer
        del peer.tags[tag_sub.tag]
        watchers = self.watched[tag_sub.tag]
        del watchers[tag_sub]
        if not watchers:
            del self.watched[tag_sub.tag]
        ended: list[Subscription[H]] = []
        for task_id, sub in tuple(tag_sub.streams.items()):
            heirs = [other for other in peer.tags.values() if not other.listing and task_id in other.known]
            if not heirs:
                self.fanout.remove(sub)
                ended.append(sub)
                continue
            del tag_sub.streams[task_id]
            sub.owner = heirs[-1]
            heirs[-1].streams[task_id] = sub
        tag_sub.buffered = {}
        tag_sub.known = {}
        return ended

    def unsubscribe_task(self, peer: Peer[H], task_id: str) -> Subscription[H] | None:
        """A client's ``unsubscribe`` of a task by its id: the task's own subscription ends (returned,
        removed), but where a tag subscription of the connection listed or announced the task, that one
        streams it on (the same stream: no gap, no repeat), as when another of its tags is unsubscribed.
        A stream a tag subscription owns is that tag's, not a task's subscription: it goes on."""
        sub = peer.subscriptions.get(task_id)
        if sub is None or sub.owner is not None:
            return None
        heirs = [
            tag_sub for tag_sub in peer.tags.values() if not tag_sub.listing and task_id in tag_sub.known
        ]
        if not heirs:
            self.fanout.remove(sub)
            return sub
        sub.owner = heirs[-1]
        heirs[-1].streams[task_id] = sub
        peer.owned += 1
        return None

    def release(self, peer: Peer[H]) -> list[Subscription[H]]:
        """Every tag subscription of a connection that ends; returns their streams, removed."""
        return [sub for tag_sub in tuple(peer.tags.values()) for sub in self.drop(tag_sub)]

    # --- the reconcile: creations whose news was lost ------------------------------------------------------

    def checks(self) -> tuple[list[str], int] | None:
        """What to list again: the tags of the subscriptions past their listing, and the earliest creation
        time to list (the oldest such subscription's start less the margin, or the horizon if later);
        ``None`` when there is none."""
        done = [tag_sub for subs in self.watched.values() for tag_sub in subs if not tag_sub.listing]
        if not done:
            return None
        since = min(tag_sub.since_ms for tag_sub in done)
        if self.horizon_ms is not None:
            since = max(since, self.horizon_ms)
        return sorted({tag_sub.tag for tag_sub in done}), since

    def unknown(self, rows: Iterable[tuple[str, str, str]]) -> list[str]:
        """Of the tasks listed again, as ``(tag, task id, epoch)``, those a subscription of their tag past its
        listing does not know (or knew under another epoch: the id was made again): read their state, and
        give it to :meth:`found`."""
        missing: dict[str, None] = {}
        for tag, task_id, epoch in rows:
            for tag_sub in self.watched.get(tag, ()):
                known = tag_sub.known.get(task_id)
                if not tag_sub.listing and (known is None or known[1] != epoch):
                    missing[task_id] = None
        return list(missing)

    def found(self, tasks: Iterable[Task]) -> list[Channel[H]]:
        """The tasks :meth:`unknown` named, as they are now: each announced, in the order they were created,
        to the subscriptions of its tags that do not know it and were there before it was created (an older
        one that a listing of more tasks than it holds left out is only remembered). Returns the channels
        that have entries to hand out."""
        channels: list[Channel[H] | None] = []
        for task in sorted(tasks, key=lambda t: (t.created_at_ms, t.id)):
            groups: dict[Peer[H], list[TagSub[H]]] = {}
            for tag in watched_keys(task.tags, task.parent):
                for tag_sub in self.watched.get(tag, ()):
                    if tag_sub.listing or knows(tag_sub, task):
                        continue
                    self._remember(tag_sub, task)
                    floor = tag_sub.floor
                    if task.created_at_ms >= tag_sub.since_ms and (
                        floor is None or (task.created_at_ms, task.id) > floor
                    ):
                        groups.setdefault(tag_sub.peer, []).append(tag_sub)
            for tag_subs in groups.values():
                channels.append(self._take_over(tag_subs, task, recheck=True))
        return [channel for channel in channels if channel is not None]

    def checked(self, started_ms: int) -> None:
        """A reconcile that began at ``started_ms`` went through: from now on it lists no task created
        before then (less the margin), unless a subscription still listing needs older ones."""
        listing = [tag_sub.since_ms for subs in self.watched.values() for tag_sub in subs if tag_sub.listing]
        self.horizon_ms = min([started_ms - self.margin_ms, *listing])
