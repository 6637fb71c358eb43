"""Hypothesis plays random interleavings against tag subscriptions (``gateway.live.tagging``) and the fan-out
core under them.

One :class:`TaggingMachine` run is a store (the fake book) where tasks are created over time, each with some
of two tags (or none), and move on by entries; a bus that delivers the news of creations and entries at
once, late (in any order), as bare wake-ups or never; connections that subscribe to a tag (its five steps
spread out: subscribe, list, subscribe the listed tasks, read the resume states, merge; with anything in
between), unsubscribe, subscribe to one task by its id and unsubscribe it; writers that take a few frames
at a time, an endpoint that ends a task's stream after its terminal frame; and the periodic reconcile (the
versions of the channels, and the tags listed again).

After every step, each connection's frames so far are checked (:class:`tests.unit.fanout_play.Client`):
the ``tag`` frame, each listed task's resume frame, ``added`` then ``snapshot`` ``new`` for a task created
later, then per task every version once, in order, a ``conflated`` snapshot the only jump; each task
announced at most once per tag on a connection. At the end, once every message is delivered (or the
reconcile has found it lost) and every frame sent: every task a connection still streams is at its final
version, and every task created with a tag after a subscription to it listed the tag was announced to it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gateway.bus.base import News
from gateway.live.fanout import Fanout, NeedTask, Peer, Subscription, TagSub
from gateway.live.published import NeedEntries
from gateway.live.tagging import NEW, Tagging
from gateway.machine import Resume, Succeed
from tests.support.examples import examples
from tests.unit.fake_book import FakeBook
from tests.unit.fanout_play import Client, news

TAGS = ("a", "b")
LIMIT = 2  # listings cut short: ``more``, and older tasks left out
RETENTION = 3
BUS = ("whole", "whole", "held", "bare", "lost")
PICK = st.integers(0, 7)


@dataclass
class TagOp:
    """A tag's subscribe under way on a connection: the step it reached, and what its reads found."""

    tag_sub: TagSub[str]
    cursors: dict[str, int]  # the map the client sent
    step: int = 1  # 1: subscribed; 2: listed (read); 3: subscriptions made; 4: resume states read
    task_ids: list[str] = field(default_factory=list)
    more: bool = False
    resumes: dict[str, Resume] = field(default_factory=dict)
    listed_at: int = -1  # how many tasks existed when the list was read


@dataclass
class Conn:
    peer: Peer[str]
    client: Client
    op: TagOp | None = None  # one message at a time per socket: at most one subscribe under way
    # Per tag subscription that reached its merge: how many tasks existed when it listed.
    listed_at: dict[TagSub[str], int] = field(default_factory=dict)


class TaggingMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.book = FakeBook(retention_versions=RETENTION)
        self.fan: Fanout[str] = Fanout()
        self.tagging: Tagging[str] = Tagging(self.fan)
        self.tagging.reconciled = True
        self.conns: list[Conn] = []
        self.created: list[str] = []  # task ids in creation order
        self.held: list[News] = []

    # --- helpers --------------------------------------------------------------------------------------------

    def conn(self, pick: int) -> Conn:
        return self.conns[pick % len(self.conns)]

    def carry(self, message: News, how: str) -> None:
        if how == "held":
            self.held.append(message)
        elif how == "bare" and not message.created:
            self.receive(News(message.task_id, message.version))
        elif how != "lost":
            self.receive(message)

    def receive(self, message: News) -> None:
        if message.created:
            self.tagging.created(message)
        else:
            self.fan.receive(message)
        self.flush()

    def flush(self) -> None:
        """Every round due (of every channel), offered to every subscription (no direct writes: the writers
        send all), and the channels' reads answered at once."""
        for _ in range(50):
            moved = False
            for channel in list(self.fan.channels.values()):
                while (fan_round := channel.next_round()) is not None:
                    moved = True
                    for sub in fan_round.subscriptions[fan_round.done :]:
                        if sub.active:
                            fan_round.full(sub)
                    fan_round.done = len(fan_round.subscriptions)
                    fan_round.woken.clear()
            while (read := self.fan.next_read()) is not None:
                moved = True
                if isinstance(read, NeedTask):
                    self.fan.task_read(read, self.book.get_now(read.task_id))
                else:
                    self.fan.entries_read(read, self.book.entries_now(read.task_id, read.after, read.upto))
            if not moved:
                return
        raise AssertionError("fan-out still moving")

    def drain_one(self, conn: Conn, n: int) -> None:
        """The connection's writer sends up to ``n`` frames (its reads answered at once); after a task's
        terminal frame the endpoint ends that task's stream."""
        peer = conn.peer
        for _ in range(n):
            step = peer.next()
            while step is not None and not isinstance(step, tuple):
                if isinstance(step, NeedTask):
                    peer.task_read(step, self.book.get_now(step.task_id))
                else:
                    assert isinstance(step, NeedEntries), "no streams here"
                    peer.entries_read(step, self.book.entries_now(step.task_id, step.after, step.upto))
                step = peer.next()
            if step is None:
                return
            sub, frame = step
            conn.client.feed_one(frame)
            if sub is not None and sub.finished and peer.subscriptions.get(sub.task_id) is sub:
                self.fan.remove(sub)

    # --- the rules ------------------------------------------------------------------------------------------

    @initialize(n=st.integers(1, 2), history=st.lists(st.sets(st.sampled_from(TAGS)), max_size=4))
    def start(self, n: int, history: list[set[str]]) -> None:
        for tags in history:
            self.create(sorted(tags), "whole")
        for i in range(n):
            self.conns.append(Conn(Peer(f"c{i}", backlog=3), Client(self.book)))

    @rule(tags=st.sets(st.sampled_from(TAGS)), how=st.sampled_from(BUS))
    def create(self, tags: Collection[str], how: str) -> None:
        self.book.clock += 1
        task_id = f"t{len(self.created)}"
        task = self.book.create(task_id, tags=sorted(tags))
        self.created.append(task_id)
        self.carry(News.creation(task), how)

    @rule(pick=PICK, hows=st.lists(st.sampled_from(BUS), min_size=1, max_size=3), end=st.booleans())
    def commit(self, pick: int, hows: list[str], end: bool) -> None:
        task_id = self.created[pick % len(self.created)] if self.created else None
        if task_id is None:
            return
        for how in hows:
            task = self.book.current(task_id)
            if task.terminal:
                return
            event = (
                Succeed(self.book.clock, "s3://r", "sha256:1") if end and task.state == "running" else None
            )
            self.carry(news(self.book.commit(task_id, event)), how)

    @rule(pick=PICK)
    def deliver_late(self, pick: int) -> None:
        if self.held:
            self.receive(self.held.pop(pick % len(self.held)))

    @rule(pick=PICK, tag=st.sampled_from(TAGS))
    def subscribe_tag(self, pick: int, tag: str) -> None:
        conn = self.conn(pick)
        if conn.op is None:
            cursors = conn.client.subscribing_tag(tag)
            tag_sub, _ = self.tagging.subscribe(conn.peer, tag, self.book.clock)
            conn.op = TagOp(tag_sub, cursors)

    @rule(pick=PICK)
    def advance(self, pick: int) -> None:
        """The next step of a tag's subscribe under way on a connection."""
        conn = self.conn(pick)
        op = conn.op
        if op is None:
            return
        if op.step == 1:
            op.task_ids, op.more = self.book.list_now(op.tag_sub.tag, LIMIT)
            op.listed_at = len(self.created)
        elif op.step == 2:
            self.tagging.listed(op.tag_sub, op.task_ids)
        elif op.step == 3:
            wanted = {task_id: op.cursors.get(task_id, NEW) for task_id in op.task_ids}
            op.resumes = self.book.resume_many_now(wanted) if wanted else {}
        else:
            self.tagging.resumed(op.tag_sub, op.task_ids, op.more, op.resumes, op.cursors)
            self.flush()
            if op.tag_sub.active:
                conn.listed_at[op.tag_sub] = op.listed_at
            conn.op = None
            return
        op.step += 1

    @rule(pick=PICK, tag=st.sampled_from(TAGS))
    def unsubscribe_tag(self, pick: int, tag: str) -> None:
        conn = self.conn(pick)
        if conn.op is None:
            self.tagging.unsubscribe(conn.peer, tag)

    @rule(pick=PICK, which=PICK)
    def subscribe_task(self, pick: int, which: int) -> None:
        """A task's subscribe by its id (from the client's cursor), its state read at once."""
        conn = self.conn(pick)
        if conn.op is not None or not self.created:
            return
        task_id = self.created[which % len(self.created)]
        conn.client.subscribing(task_id)
        sub = self.fan.subscribe(conn.peer, task_id)
        self.fan.resumed(sub, self.book.resume_now(task_id, conn.client.cursors[task_id]))
        self.flush()

    @rule(pick=PICK, which=PICK)
    def unsubscribe_task(self, pick: int, which: int) -> None:
        """A client's unsubscribe of a task by its id: a tag of the connection that knows it streams it on."""
        conn = self.conn(pick)
        if conn.op is not None or not self.created:
            return
        self.tagging.unsubscribe_task(conn.peer, self.created[which % len(self.created)])

    @rule(pick=PICK, n=st.integers(1, 5))
    def drain(self, pick: int, n: int) -> None:
        self.drain_one(self.conn(pick), n)

    @precondition(lambda self: bool(self.created))
    @rule()
    def reconcile(self) -> None:
        """The periodic check: every channel's version against the store's, and the tags listed again."""
        self.fan.behind({t: self.book.current(t).version for t in self.fan.channels})
        started = self.book.clock
        check = self.tagging.checks()
        if check is not None:
            missing = self.tagging.unknown(self.book.tagged_since_now(*check))
            if missing:
                resumes = self.book.resume_many_now(dict.fromkeys(missing, NEW))
                self.tagging.found(r.task for r in resumes.values())
        self.tagging.checked(started)
        self.flush()

    # --- what holds after every step ------------------------------------------------------------------------

    @invariant()
    def each_task_announced_at_most_once_per_tag_on_a_connection(self) -> None:
        for conn in self.conns:
            twice = [key for key, n in Counter(conn.client.added).items() if n > 1]
            assert not twice, twice

    @invariant()
    def backlogs_stay_bounded(self) -> None:
        for conn in self.conns:
            for sub in conn.peer.subscriptions.values():
                assert len(sub.pending or ()) <= sub.backlog

    @invariant()
    def a_tag_counts_once_and_its_tasks_not(self) -> None:
        for conn in self.conns:
            owned = [s for s in conn.peer.subscriptions.values() if s.owner is not None]
            assert conn.peer.owned == len(owned)
            for sub in owned:
                assert sub.owner is not None and sub.owner.active
                assert sub.owner.streams[sub.task_id] is sub

    def teardown(self) -> None:
        """Everything delivered, every subscribe merged, the reconcile run, every frame sent: every task a
        connection streams is at its final version; every task created with a tag after a subscription to
        the tag listed it was announced to it."""
        for conn in self.conns:
            while conn.op is not None:
                self.advance(self.conns.index(conn))
        for message in self.held:
            self.receive(message)
        self.held.clear()
        for _ in range(3):
            if self.created:
                self.reconcile()
            for conn in self.conns:
                self.drain_one(conn, 10_000)
        for conn in self.conns:
            for task_id, sub in conn.peer.subscriptions.items():
                assert isinstance(sub, Subscription)
                assert conn.client.held.get(task_id) == self.book.current(task_id).version, (task_id, conn)
            for tag_sub, listed_at in conn.listed_at.items():
                if not tag_sub.active:
                    continue
                for task_id in self.created[listed_at:]:
                    if tag_sub.tag in self.book.current(task_id).tags:
                        assert (tag_sub.tag, task_id) in conn.client.added, (tag_sub.tag, task_id)


TaggingMachine.TestCase.settings = settings(
    max_examples=examples(800),
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tagging_machine = TaggingMachine.TestCase
