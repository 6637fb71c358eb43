"""The fan-out core (``gateway.live.fanout``, ``gateway.live.peer``) in plain calls: no event loop, no socket.

:class:`tests.unit.fanout_play.Play` does the hub's part (the bus's messages, rounds, direct writes, the
connections' writers, the store reads), so each test states an interleaving outright: which message comes
when, which read is answered when and with what, which socket has room.

What is checked is protocol.md, WebSocket: the resume frame first, then ``event`` frames V+1, V+2, ... with
no gap, no repeat and no reordering (a ``snapshot`` with ``reason: conflated`` being the one other frame
that can follow), each ``event`` frame carrying the task after its entry; a bounded backlog per
subscription; frames encoded once per entry; control frames in order and bounded; ``4008`` for a socket
stuck in a send. Random interleavings of all of it are ``test_fanout_properties.py``'s.
"""

from __future__ import annotations

import orjson
import pytest

from gateway.bus.base import News
from gateway.errors import CLOSE_SLOW_CONSUMER, InvalidRequest, UnknownTask
from gateway.frames import PONG, error_frame, event_frame
from gateway.live.fanout import (
    MAX_AHEAD,
    NEWEST,
    NeedEntries,
    NeedTask,
    Peer,
    Published,
    Subscription,
    replay,
)
from gateway.live.published import SubStreams
from gateway.machine import Progress, Start, Succeed, event_to_json, task_to_json
from tests.unit.fake_book import FakeBook
from tests.unit.fanout_play import (
    BACKLOG,
    Play,
    check_event,
    check_resume,
    check_stream,
    news,
    parse,
    unframe_all,
)


@pytest.fixture
def play() -> Play:
    play = Play()
    play.book.create("t")
    play.book.create("u")
    return play


# --- resume frame first, then the live entries -------------------------------------------------------


@pytest.mark.parametrize(
    ("history", "cursor", "mode", "reason"),
    [
        (0, 0, "caught-up", None),
        (20, 20, "caught-up", None),
        (20, 19, "delta", None),
        (20, 20 - 8, "delta", None),
        (20, 20 - 8 - 1, "snapshot", "retention"),
        (20, 0, "snapshot", "retention"),
        (5, 0, "delta", None),
        (20, 21, "snapshot", "cursor-ahead"),
        (0, 7, "snapshot", "cursor-ahead"),
    ],
)
def test_resume_frame_first_then_the_following_events_in_order(
    play: Play, history: int, cursor: int, mode: str, reason: str | None
) -> None:
    play.commit_many("t", history)
    peer = play.connect()
    sub = play.subscribe(peer, "t", cursor)
    assert peer.subscriptions == {"t": sub}
    ((got_sub, resume),) = play.take(peer)
    assert got_sub is sub
    body = parse(resume)
    assert (body["type"], body.get("reason"), body["version"]) == (mode, reason, history)
    assert check_resume(play.book, "t", resume, cursor) == history
    if mode == "delta":
        assert body["events"] == [
            {"version": v, "event": event_to_json(play.book.events["t"][v - 1])}
            for v in range(cursor + 1, history + 1)
        ]
    play.commit_many("t", 3)
    play.commit_many("u", 2)  # another task's entries reach no one here
    got = play.take(peer)
    assert [s for s, _ in got] == [sub] * 3
    assert check_stream(play.book, "t", cursor, play.got[sub]) == history + 3
    assert sub.last == play.book.current("t")
    assert play.take(peer) == []


def test_event_frame_text_is_the_protocol_shape(play: Play) -> None:
    play.commit("t", Start(1_500, "w1"))
    peer = play.connect()
    sub = play.subscribe(peer, "t", 1)
    play.commit("t", Progress(1_600.5, 40, "c1"))
    play.commit("t", Succeed(1_700, "ref", "hash"))
    _, first, second = play.frames(peer)
    assert orjson.loads(first.text) == {
        "type": "event",
        "taskId": "t",
        "version": 2,
        "event": {"type": "progress", "atMs": 1_600.5, "progress": 40, "cursor": "c1"},
        "task": task_to_json(play.book.state_at("t", 2)),
    }
    body = check_event(play.book, "t", second, 3)
    assert body["task"]["state"] == "succeeded"
    assert sub.finished


def test_unknown_task_or_bad_cursor_leaves_nothing_subscribed(play: Play) -> None:
    peer = play.connect()
    with pytest.raises(UnknownTask):
        play.subscribe(peer, "nope", 0)
    with pytest.raises(InvalidRequest):
        play.subscribe(peer, "t", -1)
    assert peer.subscriptions == {}
    assert play.fan.channels == {}
    assert play.take(peer) == []


# --- entries committed while the resume state is read ------------------------------------------------


@pytest.mark.parametrize("read_after", [True, False], ids=["read-after-them", "read-before-them"])
@pytest.mark.parametrize("cursor", [0, 5, 10, 12], ids=["retention", "delta", "caught-up", "ahead"])
def test_entries_committed_while_the_resume_state_is_read_no_gap_no_repeat(
    play: Play, read_after: bool, cursor: int
) -> None:
    play.commit_many("t", 10)
    peer = play.connect()
    sub = play.fan.subscribe(peer, "t")  # live entries collect from here on
    play.commit("t")  # 11: published at once
    held = play.commit("t", publish=False)  # 12: held back
    play.commit("t")  # 13: waits in the task's channel for 12
    assert play.stats()["pending_max"] == 1
    play.resumed(sub, cursor, as_of=None if read_after else 10)
    play.publish(held)
    play.commit_many("t", 2)  # 14, 15
    stream = play.frames(peer)
    resumed_at = check_resume(play.book, "t", stream[0], cursor)
    assert resumed_at == (13 if read_after else 10)
    assert check_stream(play.book, "t", cursor, stream) == 15
    assert [f.version for f in stream[1:]] == list(range(resumed_at + 1, 16))
    assert sub.last == play.book.current("t")


def test_a_resume_answered_after_the_subscription_went_is_dropped(play: Play) -> None:
    peer = play.connect()
    sub = play.fan.subscribe(peer, "t")
    play.fan.unsubscribe(peer, "t")
    play.commit("t")
    play.resumed(sub, 0)
    assert play.take(peer) == []
    assert play.fan.channels == {}


# --- messages out of order, lost, repeated, bare ------------------------------------------------------


def test_messages_out_of_order_are_sent_in_order_with_no_store_read(play: Play) -> None:
    play.commit_many("t", 3)
    peer = play.connect()
    play.subscribe(peer, "t", 3)
    c4, c5, c6 = play.commit_many("t", 3, publish=False)
    play.publish(c6, c5, c4)  # v+3 and v+2 before v+1: they wait in the channel
    play.catch_up()  # the read the jump asked for finds them all handed out by then
    assert [f.version for f in play.frames(peer)] == [3, 4, 5, 6]
    assert play.reads("entries") == [("entries", "t", 6, NEWEST)]
    play.publish(c5)  # a repeat: dropped
    assert play.take(peer) == []


@pytest.mark.parametrize("subscribers", [1, 20])
def test_a_lost_message_costs_one_store_read_per_task_whatever_the_subscribers(
    play: Play, subscribers: int
) -> None:
    peers = [play.connect() for _ in range(subscribers)]
    subs = [play.subscribe(peer, "t", 0) for peer in peers]
    play.commit("t")
    play.commit("t", publish=False)  # lost
    play.commit("t")  # reveals the gap
    play.catch_up()
    for peer, sub in zip(peers, subs, strict=True):
        assert [f.version for f in play.frames(peer)] == [0, 1, 2, 3]
        assert check_stream(play.book, "t", 0, play.got[sub]) == 3
    assert play.reads("entries") == [("entries", "t", 1, NEWEST)]


def test_a_later_entry_published_first_is_still_sent_live(play: Play) -> None:
    peer = play.connect()
    play.subscribe(peer, "t", 0)
    c1, c2 = play.commit_many("t", 2, publish=False)
    play.publish(c2)  # the channel knows no state but the subscription's: 2 waits for 1
    play.catch_up()
    _, filled, live = play.frames(peer)
    check_event(play.book, "t", filled, 1)
    assert live.text == event_frame(c2.task, c2.encoded).text
    play.publish(c1)  # already sent: dropped
    assert play.take(peer) == []


@pytest.mark.parametrize("lost", [[1], [1, 2, 3, 4], [2, 4, 5], [1, 3, 6, 7, 8]])
def test_lost_messages_are_filled_from_the_store(play: Play, lost: list[int]) -> None:
    peer = play.connect()
    sub = play.subscribe(peer, "t", 0)
    for version in range(1, 10):
        play.commit("t", publish=version not in lost)
        play.catch_up()
    play.take(peer)
    assert check_stream(play.book, "t", 0, play.got[sub]) == 9
    assert [f.type for f in play.got[sub]] == ["caught-up"] + ["event"] * 9


def test_a_check_against_the_store_finds_a_lost_tail_that_no_later_entry_reveals(play: Play) -> None:
    """The bus lost the last entries of two tasks (its listener was reconnecting): nothing later comes to
    reveal the gap; comparing versions with the store (after a reconnect, or periodically) finds them."""
    peers = {task_id: play.connect() for task_id in ("t", "u")}
    for task_id, peer in peers.items():
        play.commit(task_id)
        play.subscribe(peer, task_id, 1)
        play.take(peer)
    play.commit_many("t", 3, publish=False)
    play.commit("u", publish=False)
    play.catch_up()
    assert not play.fan.reads_due
    assert play.fan.known() == {"t": 1, "u": 1}  # what the store's versions are compared with
    play.fan.behind({"t": 4, "u": 2, "gone": 7})
    play.fan.behind({"t": 4})  # asked twice before the read: one read
    play.catch_up()
    assert [f.version for f in play.frames(peers["t"])] == [2, 3, 4]
    assert [f.version for f in play.frames(peers["u"])] == [2]
    assert sorted(c[1] for c in play.reads("entries")) == ["t", "u"]
    play.fan.behind({"t": 4, "u": 1})  # not behind: nothing to read
    assert not play.fan.reads_due


def test_more_messages_ahead_than_a_channel_keeps_are_read_from_the_store(play: Play) -> None:
    peer = play.connect()
    play.subscribe(peer, "t", 0)
    held = play.commit("t", publish=False)
    play.commit_many("t", MAX_AHEAD + 5)
    assert len(play.fan.channels["t"].ahead) == MAX_AHEAD
    play.publish(held)  # the channel goes on from 1, and on through what it kept
    assert play.fan.channels["t"].version == MAX_AHEAD + 1
    play.catch_up()
    play.take(peer)
    assert play.fan.channels["t"].version == MAX_AHEAD + 6
    assert not play.fan.channels["t"].ahead


def test_a_later_resume_read_does_not_hide_an_entry_from_an_earlier_one(play: Play) -> None:
    """B reads v3, then v4 (terminal) is committed, A reads v4, and only then is v4 published. The channel
    must not take A's newer state as where everyone stands: B would never get v4."""
    play.commit_many("t", 3)
    b, a = play.connect(), play.connect()
    b_sub = play.fan.subscribe(b, "t")
    last = play.commit("t", Succeed(2_000, "s3://r", "sha256:1"), publish=False)
    play.subscribe(a, "t", 3)  # A reads v4; the channel still has no state (B has none)
    assert play.fan.channels["t"].last is None
    play.resumed(b_sub, 3, as_of=3)  # B read v3
    assert play.fan.channels["t"].version == 3
    play.publish(last)
    assert [(f.type, f.version) for f in play.frames(b)] == [("caught-up", 3), ("event", 4)]
    assert [(f.type, f.version) for f in play.frames(a)] == [("delta", 4)]


def test_a_bare_wake_up_is_read_from_the_store_once_for_the_task(play: Play) -> None:
    play.commit_many("t", 3)
    peers = [play.connect() for _ in range(3)]
    for peer in peers:
        play.subscribe(peer, "t", 3)
    play.commit("t", publish=False)
    play.receive(News("t", 4))  # the message was too big for the bus: id and version only
    play.receive(News("t", 4))  # and again
    play.catch_up()
    for peer in peers:
        assert [f.version for f in play.frames(peer)] == [3, 4]
    assert play.reads("entries") == [("entries", "t", 3, NEWEST)]


def test_a_bare_wake_up_before_any_state_hands_out_the_newest_entry(play: Play) -> None:
    """No subscription has its state yet: the channel reads the task, then its newest entry, and hands
    that out; a subscription whose state is older fills the gap itself."""
    play.commit_many("t", 3)
    peer = play.connect()
    sub = play.fan.subscribe(peer, "t")
    play.commit_many("t", 2, publish=False)
    play.receive(News("t", 5))
    play.catch_up()
    assert [c[:2] for c in play.book.calls] == [("get", "t"), ("entries", "t")]
    assert play.reads("entries") == [("entries", "t", 4, 5)]
    play.resumed(sub, 3, as_of=3)
    play.take(peer)
    assert [f.version for f in play.got[sub]] == [3, 4, 5]
    assert play.reads("entries")[-1] == ("entries", "t", 3, 4)  # the subscription's own fill
    assert check_stream(play.book, "t", 3, play.got[sub]) == 5


def test_a_bare_wake_up_of_a_task_at_version_0_hands_out_nothing(play: Play) -> None:
    peer = play.connect()
    sub = play.fan.subscribe(peer, "t")
    play.receive(News("t", 0))
    play.catch_up()
    assert play.reads("entries") == []
    play.resumed(sub, 0)
    assert [f.version for f in play.frames(peer)] == [0]


def test_a_state_seeded_while_the_channel_reads_is_where_it_goes_on_from(play: Play) -> None:
    """The channel starts reading with no state; a resume lands before each answer: it goes on from that
    state instead, so the entry is handed out at once, not at the next check."""
    play.commit_many("t", 3)
    peer = play.connect()
    sub = play.fan.subscribe(peer, "t")
    play.commit("t", publish=False)
    play.receive(News("t", 4))
    get = play.fan.next_read()
    assert isinstance(get, NeedTask)
    play.resumed(sub, 3, as_of=3)  # during the read of the task
    play.flush(play.fan.task_read(get, play.book.current("t")))
    read = play.fan.next_read()
    assert isinstance(read, NeedEntries) and (read.after, read.upto) == (3, NEWEST)
    play.flush(play.fan.entries_read(read, play.book.entries_now("t", 3, NEWEST)))
    assert [f.version for f in play.frames(peer)] == [3, 4]
    # The same with the resume landing during the read of the newest entry instead.
    other = play.connect()
    late = play.fan.subscribe(other, "u")
    play.commit("u", publish=False)
    play.receive(News("u", 1))
    get = play.fan.next_read()
    assert isinstance(get, NeedTask)
    play.flush(play.fan.task_read(get, play.book.current("u")))
    newest = play.fan.next_read()
    assert isinstance(newest, NeedEntries) and (newest.after, newest.upto) == (0, 1)
    play.resumed(late, 0, as_of=0)
    play.flush(play.fan.entries_read(newest, play.book.entries_now("u", 0, 1)))
    play.catch_up()
    assert [f.version for f in play.frames(other)] == [0, 1]


def test_a_channel_reads_one_at_a_time_and_again_when_asked_meanwhile(play: Play) -> None:
    peer = play.connect()
    play.subscribe(peer, "t", 0)
    play.commit("t", publish=False)
    play.receive(News("t", 1))
    first = play.fan.next_read()
    assert isinstance(first, NeedEntries)
    play.commit("t", publish=False)
    play.receive(News("t", 2))  # while the first read is under way
    assert play.fan.next_read() is None  # one at a time
    # The first read was made before 2 was committed: 1 only.
    play.flush(play.fan.entries_read(first, play.book.entries_now("t", 0, 1)))
    second = play.fan.next_read()
    assert isinstance(second, NeedEntries) and second.after == 1
    play.flush(play.fan.entries_read(second, play.book.entries_now("t", 1, NEWEST)))
    assert [f.version for f in play.frames(peer)] == [0, 1, 2]


def test_answers_to_reads_no_longer_awaited_change_nothing(play: Play) -> None:
    peer = play.connect()
    play.subscribe(peer, "t", 0)
    play.commit("t", publish=False)
    play.receive(News("t", 1))
    read = play.fan.next_read()
    assert isinstance(read, NeedEntries)
    play.fan.read_failed(read)  # the store was unreachable: the channel waits for the next message or check
    assert play.fan.next_read() is None
    assert play.fan.entries_read(read, play.book.entries_now("t", 0, 1)) is None  # late: ignored
    assert play.fan.task_read(NeedTask("t"), play.book.current("t")) is None  # never asked
    play.fan.read_failed(read)  # twice: nothing
    play.fan.behind({"t": 1})
    play.catch_up()
    assert [f.version for f in play.frames(peer)] == [0, 1]
    # A channel that went while its read was under way, or came back since: the answer is dropped.
    play.commit("t", publish=False)
    play.receive(News("t", 2))
    read = play.fan.next_read()
    assert isinstance(read, NeedEntries)
    play.fan.unsubscribe(peer, "t")
    assert play.fan.entries_read(read, play.book.entries_now("t", 1, 2)) is None
    play.fan.behind({"t": 2})
    play.receive(News("t", 2))
    assert play.fan.next_read() is None


def test_a_due_channel_that_went_asks_for_nothing(play: Play) -> None:
    peer = play.connect()
    play.subscribe(peer, "t", 0)
    play.receive(News("t", 1))
    play.fan.unsubscribe(peer, "t")
    assert play.fan.reads_due
    assert play.fan.next_read() is None


def test_a_short_answer_from_the_store_stays_exact(play: Play) -> None:
    """History is whole, so a read never answers short; if one did, the channel hands out what follows
    on and no more, and a subscription sends the newest state instead of a gap."""
    play.commit_many("t", 2)
    peer = play.connect()
    sub = play.subscribe(peer, "t", 2)
    play.commit_many("t", 3, publish=False)
    play.receive(News("t", 5))
    read = play.fan.next_read()
    assert isinstance(read, NeedEntries)
    entries = play.book.entries_now("t", 2, NEWEST)
    play.flush(play.fan.entries_read(read, [entries[0], entries[2]]))  # 3, then 5: 4 is missing
    assert play.fan.channels["t"].version == 3
    play.take(peer)
    assert [f.version for f in play.got[sub]] == [2, 3]
    assert replay(play.book.state_at("t", 2), entries[1:]) == []  # 4 does not follow on from 2


# --- one subscription's own reads: gaps and conflated snapshots ----------------------------------------


def gap(play: Play, task_id: str, newest: int) -> tuple[Peer[str], Subscription[str]]:
    """A subscription at version 0 whose first pending entry is ``newest``: the channel had no state when
    a bare wake-up came, so it handed out the newest entry only (the subscription fills the rest itself)."""
    peer = play.connect(backlog=BACKLOG)
    sub = play.fan.subscribe(peer, task_id)
    play.commit_many(task_id, newest, publish=False)
    play.receive(News(task_id, newest))
    play.catch_up()
    play.resumed(sub, 0, as_of=0)
    assert play.frames(peer, 1)[0].version == 0
    return peer, sub


def test_a_gap_is_filled_while_more_entries_arrive(play: Play) -> None:
    """The subscription's fill is read while more entries come: they go after the filled ones."""
    peer, sub = gap(play, "t", 3)
    read = peer.next()
    assert isinstance(read, NeedEntries) and (read.after, read.upto) == (0, 2)
    assert not peer.quiet()  # nothing is written directly while a frame is being prepared
    play.commit_many("t", 2)  # 4, 5 while 1..2 are read
    peer.entries_read(read, play.book.entries_now("t", 0, 2))
    play.take(peer)
    assert [f.version for f in play.got[sub]] == [0, 1, 2, 3, 4, 5]
    assert check_stream(play.book, "t", 0, play.got[sub]) == 5


def test_a_gap_longer_than_the_backlog_is_sent_as_the_newest_state(play: Play) -> None:
    peer, sub = gap(play, "t", BACKLOG + 2)
    play.take(peer)
    assert [(f.type, f.version) for f in play.got[sub]] == [("caught-up", 0), ("snapshot", BACKLOG + 2)]
    assert peer.conflations == 1
    assert check_stream(play.book, "t", 0, play.got[sub]) == BACKLOG + 2


def test_a_read_that_fails_is_made_again_on_the_next_turn(play: Play) -> None:
    peer = play.connect(backlog=2)
    sub = play.subscribe(peer, "t", 0)
    play.frames(peer)
    play.commit_many("t", 3)  # past the backlog: a snapshot is due
    read = peer.next()
    assert isinstance(read, NeedTask)
    peer.read_failed(read)
    peer.task_read(read, play.book.current("t"))  # an answer after the failure: ignored
    again = peer.next()
    assert isinstance(again, NeedTask) and again is not read
    peer.task_read(again, play.book.current("t"))
    assert [(f.type, f.version) for f in play.frames(peer)] == [("snapshot", 3)]
    assert [f.type for f in play.got[sub]] == ["caught-up", "snapshot"]
    # A fill that fails is read again too.
    other, filling = gap(play, "u", 3)
    fill = other.next()
    assert isinstance(fill, NeedEntries)
    other.read_failed(fill)
    again = other.next()
    assert isinstance(again, NeedEntries) and (again.after, again.upto) == (fill.after, fill.upto)
    other.entries_read(again, play.book.entries_now("u", 0, 2))
    play.take(other)
    assert [f.version for f in play.got[filling]] == [0, 1, 2, 3]


def test_a_subscription_that_went_while_its_frame_was_read_sends_nothing(play: Play) -> None:
    peer = play.connect(backlog=1)
    play.subscribe(peer, "t", 0)
    play.frames(peer)
    play.commit_many("t", 2)
    read = peer.next()
    assert isinstance(read, NeedTask)
    assert peer.next() is None  # asked again before the answer: still waiting for it
    play.fan.unsubscribe(peer, "t")
    peer.task_read(read, play.book.current("t"))
    assert play.take(peer) == []
    # The same for a subscription that fails its read after it went.
    play.subscribe(peer, "t", 0)
    play.frames(peer)
    play.commit_many("t", 2)
    read = peer.next()
    assert isinstance(read, NeedTask)
    play.fan.unsubscribe(peer, "t")
    peer.read_failed(read)
    assert play.take(peer) == []


def test_a_snapshot_read_older_than_what_was_sent_sends_nothing(play: Play) -> None:
    peer = play.connect(backlog=1)
    sub = play.subscribe(peer, "t", 0)
    play.frames(peer)
    play.commit_many("t", 2)  # conflated
    read = peer.next()
    assert isinstance(read, NeedTask)
    peer.task_read(read, play.book.state_at("t", 0))  # a read older than the state sent
    assert play.take(peer) == []
    assert [f.version for f in play.got[sub]] == [0]


def test_a_fill_answered_short_sends_the_newest_state_instead(play: Play) -> None:
    peer, sub = gap(play, "t", 3)
    read = peer.next()
    assert isinstance(read, NeedEntries) and (read.after, read.upto) == (0, 2)
    peer.entries_read(read, play.book.entries_now("t", 0, 1))  # 1 only
    play.take(peer)
    assert [(f.type, f.version) for f in play.got[sub]] == [("caught-up", 0), ("event", 1), ("snapshot", 3)]
    # And one answered with nothing at all.
    other, late = gap(play, "u", 3)
    read = other.next()
    assert isinstance(read, NeedEntries)
    other.entries_read(read, [])
    play.take(other)
    assert [(f.type, f.version) for f in play.got[late]] == [("caught-up", 0), ("snapshot", 3)]


# --- conflation: a bounded backlog -------------------------------------------------------------------


@pytest.mark.parametrize("extra", [1, 2, 15])
def test_a_backlog_past_its_bound_collapses_into_one_conflated_snapshot(play: Play, extra: int) -> None:
    play.commit_many("t", 2)
    peer = play.connect(backlog=BACKLOG)
    sub = play.subscribe(peer, "t", 2)
    play.frames(peer)
    for _ in range(BACKLOG + extra):
        play.commit("t")
        assert play.stats()["pending_max"] <= BACKLOG
    assert play.conflations == 1
    newest = play.book.current("t").version
    assert newest == 2 + BACKLOG + extra
    (snapshot,) = play.frames(peer)
    body = parse(snapshot)
    assert (body["type"], body["reason"], body["version"]) == ("snapshot", "conflated", newest)
    assert body["task"] == task_to_json(play.book.current("t"))
    play.commit_many("t", 2)
    play.take(peer)
    assert check_stream(play.book, "t", 2, play.got[sub]) == newest + 2
    assert [f.version for f in play.got[sub][-2:]] == [newest + 1, newest + 2]


def test_a_backlog_at_its_bound_is_not_conflated(play: Play) -> None:
    peer = play.connect(backlog=BACKLOG)
    sub = play.subscribe(peer, "t", 0)
    play.commit_many("t", BACKLOG)
    assert play.stats()["pending_max"] == BACKLOG
    play.take(peer)
    assert play.conflations == 0
    assert check_stream(play.book, "t", 0, play.got[sub]) == BACKLOG
    assert all(f.type == "event" for f in play.got[sub][1:])


def test_a_conflated_snapshot_covers_entries_committed_but_not_yet_published(play: Play) -> None:
    peer = play.connect(backlog=BACKLOG)
    sub = play.subscribe(peer, "t", 0)
    play.frames(peer)
    play.commit_many("t", BACKLOG + 1)
    late = play.commit_many("t", 2, publish=False)
    (snapshot,) = play.frames(peer)
    assert snapshot.version == BACKLOG + 3
    play.publish(*reversed(late))
    assert play.take(peer) == []
    play.commit("t")
    play.take(peer)
    assert check_stream(play.book, "t", 0, play.got[sub]) == BACKLOG + 4


@pytest.mark.parametrize("read_after", [True, False], ids=["read-after-them", "read-before-them"])
def test_conflation_while_the_resume_state_is_read(play: Play, read_after: bool) -> None:
    peer = play.connect(backlog=BACKLOG)
    sub = play.fan.subscribe(peer, "t")
    play.commit_many("t", BACKLOG + 3)
    assert play.stats()["pending_max"] <= BACKLOG
    play.resumed(sub, 0, as_of=None if read_after else 0)
    play.take(peer)
    if read_after:  # the resume frame is at the newest version already: no snapshot after it
        assert [(f.type, f.version) for f in play.got[sub]] == [("delta", BACKLOG + 3)]
    else:
        assert [(f.type, f.version) for f in play.got[sub]] == [("caught-up", 0), ("snapshot", BACKLOG + 3)]
    play.commit("t")
    play.take(peer)
    assert check_stream(play.book, "t", 0, play.got[sub]) == BACKLOG + 4


def test_a_slow_subscriber_does_not_hold_back_a_fast_one(play: Play) -> None:
    slow, fast = play.connect(backlog=BACKLOG), play.connect(backlog=BACKLOG)
    slow_sub = play.subscribe(slow, "t", 0)
    fast_sub = play.subscribe(fast, "t", 0)
    for _ in range(5 * BACKLOG):
        play.commit("t")
        play.take(fast)
        assert play.stats()["pending_max"] <= BACKLOG
    assert check_stream(play.book, "t", 0, play.got[fast_sub]) == 5 * BACKLOG
    assert all(f.type == "event" for f in play.got[fast_sub][1:])
    play.take(slow)
    assert [f.type for f in play.got[slow_sub]] == ["caught-up", "snapshot"]
    assert check_stream(play.book, "t", 0, play.got[slow_sub]) == 5 * BACKLOG


# --- straight to the socket ------------------------------------------------------------------------------


def test_entries_go_straight_to_a_socket_with_room_and_queue_in_order_when_it_has_none(play: Play) -> None:
    peer = play.connect(direct=True)
    sub = play.subscribe(peer, "t", 0)
    play.frames(peer)  # the resume frame goes through the writer
    play.commit_many("t", 3)
    assert [f.version for b in play.writes[peer] for f in unframe_all(b)] == [1, 2, 3]
    play.room[peer] = False
    play.commit_many("t", 2)  # 4, 5: no room, queued
    assert play.woken == [peer]
    play.room[peer] = True
    play.commit("t")  # 6: room again, but 4 and 5 wait in the queue: it must not overtake them
    assert len(play.writes[peer]) == 3
    play.take(peer)
    assert [f.version for f in play.got[sub]] == [0, 1, 2, 3, 4, 5, 6]
    play.commit("t")  # 7: the queue is empty again: straight to the socket
    assert len(play.writes[peer]) == 4
    assert play.direct_writes == 4
    # The terminal entry goes straight to the socket too, and the driver is told to end the stream after it.
    play.commit("t", Succeed(9_000, "s3://r", "sha256:1"))
    assert len(play.writes[peer]) == 5
    assert play.ended == [sub]
    assert check_stream(play.book, "t", 0, play.got[sub]) == 8
    assert sub.finished


def test_entries_that_pile_up_during_a_round_go_out_together_in_one_write(play: Play) -> None:
    peers = [play.connect(direct=True) for _ in range(10)]
    for peer in peers:
        play.subscribe(peer, "t", 0)
        play.frames(peer)
    c1 = play.commit("t", publish=False)
    channel = play.fan.receive(news(c1))
    play.flush(channel, slice_size=4)  # one slice: 4 sockets have 1
    assert sum(1 for peer in peers if play.writes[peer]) == 4
    for c in play.commit_many("t", 2, publish=False):  # 2, 3 during the round: the next round
        assert play.fan.receive(news(c)) is channel
    play.flush(channel)
    for peer in peers:
        assert [[f.version for f in unframe_all(b)] for b in play.writes[peer]] == [[1], [2, 3]]
    joined = {id(play.writes[peer][1]) for peer in peers}
    assert len(joined) == 1  # one join for every socket at the same point
    assert play.direct_writes == 30


def test_a_socket_far_behind_within_one_round_gets_one_conflated_snapshot_without_a_store_read(
    play: Play,
) -> None:
    peer = play.connect(direct=True, backlog=BACKLOG)
    play.subscribe(peer, "t", 0)
    play.frames(peer)
    play.book.calls.clear()
    committed = play.commit_many("t", BACKLOG + 3, publish=False)
    channel = None
    for c in committed:
        channel = play.fan.receive(news(c)) or channel
    play.flush(channel)  # one round of more entries than the backlog holds
    ((frame,),) = [unframe_all(b) for b in play.writes[peer]]
    body = parse(frame)
    assert (body["type"], body["reason"], body["version"]) == ("snapshot", "conflated", BACKLOG + 3)
    assert body["task"] == task_to_json(play.book.current("t"))
    assert play.book.calls == []
    assert (play.direct_writes, play.conflations) == (1, 1)
    play.commit("t")
    assert unframe_all(play.writes[peer][-1])[0].version == BACKLOG + 4


def test_a_socket_behind_the_round_takes_the_writer(play: Play) -> None:
    """A round that starts past the subscription's state (it resumed older than the channel): the gap is
    the writer's to fill."""
    play.commit_many("t", 2)
    a = play.connect(direct=True)
    play.subscribe(a, "t", 2)
    b = play.connect(direct=True)
    b_sub = play.fan.subscribe(b, "t")
    play.commit("t")
    play.resumed(b_sub, 0, as_of=1)  # 3 was handed out before B's state (1) was known
    play.commit("t")  # 4: B is at 1, the round at 4
    play.take(b)
    assert [f.version for f in play.got[b_sub]] == [1, 2, 3, 4]
    assert check_stream(play.book, "t", 0, play.got[b_sub]) == 4


def test_frames_are_encoded_once_per_entry(play: Play) -> None:
    peers = [play.connect() for _ in range(3)]
    for peer in peers:
        play.subscribe(peer, "t", 0)
        play.frames(peer)
    play.commit("t")
    sent = [play.frames(peer)[0] for peer in peers]
    assert sent[0] is sent[1] is sent[2]
    direct = [play.connect(direct=True) for _ in range(2)]
    for peer in direct:
        play.subscribe(peer, "t", 1)
        play.frames(peer)
    play.commit("t")
    assert play.writes[direct[0]][0] is play.writes[direct[1]][0]
    item = Published(play.book.current("t"), sent[0])
    assert item.wire is item.wire and item.conflated_wire is item.conflated_wire


# --- connections: subscriptions, turns, control frames, the close --------------------------------------


def test_unsubscribe_and_release_remove_subscriptions(play: Play) -> None:
    peer, other = play.connect(), play.connect()
    play.subscribe(peer, "t", 0)
    u = play.subscribe(peer, "u", 0)
    play.subscribe(other, "t", 0)
    assert play.stats()["subscriptions"] == 3
    play.commit("t")  # queued for peer, never sent: unsubscribed below
    play.fan.unsubscribe(peer, "t")
    play.fan.unsubscribe(peer, "nope")
    assert play.stats()["subscriptions"] == 2
    assert set(peer.subscriptions) == {"u"}
    assert [s for s, _ in play.take(peer)] == [u]
    play.commit("t")
    assert play.take(peer) == []
    assert [f.version for f in play.frames(other)] == [0, 1, 2]
    play.fan.release(peer)
    play.fan.release(other)
    assert peer.subscriptions == {} == other.subscriptions
    assert play.fan.channels == {}
    play.commit("t")  # nobody listens: nothing to do
    assert play.stats()["pending_total"] == 0


def test_subscribing_again_replaces_the_subscription(play: Play) -> None:
    play.commit_many("t", 3)
    peer = play.connect()
    first = play.subscribe(peer, "t", 0)
    play.commit("t")
    second = play.subscribe(peer, "t", 4)
    assert first.active is False
    assert play.stats()["subscriptions"] == 1
    assert peer.subscriptions == {"t": second}
    play.commit("t")
    got = play.take(peer)
    assert all(s is second for s, _ in got)
    assert check_stream(play.book, "t", 4, [f for _, f in got]) == 5


def test_at_most_max_subscriptions_per_connection(play: Play) -> None:
    peer = play.connect(max_subscriptions=1)
    play.subscribe(peer, "t", 0)
    with pytest.raises(InvalidRequest, match="at most 1 subscriptions"):
        play.subscribe(peer, "u", 0)
    play.subscribe(peer, "t", 0)  # the same task again replaces it
    assert play.stats()["subscriptions"] == 1


def test_subscriptions_of_one_connection_take_turns(play: Play) -> None:
    peer = play.connect()
    t = play.subscribe(peer, "t", 0)
    u = play.subscribe(peer, "u", 0)
    play.commit_many("t", 3)
    play.commit_many("u", 3)
    assert [s for s, _ in play.take(peer)] == [t, u] * 4


def test_control_frames_follow_what_was_queued_before_them_and_are_bounded(play: Play) -> None:
    peer = play.connect(max_control=3)
    sub = play.subscribe(peer, "t", 0)  # its resume frame is queued: a pong must not overtake it
    play.commit_many("t", 2)
    error = error_frame("invalid-request", "no", "t")
    assert peer.send_control(PONG)
    assert peer.send_control(error)
    assert peer.send_control(PONG)
    assert peer.control_full()
    assert not peer.send_control(PONG)  # past max_control: the reader waits for room
    got = play.take(peer, 4)
    assert got[0][0] is sub and got[0][1].type == "caught-up"
    assert got[1:] == [(None, PONG), (None, error), (None, PONG)]
    assert not peer.control_full()
    assert peer.send_control(PONG)
    assert play.take(peer) == [(sub, play.got[sub][1]), (None, PONG), (sub, play.got[sub][2])]
    assert check_stream(play.book, "t", 0, play.got[sub]) == 2


def test_a_closed_connection_sends_nothing_more_and_keeps_its_first_code(play: Play) -> None:
    peer = play.connect(direct=True)
    play.subscribe(peer, "t", 0)
    assert peer.has_work()
    peer.close(1001)
    peer.close(4000)
    assert peer.close_code == 1001
    assert peer.has_work()  # the end is work: the writer stops
    assert peer.next() is None
    play.commit("t")
    assert play.writes[peer] == []  # no direct write either


def test_a_socket_stuck_in_one_send_past_its_deadline_is_closed_with_4008(play: Play) -> None:
    stuck, writing, idle = (play.connect(direct=True) for _ in range(3))
    for peer in (stuck, writing, idle):
        play.subscribe(peer, "t", 0)
    stuck.writing_since = 100.0
    writing.writing_since = 109.5
    assert [peer.stalled(110.0, 5.0) for peer in (stuck, writing, idle)] == [True, False, False]
    assert stuck.close_code == CLOSE_SLOW_CONSUMER
    assert stuck.writing_since is None and not stuck.direct
    assert writing.close_code is None and idle.close_code is None
    assert not writing.quiet()  # a send under way: nothing overtakes it
    writing.writing_since = None
    play.take(writing)
    play.commit("t")
    assert play.writes[stuck] == []  # after its stuck send, nothing may go straight out
    assert [f.version for b in play.writes[writing] for f in unframe_all(b)] == [1]


def test_a_pong_on_an_idle_connection_goes_at_once(play: Play) -> None:
    peer = play.connect()
    play.subscribe(peer, "t", 0)
    play.frames(peer)
    assert not peer.has_work()
    assert peer.send_control(PONG)
    assert peer.has_work()
    assert play.take(peer) == [(None, PONG)]


def test_removing_a_subscription_twice_or_after_it_was_replaced_is_harmless(play: Play) -> None:
    peer = play.connect()
    first = play.subscribe(peer, "t", 0)
    second = play.subscribe(peer, "t", 0)
    play.fan.remove(first)  # replaced already
    assert peer.subscriptions == {"t": second}
    play.fan.remove(second)
    play.fan.remove(second)
    assert peer.subscriptions == {} and play.fan.channels == {}


def test_a_socket_ahead_of_the_round_gets_nothing_straight_from_it(play: Play) -> None:
    """Its state was read after the round's entries were committed (the bus brought them late): they go
    the writer's way, which drops them."""
    play.commit_many("t", 2)
    first = play.connect(direct=True)
    play.subscribe(first, "t", 2)
    play.frames(first)
    late = play.commit_many("t", 2, publish=False)
    ahead = play.connect(direct=True)
    sub = play.subscribe(ahead, "t", 4)
    play.frames(ahead)
    play.publish(*late)
    assert play.writes[ahead] == []
    assert play.take(ahead) == []
    assert [f.version for f in play.got[sub]] == [4]
    assert [f.version for b in play.writes[first] for f in unframe_all(b)] == [3, 4]


def test_a_late_answer_hands_out_only_what_the_channel_does_not_have(play: Play) -> None:
    peer = play.connect()
    play.subscribe(peer, "t", 0)
    c1, c2 = play.commit_many("t", 2, publish=False)
    play.publish(c2)  # ahead of 1: a read is due
    read = play.fan.next_read()
    assert isinstance(read, NeedEntries)
    entries = play.book.entries_now("t", 0, NEWEST)
    play.publish(c1)  # the bus brings 1 after all: 1 and 2 are handed out
    assert play.fan.channels["t"].version == 2
    assert play.fan.entries_read(read, entries) is None  # nothing new in it
    assert [f.version for f in play.frames(peer)] == [0, 1, 2]


def test_a_channel_whose_newest_entry_is_not_found_hands_out_nothing(play: Play) -> None:
    peer = play.connect()
    sub = play.fan.subscribe(peer, "t")
    play.commit("t", publish=False)
    play.receive(News("t", 1))
    get = play.fan.next_read()
    assert isinstance(get, NeedTask)
    play.fan.task_read(get, play.book.current("t"))
    newest = play.fan.next_read()
    assert isinstance(newest, NeedEntries)
    assert play.fan.entries_read(newest, []) is None
    play.resumed(sub, 0, as_of=0)
    assert [f.version for f in play.frames(peer)] == [0]  # the next message or check brings 1


def test_a_task_read_that_finds_nothing_newer_than_the_channel_reads_no_more(play: Play) -> None:
    play.commit("t")
    peer = play.connect()
    sub = play.fan.subscribe(peer, "t")
    play.receive(News("t", 1))
    get = play.fan.next_read()
    assert isinstance(get, NeedTask)
    play.resumed(sub, 0)  # the state (1) lands during the read
    assert play.fan.task_read(get, play.book.current("t")) is None
    assert play.fan.next_read() is None
    assert [f.version for f in play.frames(peer)] == [1]


def test_an_answer_to_a_connection_that_no_longer_awaits_it_changes_nothing(play: Play) -> None:
    peer, sub = gap(play, "t", 3)
    read = peer.next()
    assert isinstance(read, NeedEntries)
    play.fan.unsubscribe(peer, "t")
    peer.entries_read(read, play.book.entries_now("t", 0, 2))
    assert play.take(peer) == []
    assert [f.version for f in play.got[sub]] == [0]


def test_nothing_goes_straight_to_a_socket_while_its_writer_sends(play: Play) -> None:
    """The writer took the resume frame and is sending it: entry 1 must not overtake it, nor, while a
    frame is being prepared (a read for it under way), any later entry."""
    peer = play.connect(direct=True)
    sub = play.subscribe(peer, "t", 0)
    assert [f.type for f in play.frames(peer, 1)] == ["caught-up"]
    peer.writing_since = 5.0  # its send under way
    play.commit("t")
    assert play.writes[peer] == []
    peer.writing_since = None
    play.take(peer)
    assert [f.version for f in play.got[sub]] == [0, 1]
    play.commit("t")
    assert len(play.writes[peer]) == 1  # straight out again


def test_the_deadline_of_a_send_is_inclusive(play: Play) -> None:
    peer = play.connect(direct=True)
    peer.writing_since = 100.0
    assert not peer.stalled(110.0, 10.0)
    assert peer.close_code is None
    assert peer.stalled(110.001, 10.0)


def test_the_fake_book_answers_as_book(play: Play) -> None:
    """The twin itself: resume modes, delta entries bounded by the version read, entries_between."""
    play.commit_many("t", 10)
    book: FakeBook = play.book
    resume = book.resume_now("t", 4)
    assert (resume.mode, resume.reason, resume.task.version) == ("delta", None, 10)
    assert [v for v, _ in resume.entries] == list(range(5, 11))
    assert book.resume_now("t", 1).mode == "snapshot"
    assert book.resume_now("t", 11).reason == "cursor-ahead"
    assert list(book.resume_now("t", 10).entries) == []
    assert [v for v, _ in book.resume_now("t", 2, as_of=5).entries] == [3, 4, 5]
    assert [v for v, _ in book.entries_now("t", 2, 5)] == [3, 4, 5]
    with pytest.raises(UnknownTask):
        book.get_now("nope")


def test_a_terminal_entry_for_a_subscription_with_streams_goes_through_its_writer(play: Play) -> None:
    """Its writer sends the streams' last chunks and their end frames after the terminal frame, then ends
    the stream: straight to the socket, the terminal frame would end it before them."""
    peer = play.connect(direct=True)
    sub = play.subscribe(peer, "t", 0)
    play.frames(peer)
    sub.streams = SubStreams({"output": 0})  # (its catch-up is test_peer_streams' to play)
    play.commit("t")
    assert len(play.writes[peer]) == 1  # an entry that does not end the task: straight out
    play.commit("t", Succeed(9_000, "s3://r", "sha256:1"))
    # The terminal one: queued for the writer, which is woken; the stream not ended by the driver.
    assert len(play.writes[peer]) == 1 and play.ended == [] and play.woken == [peer]
    assert [item.task.version for item in sub.pending or ()] == [2]
