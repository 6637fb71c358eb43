"""Tag subscriptions in the fan-out core (``gateway.live.tagging``) in plain calls: no event loop, no socket.

:class:`tests.unit.fanout_play.Play` does the hub's part (the bus's news, rounds, the connections' writers,
the store reads), so each test states an interleaving outright: when a task is created, when its news
comes, which step of a tag's subscribe (subscribe, list, subscribe the listed tasks, read, merge) it
falls between. :class:`tests.unit.fanout_play.Client` holds every frame a connection gets to protocol.md:
the ``tag`` frame, then each listed task's resume frame in the listing's order, then ``event`` frames;
``added`` then ``snapshot`` (``reason: "new"``) for a task created later, announced at most once; per task
no gap, no repeat, a ``conflated`` snapshot the only jump.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import orjson
import pytest

from gateway.bus.base import MAX_PAYLOAD_BYTES, News
from gateway.errors import InvalidRequest
from gateway.frames import PONG, Frame
from gateway.live.tagging import MARGIN_MS, MIN_REMEMBERED, NEW, Tagging
from gateway.machine import Succeed, task_to_json
from tests.unit.fanout_play import BACKLOG, Client, Play
from tests.unit.fanout_play import news as news_of

TAG = "owner:u42"
OTHER = "project:7"


@pytest.fixture
def play() -> Play:
    return Play()


def kinds(bodies: list[dict[str, Any]]) -> list[tuple[str, str | None, str | None]]:
    """Each frame as (type, its task, its reason); a ``tag`` frame as (type, its tag, None), an ``added``
    frame as (type, its tag, its task)."""
    out: list[tuple[str, str | None, str | None]] = []
    for b in bodies:
        if b["type"] in ("tag", "added"):
            out.append((b["type"], b["tag"], b.get("taskId")))
        else:
            out.append((b["type"], b.get("taskId"), b.get("reason")))
    return out


# --- subscribe: the tag frame, the resume frames, then the events ------------------------------------------


def test_a_tag_subscribe_answers_the_tag_frame_then_each_listed_tasks_resume_frame_then_its_events(
    play: Play,
) -> None:
    for i in range(5):
        play.create(f"t{i}", [TAG])
    play.create("other", [OTHER])
    play.create("untagged")
    play.commit_many("t0", 12)
    play.commit_many("t1", 5)
    play.commit_many("t2", 3)
    play.commit_many("t3", 1)
    # t0 far behind, t1 within retention, t2 caught up, t3 ahead (another history), t4 unknown to the client.
    cursors = {"t0": 1, "t1": 2, "t2": 3, "t3": 9, "gone": 4}
    peer = play.connect()
    play.subscribe_tag(peer, TAG, cursors)
    client = Client(play.book, cursors)
    bodies = client.feed(play.frames(peer))
    assert bodies[0] == {"type": "tag", "tag": TAG, "taskIds": ["t4", "t3", "t2", "t1", "t0"], "more": False}
    assert kinds(bodies[1:]) == [
        ("snapshot", "t4", "new"),
        ("snapshot", "t3", "cursor-ahead"),
        ("caught-up", "t2", None),
        ("delta", "t1", None),
        ("snapshot", "t0", "retention"),
    ]
    play.commit("t2")
    play.commit("t0")
    play.commit("other")
    play.commit("untagged")
    assert [(b["taskId"], b["version"]) for b in client.feed(play.frames(peer))] == [("t2", 4), ("t0", 13)]
    assert client.added == []
    # The tag's tasks stream as any subscription, pongs in order among them.
    play.commit("t4")
    assert peer.send_control(PONG)
    play.commit("t4")
    bodies = client.feed(play.frames(peer))
    assert kinds(bodies) == [("event", "t4", None), ("pong", None, None), ("event", "t4", None)]


def test_at_most_the_limit_are_listed_newest_first_then_by_id_and_more_says_some_were_left_out(
    play: Play,
) -> None:
    play.book.create("a", tags=[TAG], created_at_ms=5)
    play.book.create("b", tags=[TAG], created_at_ms=7)
    play.book.create("c", tags=[TAG], created_at_ms=7)
    play.book.create("d", tags=[TAG], created_at_ms=3)
    peer = play.connect()
    tag_sub = play.subscribe_tag(peer, TAG, limit=3)
    bodies = Client(play.book).feed(play.frames(peer))
    assert bodies[0] == {"type": "tag", "tag": TAG, "taskIds": ["c", "b", "a"], "more": True}
    assert set(peer.subscriptions) == {"a", "b", "c"}
    assert tag_sub.floor == (5, "a")
    assert not tag_sub.listing and tag_sub.known == {"a": (5, ""), "b": (7, ""), "c": (7, "")}
    assert play.stats()["subscriptions"] == 3


def test_a_tag_with_no_task_is_answered_with_an_empty_tag_frame(play: Play) -> None:
    peer = play.connect()
    play.subscribe_tag(peer, TAG)
    assert Client(play.book).feed(play.frames(peer)) == [
        {"type": "tag", "tag": TAG, "taskIds": [], "more": False}
    ]
    assert play.reads("resume_many") == []  # nothing to read


# --- tasks created while the tag is listed and read --------------------------------------------------------


@pytest.mark.parametrize("when", ["before-the-list", "after-the-list", "after-listed", "after-the-read"])
def test_a_task_created_while_the_tag_is_listed_is_streamed_once_with_no_entry_lost(
    play: Play, when: str
) -> None:
    """Created (and its news heard, and an entry committed) between two steps of the subscribe: before the
    list read it is listed like the others; after it, it is announced after the resume frames, its entry
    following its snapshot. Either way once."""
    play.create("old", [TAG])
    peer = play.connect()
    tag_sub, removed = play.tagging.subscribe(peer, TAG, play.book.clock)
    assert removed == []

    def create_new() -> None:
        play.create("new", [TAG])
        play.commit("new")  # its news comes while the subscription collects it: held for it

    if when == "before-the-list":
        create_new()
    task_ids, more = play.book.list_now(TAG, 10)
    if when == "after-the-list":
        create_new()
    play.tagging.listed(tag_sub, task_ids)
    if when == "after-listed":
        create_new()
    resumes = play.book.resume_many_now(dict.fromkeys(task_ids, NEW))
    if when == "after-the-read":
        create_new()
    channels, gone = play.tagging.resumed(tag_sub, task_ids, more, resumes, {})
    assert gone == []
    for channel in channels:
        play.flush(channel)
    play.announce(play.book.state_at("new", 0))  # the news again (an echo): never a second announcement
    play.commit("new")
    play.commit("old")
    client = Client(play.book)
    bodies = client.feed(play.frames(peer))
    if when == "before-the-list":
        # The resume frames in the listing's order, then the events (each task's turn in order).
        assert kinds(bodies) == [
            ("tag", TAG, None),
            ("snapshot", "new", "new"),
            ("snapshot", "old", "new"),
            ("event", "new", None),
            ("event", "old", None),
        ]
        assert client.added == []
    else:
        assert kinds(bodies[:2]) == [("tag", TAG, None), ("snapshot", "old", "new")]
        assert bodies[0]["taskIds"] == ["old"]
        new = [(b["type"], b.get("reason"), b.get("version")) for b in bodies if b.get("taskId") == "new"]
        # As created, then its entry committed meanwhile, then the next.
        assert new == [("added", None, None), ("snapshot", "new", 0), ("event", None, 1), ("event", None, 2)]
        assert client.added == [(TAG, "new")]
    assert client.held == {"old": 1, "new": 2}
    assert play.stats()["pending_total"] == 0


@pytest.mark.parametrize("when", ["before-listed", "after-listed"])
def test_a_listed_task_whose_news_comes_late_is_not_announced(play: Play, when: str) -> None:
    peer = play.connect()
    tag_sub, _ = play.tagging.subscribe(peer, TAG, play.book.clock)
    late = play.create("late", [TAG], publish=False)  # committed before the list read; its news comes after
    task_ids, more = play.book.list_now(TAG, 10)
    if when == "before-listed":
        play.announce(late)
    play.tagging.listed(tag_sub, task_ids)
    if when == "after-listed":
        play.announce(late)
    play.tag_resumed(tag_sub, task_ids, more, {})
    client = Client(play.book)
    assert kinds(client.feed(play.frames(peer))) == [("tag", TAG, None), ("snapshot", "late", "new")]
    assert client.added == []


@pytest.mark.parametrize("read_after", [True, False], ids=["read-after-them", "read-before-them"])
def test_entries_of_a_listed_task_committed_while_its_state_is_read_no_gap_no_repeat(
    play: Play, read_after: bool
) -> None:
    play.create("t", [TAG])
    play.commit_many("t", 3)
    peer = play.connect()
    tag_sub, _ = play.tagging.subscribe(peer, TAG, play.book.clock)
    task_ids, more = play.book.list_now(TAG, 10)
    play.tagging.listed(tag_sub, task_ids)  # live entries collect from here on
    play.commit("t")  # 4: published at once
    held = play.commit("t", publish=False)  # 5: held back
    play.commit("t")  # 6: waits in the channel for 5
    resumes = {"t": play.book.resume_now("t", 2, as_of=None if read_after else 3)}
    channels, _ = play.tagging.resumed(tag_sub, task_ids, more, resumes, {"t": 2})
    for channel in channels:
        play.flush(channel)
    play.publish(held)
    play.commit("t")  # 7
    client = Client(play.book, {"t": 2})
    bodies = client.feed(play.frames(peer))
    resumed_at = 6 if read_after else 3
    assert [(b["type"], b.get("version")) for b in bodies] == [
        ("tag", None),
        ("delta", resumed_at),
        *[("event", v) for v in range(resumed_at + 1, 8)],
    ]


# --- unsubscribe, replace, limits, the connection's deadline ---------------------------------------------


@pytest.mark.parametrize("when", ["before-listed", "before-resumed"])
def test_a_tag_unsubscribed_while_it_is_read_queues_nothing_and_leaves_nothing(play: Play, when: str) -> None:
    play.create("t", [TAG])
    peer = play.connect()
    tag_sub, _ = play.tagging.subscribe(peer, TAG, play.book.clock)
    task_ids, more = play.book.list_now(TAG, 10)
    if when == "before-listed":
        assert play.tagging.unsubscribe(peer, TAG) == []
    play.tagging.listed(tag_sub, task_ids)
    play.create("new", [TAG])  # buffered while it is read, or heard by no one
    if when == "before-resumed":
        removed = play.tagging.unsubscribe(peer, TAG)
        assert sorted(sub.task_id for sub in removed) == ["new", "t"]
        assert not any(sub.active for sub in removed)
    assert play.tag_resumed(tag_sub, task_ids, more, {}) == []
    play.commit("t")
    play.commit("new")
    assert play.take(peer) == []
    assert (peer.subscriptions, peer.tags, peer.owned) == ({}, {}, 0)
    assert play.fan.channels == {} and play.tagging.watched == {}
    assert play.tagging.unsubscribe(peer, TAG) == []
    assert play.tagging.drop(tag_sub) == []  # twice: harmless


def test_one_socket_streams_each_task_once_whichever_subscribed_last(play: Play) -> None:
    play.create("a", [TAG])
    play.create("b", [TAG, OTHER])
    peer = play.connect()
    client = Client(play.book)
    play.subscribe_tag(peer, TAG)
    client.feed(play.frames(peer))
    # A task's subscribe to a task the tag streams takes it over (its resume frame from the client's cursor).
    client.subscribing("a")
    play.subscribe(peer, "a", client.cursors["a"])
    assert peer.subscriptions["a"].owner is None
    assert kinds(client.feed(play.frames(peer))) == [("caught-up", "a", None)]
    # A second tag listing b takes b over.
    play.subscribe_tag(peer, OTHER, client.subscribing_tag(OTHER))
    assert kinds(client.feed(play.frames(peer))) == [("tag", OTHER, None), ("caught-up", "b", None)]
    assert peer.subscriptions["b"].owner is peer.tags[OTHER]
    assert (peer.owned, len(peer.tags)) == (1, 2)
    # Unsubscribing the first tag ends neither: a is the task's own subscription, b the second tag's.
    assert play.tagging.unsubscribe(peer, TAG) == []
    play.commit("a")
    play.commit("b")
    assert kinds(client.feed(play.frames(peer))) == [("event", "a", None), ("event", "b", None)]
    (b_sub,) = play.tagging.unsubscribe(peer, OTHER)
    assert b_sub.task_id == "b" and not b_sub.active
    play.commit("b")
    assert play.take(peer) == []
    # A tag's subscribe takes over the task's own subscription of a task it lists.
    play.subscribe_tag(peer, TAG, client.subscribing_tag(TAG))
    assert kinds(client.feed(play.frames(peer))) == [
        ("tag", TAG, None),
        ("delta", "b", None),
        ("caught-up", "a", None),
    ]
    assert peer.subscriptions["a"].owner is peer.tags[TAG]
    assert peer.owned == 2


def test_a_task_unsubscribed_by_its_id_streams_on_in_a_tag_that_lists_it(play: Play) -> None:
    """A client's unsubscribe of a task ends the task's own subscription; a tag of the connection that
    listed or announced the task streams it on, on the same stream. A stream a tag owns is not the task's
    subscription: an unsubscribe by its id leaves it."""
    play.create("a", [TAG])
    play.create("b", [TAG])
    play.create("lone")
    peer = play.connect()
    client = Client(play.book)
    play.subscribe_tag(peer, TAG)
    client.feed(play.frames(peer))
    for task_id in ("a", "lone"):
        client.subscribing(task_id)
        play.subscribe(peer, task_id, client.cursors.get(task_id, 0))
    client.feed(play.frames(peer))
    listing, _ = play.tagging.subscribe(peer, OTHER, play.book.clock)  # a tag still listing inherits nothing
    assert play.tagging.unsubscribe_task(peer, "a") is None
    assert (
        peer.subscriptions["a"].owner is peer.tags[TAG]
        and peer.tags[TAG].streams["a"] is peer.subscriptions["a"]
    )
    assert play.tagging.unsubscribe_task(peer, "b") is None  # the tag's own stream
    assert play.tagging.unsubscribe_task(peer, "gone") is None
    lone = play.tagging.unsubscribe_task(peer, "lone")  # no tag knows it: its subscription ends
    assert lone is not None and not lone.active and "lone" not in peer.subscriptions
    assert (set(peer.subscriptions), peer.owned) == ({"a", "b"}, 2)
    play.tagging.drop(listing)
    for task_id in ("a", "b", "lone"):
        play.commit(task_id)
    assert kinds(client.feed(play.frames(peer))) == [("event", "a", None), ("event", "b", None)]


def test_subscribing_to_a_tag_again_replaces_the_earlier_subscription_and_its_streams(play: Play) -> None:
    play.create("a", [TAG])
    peer = play.connect()
    first = play.subscribe_tag(peer, TAG)
    old_a = peer.subscriptions["a"]
    play.commit("a")  # queued for the first, never sent: replaced below
    second, removed = play.tagging.subscribe(peer, TAG, play.book.clock)
    assert removed == [old_a] and not first.active and not old_a.active
    assert peer.tags == {TAG: second}
    task_ids, more = play.book.list_now(TAG, 10)
    play.tagging.listed(second, task_ids)
    play.tag_resumed(second, task_ids, more, {"a": 0})
    client = Client(play.book, {"a": 0})
    # The first subscribe's answer is sent all the same; what it listed streams from the second.
    assert kinds(client.feed(play.frames(peer))) == [
        ("tag", TAG, None),
        ("tag", TAG, None),
        ("delta", "a", None),
    ]


def test_a_tag_counts_as_one_subscription_whatever_it_streams(play: Play) -> None:
    for i in range(5):
        play.create(f"t{i}", [TAG])
    play.create("x")
    play.create("y")
    peer = play.connect(max_subscriptions=2)
    play.subscribe_tag(peer, TAG)
    assert len(peer.subscriptions) == 5
    play.subscribe(peer, "x", 0)
    with pytest.raises(InvalidRequest, match="at most 2 subscriptions"):
        play.subscribe(peer, "y", 0)
    with pytest.raises(InvalidRequest, match="at most 2 subscriptions"):
        play.tagging.subscribe(peer, OTHER, play.book.clock)
    with pytest.raises(InvalidRequest, match="at most 2 subscriptions"):
        play.subscribe(peer, "t0", 0)  # a task the tag streams, by its id, would count: refused ...
    assert peer.subscriptions["t0"].owner is peer.tags[TAG]  # ... and the tag still streams it
    play.subscribe_tag(peer, TAG)  # the same tag again replaces it
    play.subscribe(peer, "x", 0)  # and the same task
    assert len(peer.subscriptions) == 6 and set(peer.tags) == {TAG}


def test_a_live_tag_subscription_holds_its_connection_whatever_it_streams(play: Play) -> None:
    """A connection held to having a subscription (``/v1/ws``) counts a tag it subscribed to as held, from
    its subscribe, with no task and after every task it streamed has ended."""
    peer = play.connect()
    peer.hold_to(0.0, 10.0, 5)
    play.tagging.subscribe(peer, TAG, play.book.clock)
    assert not peer.idle_overdue(20.0)  # being read: held already
    play.tagging.unsubscribe(peer, TAG)
    tag_sub = play.subscribe_tag(peer, TAG)
    assert peer.idle_since is None and peer.refusals == 0
    assert not peer.idle_overdue(100.0)
    play.create("t", [TAG])
    play.commit("t")
    play.commit("t", Succeed(9_000, "s3://r", "sha256:1"))
    client = Client(play.book)
    assert kinds(client.feed(play.frames(peer))) == [
        ("tag", TAG, None),
        ("added", TAG, "t"),
        ("snapshot", "t", "new"),
        ("event", "t", None),
        ("event", "t", None),
    ]
    (sub,) = tag_sub.streams.values()
    assert sub.finished
    play.fan.remove(sub)  # the endpoint ends a task's stream after its terminal frame
    peer.let_go(50.0)
    assert tag_sub.streams == {} and peer.owned == 0
    assert not peer.idle_overdue(100.0)
    play.tagging.unsubscribe(peer, TAG)
    peer.let_go(60.0)
    assert not peer.idle_overdue(69.0)
    assert peer.idle_overdue(70.0)


def test_a_listed_task_that_ended_gets_its_resume_frame_and_its_stream_ends(play: Play) -> None:
    play.create("done", [TAG])
    play.commit("done")
    play.commit("done", Succeed(9_000, "s3://r", "sha256:1"))
    peer = play.connect()
    tag_sub = play.subscribe_tag(peer, TAG, {"done": 1})
    client = Client(play.book, {"done": 1})
    assert kinds(client.feed(play.frames(peer))) == [("tag", TAG, None), ("delta", "done", None)]
    assert tag_sub.streams["done"].finished


def test_a_slow_connection_gets_one_conflated_snapshot_of_a_task_its_tag_streams(play: Play) -> None:
    play.create("t", [TAG])
    peer = play.connect(backlog=BACKLOG)
    play.subscribe_tag(peer, TAG)
    client = Client(play.book)
    client.feed(play.frames(peer))
    play.commit_many("t", 3 * BACKLOG)
    assert play.stats()["pending_max"] <= BACKLOG
    assert kinds(client.feed(play.frames(peer))) == [("snapshot", "t", "conflated")]
    play.commit("t")
    assert kinds(client.feed(play.frames(peer))) == [("event", "t", None)]
    assert client.held["t"] == 3 * BACKLOG + 1


def test_release_ends_every_tag_subscription_of_a_connection(play: Play) -> None:
    play.create("a", [TAG])
    play.create("b", [OTHER])
    peer, other = play.connect(), play.connect()
    play.subscribe_tag(peer, TAG)
    play.subscribe_tag(peer, OTHER)
    play.subscribe_tag(other, TAG)
    removed = play.tagging.release(peer)
    assert sorted(sub.task_id for sub in removed) == ["a", "b"]
    assert (peer.tags, peer.subscriptions) == ({}, {})
    assert list(play.tagging.watched) == [TAG]
    assert list(play.fan.channels) == ["a"]


# --- news of creations ------------------------------------------------------------------------------------


def test_a_task_created_with_the_tag_is_announced_then_streamed(play: Play) -> None:
    peer, elsewhere = play.connect(), play.connect()
    play.subscribe_tag(peer, TAG)
    play.subscribe_tag(elsewhere, OTHER)
    client = Client(play.book)
    client.feed(play.frames(peer))
    play.create("t", [TAG, "zone:eu"])
    play.create("u", [OTHER])
    play.commit("t")
    bodies = client.feed(play.frames(peer))
    assert bodies[0] == {"type": "added", "tag": TAG, "taskId": "t"}
    assert kinds(bodies[1:]) == [("snapshot", "t", "new"), ("event", "t", None)]
    assert bodies[1]["task"]["tags"] == [TAG, "zone:eu"]
    assert [(b["type"], b.get("taskId")) for b in Client(play.book).feed(play.frames(elsewhere))] == [
        ("tag", None),
        ("added", "u"),
        ("snapshot", "u"),
    ]
    play.announce(play.book.state_at("t", 0))  # the news again: never announced twice
    assert play.take(peer) == []


def test_a_task_created_with_two_watched_tags_gets_an_added_frame_per_tag_and_one_snapshot(
    play: Play,
) -> None:
    peer = play.connect()
    play.subscribe_tag(peer, TAG)
    play.subscribe_tag(peer, OTHER)
    client = Client(play.book)
    client.feed(play.frames(peer))
    play.create("both", [OTHER, TAG])
    play.commit("both")
    assert kinds(client.feed(play.frames(peer))) == [
        ("added", TAG, "both"),
        ("added", OTHER, "both"),
        ("snapshot", "both", "new"),
        ("event", "both", None),
    ]
    assert client.added == [(TAG, "both"), (OTHER, "both")]
    assert peer.subscriptions["both"].owner is peer.tags[OTHER]  # the last of them streams it


def test_a_tag_unsubscribed_leaves_streaming_the_tasks_another_tag_of_the_connection_has(play: Play) -> None:
    """Its tasks' streams end, but those of tasks another tag of the connection listed or announced: that
    one streams them on, what was queued for them included."""
    peer = play.connect()
    play.subscribe_tag(peer, TAG)
    play.subscribe_tag(peer, OTHER)
    client = Client(play.book)
    client.feed(play.frames(peer))
    play.create("both", [OTHER, TAG])
    play.create("mine", [OTHER])
    assert peer.subscriptions["both"].owner is peer.tags[OTHER]
    (ended,) = play.tagging.unsubscribe(peer, OTHER)
    assert ended.task_id == "mine" and not ended.active
    assert peer.subscriptions["both"].owner is peer.tags[TAG]
    assert peer.tags[TAG].streams == {"both": peer.subscriptions["both"]} and peer.owned == 1
    play.commit("both")
    play.commit("mine")
    assert kinds(client.feed(play.frames(peer))) == [
        ("added", TAG, "both"),
        ("added", OTHER, "both"),
        ("snapshot", "both", "new"),
        ("event", "both", None),
    ]
    play.tagging.unsubscribe(peer, TAG)
    assert (peer.subscriptions, peer.owned) == ({}, 0)


def test_a_task_announced_while_another_tag_of_the_connection_lists_is_announced_by_both(play: Play) -> None:
    """One tag of the connection streams the task as it is created; the other, still listing, announces
    it in its turn (subscribing to it last), the first one's ``added`` frame still first: its writer reads
    the task again for what came meanwhile."""
    peer = play.connect()
    play.subscribe_tag(peer, TAG)
    client = Client(play.book)
    client.feed(play.frames(peer))
    listing, _ = play.tagging.subscribe(peer, OTHER, play.book.clock)
    task_ids, more = play.book.list_now(OTHER, 10)
    play.tagging.listed(listing, task_ids)
    play.create("both", [OTHER, TAG])  # TAG announces it; OTHER buffers it
    play.commit("both")
    play.book.calls.clear()
    play.tag_resumed(listing, task_ids, more, {})
    bodies = client.feed(play.frames(peer))
    assert kinds(bodies) == [
        ("tag", OTHER, None),
        ("added", TAG, "both"),
        ("added", OTHER, "both"),
        ("snapshot", "both", "new"),
        ("snapshot", "both", "conflated"),
    ]
    assert [b["version"] for b in bodies if b["type"] == "snapshot"] == [0, 1]
    assert play.reads("get") == [("get", "both", 1, 1)]
    assert peer.subscriptions["both"].owner is listing


def test_a_task_another_tag_already_streams_is_announced_from_where_the_connection_is_never_back(
    play: Play,
) -> None:
    """A task created with two tags the socket follows, the second one still listing: the first streams it
    (its snapshot and events sent), the second announces it when its listing is merged. Its ``added`` frame
    comes with the task as the connection already has it, not as it was created: the client's task never
    steps back to an older version."""
    peer = play.connect()
    play.subscribe_tag(peer, TAG)
    client = Client(play.book)
    client.feed(play.frames(peer))
    listing, _ = play.tagging.subscribe(peer, OTHER, play.book.clock)
    task_ids, more = play.book.list_now(OTHER, 10)
    play.tagging.listed(listing, task_ids)
    play.create("both", [OTHER, TAG])  # TAG announces it; OTHER buffers it as created
    play.commit_many("both", 2)
    assert [(b["type"], b["version"]) for b in client.feed(play.frames(peer))[1:]] == [
        ("snapshot", 0),
        ("event", 1),
        ("event", 2),
    ]
    play.tag_resumed(listing, task_ids, more, {})
    bodies = client.feed(play.frames(peer))
    assert kinds(bodies) == [("tag", OTHER, None), ("added", OTHER, "both"), ("snapshot", "both", "new")]
    assert bodies[2]["version"] == 2
    assert peer.subscriptions["both"].owner is listing
    play.commit("both")
    assert [b["version"] for b in client.feed(play.frames(peer))] == [3]


def test_a_listed_task_taken_over_by_another_tags_announcement_gets_no_second_resume(play: Play) -> None:
    """The news of a task comes late: a newer tag of the connection lists it, then the older tag (which
    never heard of it) announces it, streaming it; if it is deleted before the listing's read, nothing is
    left of it."""
    peer = play.connect()
    play.subscribe_tag(peer, TAG)
    client = Client(play.book)
    client.feed(play.frames(peer))
    kept = play.create("kept", [OTHER, TAG], publish=False)
    play.create("deleted", [OTHER, TAG], publish=False)
    listing, _ = play.tagging.subscribe(peer, OTHER, play.book.clock)
    task_ids, more = play.book.list_now(OTHER, 10)
    play.tagging.listed(listing, task_ids)
    play.announce(kept)
    play.announce(play.book.state_at("deleted", 0))
    deleted = play.book.states.pop("deleted")
    assert play.tag_resumed(listing, task_ids, more, {}) == []
    play.book.states["deleted"] = deleted  # for the client's checks
    bodies = client.feed(play.frames(peer))
    assert [b for b in bodies if b["type"] == "tag"] == [
        {"type": "tag", "tag": OTHER, "taskIds": ["kept"], "more": False}
    ]
    for task_id in ("kept", "deleted"):
        assert [k for k in kinds(bodies) if task_id in k] == [
            ("added", TAG, task_id),
            ("snapshot", task_id, "new"),
        ]
    assert len(bodies) == 5
    assert listing.known == {"kept": (kept.created_at_ms, "")}


def test_a_listed_task_deleted_before_the_read_is_left_out_of_the_tag_frame(play: Play) -> None:
    play.create("kept", [TAG])
    play.create("deleted", [TAG])
    peer = play.connect()
    tag_sub, _ = play.tagging.subscribe(peer, TAG, play.book.clock)
    task_ids, more = play.book.list_now(TAG, 10)
    play.tagging.listed(tag_sub, task_ids)
    deleted = play.book.states.pop("deleted")
    (gone,) = play.tag_resumed(tag_sub, task_ids, more, {})
    play.book.states["deleted"] = deleted  # for the client's checks
    assert gone.task_id == "deleted" and not gone.active
    assert kinds(Client(play.book).feed(play.frames(peer))) == [
        ("tag", TAG, None),
        ("snapshot", "kept", "new"),
    ]
    assert set(peer.subscriptions) == {"kept"} and set(tag_sub.known) == {"kept"}
    assert peer.owned == 1


def test_news_of_a_creation_too_big_for_a_message_is_left_to_the_reconcile(play: Play) -> None:
    peer = play.connect()
    play.subscribe_tag(peer, TAG)
    play.book.create("big", tags=[TAG])
    assert play.tagging.created(News("big", 0, created=True)) == []
    assert set(peer.subscriptions) == set()


def test_news_of_a_creation_is_no_entry_for_a_task_subscription(play: Play) -> None:
    task = play.book.create("t", tags=[TAG])
    peer = play.connect()
    sub = play.fan.subscribe(peer, "t")
    play.receive(News.creation(task))  # no state yet: an entry would be handed out
    play.resumed(sub, 0)
    assert [(f.type, f.version) for f in play.frames(peer)] == [("caught-up", 0)]
    assert play.fan.channels["t"].outbox == []


# --- the reconcile: creations whose news was lost ---------------------------------------------------------


def test_the_reconcile_finds_a_creation_whose_news_was_lost(play: Play) -> None:
    play.tagging.reconciled = True
    play.create("old", [TAG])
    peer = play.connect()
    client = Client(play.book)
    play.subscribe_tag(peer, TAG)
    client.feed(play.frames(peer))
    play.create("lost", [TAG], publish=False)
    play.commit("lost")  # its entry's news reaches no subscription here
    play.book.calls.clear()
    play.reconcile()
    assert [call[0] for call in play.book.calls] == ["tagged_since", "resume_many"]
    bodies = client.feed(play.frames(peer))
    assert kinds(bodies) == [("added", TAG, "lost"), ("snapshot", "lost", "new")]
    assert bodies[1]["version"] == 1
    assert play.reads("get") == [("get", "lost", 1, 1)]  # its writer looked again: nothing newer
    play.commit("lost")
    assert kinds(client.feed(play.frames(peer))) == [("event", "lost", None)]
    play.book.calls.clear()
    play.reconcile()  # nothing new: one query
    assert [call[0] for call in play.book.calls] == ["tagged_since"]
    assert play.take(peer) == []
    assert client.added == [(TAG, "lost")]


def test_an_entry_committed_between_the_reconciles_read_and_its_announcement_follows_as_a_snapshot(
    play: Play,
) -> None:
    peer = play.connect()
    play.subscribe_tag(peer, TAG)
    client = Client(play.book)
    client.feed(play.frames(peer))
    play.create("lost", [TAG], publish=False)
    check = play.tagging.checks()
    assert check is not None
    missing = play.tagging.unknown(play.book.tagged_since_now(*check))
    assert missing == ["lost"]
    resumes = play.book.resume_many_now(dict.fromkeys(missing, NEW))
    play.commit("lost")  # heard by no subscription: it is not announced yet
    for channel in play.tagging.found(resume.task for resume in resumes.values()):
        play.flush(channel)
    play.commit("lost")
    assert [(b["type"], b.get("reason"), b.get("version")) for b in client.feed(play.frames(peer))] == [
        ("added", None, None),
        ("snapshot", "new", 0),
        ("snapshot", "conflated", 2),
    ]


def test_the_reconcile_announces_no_task_the_subscription_was_there_before(play: Play) -> None:
    """A listing cut at the limit leaves older tasks out: the reconcile finds them unknown, reads them once,
    and remembers them without announcing them; a task whose news was lost is announced. A subscription
    still listing is not looked at."""
    play.tagging.reconciled = True
    for name in ("a", "b", "c", "d"):
        play.create(name, [TAG])
    peer = play.connect()
    tag_sub = play.subscribe_tag(peer, TAG, limit=2)
    client = Client(play.book)
    client.feed(play.frames(peer))
    listing = play.connect()
    play.tagging.subscribe(listing, OTHER, play.book.clock)
    play.create("lost", [TAG, OTHER], publish=False)
    play.reconcile()
    assert kinds(client.feed(play.frames(peer))) == [("added", TAG, "lost"), ("snapshot", "lost", "new")]
    assert set(tag_sub.known) == {"a", "b", "c", "d", "lost"}
    assert set(peer.subscriptions) == {"c", "d", "lost"}
    assert play.take(listing) == []
    play.book.calls.clear()
    play.reconcile()
    assert [call[0] for call in play.book.calls] == ["tagged_since"]


def test_the_reconcile_lists_the_watched_tags_since_their_oldest_start_or_the_horizon(play: Play) -> None:
    tagging: Tagging[str] = play.tagging
    assert tagging.checks() is None
    play.book.clock = 100_000
    peer = play.connect()
    play.subscribe_tag(peer, TAG)
    play.book.clock = 150_000
    play.subscribe_tag(peer, OTHER)
    listing, _ = tagging.subscribe(play.connect(), "zone:eu", play.book.clock)
    assert tagging.checks() == ([TAG, OTHER], 100_000 - MARGIN_MS)
    tagging.checked(200_000)  # a subscription still listing keeps the horizon at its start
    assert tagging.horizon_ms == 150_000 - MARGIN_MS
    assert tagging.checks() == ([TAG, OTHER], 150_000 - MARGIN_MS)
    tagging.drop(listing)
    tagging.checked(200_000)
    assert tagging.horizon_ms == 200_000 - MARGIN_MS
    assert tagging.checks() == ([TAG, OTHER], 200_000 - MARGIN_MS)


# --- what a tag subscription remembers stays bounded -------------------------------------------------------


def test_without_a_reconcile_a_tag_subscription_forgets_tasks_a_margin_older_than_the_newest(
    play: Play,
) -> None:
    play.tagging = Tagging(play.fan, margin_ms=100)
    peer = play.connect()
    tag_sub = play.subscribe_tag(peer, TAG)
    assert tag_sub.cap == MIN_REMEMBERED
    for i in range(MIN_REMEMBERED):
        play.create(f"t{i}", [TAG])
        assert len(tag_sub.known) == i + 1
    newest = play.create("newest", [TAG])
    assert min(at for at, _ in tag_sub.known.values()) == newest.created_at_ms - 100
    assert len(tag_sub.known) == 101 and tag_sub.cap == MIN_REMEMBERED


def test_with_a_reconcile_a_tag_subscription_forgets_only_tasks_created_before_its_horizon(
    play: Play,
) -> None:
    play.tagging = Tagging(play.fan, margin_ms=100)
    play.tagging.reconciled = True
    peer = play.connect()
    tag_sub = play.subscribe_tag(peer, TAG)
    for i in range(MIN_REMEMBERED + 10):  # no reconcile yet: no horizon, nothing forgotten
        play.create(f"t{i}", [TAG])
    assert len(tag_sub.known) == MIN_REMEMBERED + 10
    assert tag_sub.cap == 2 * (MIN_REMEMBERED + 1)
    play.book.clock += 1_000
    play.reconcile()
    horizon = play.tagging.horizon_ms
    assert horizon == play.book.clock - 100
    play.create("a", [TAG])
    play.create("b", [TAG])  # past the horizon: t..., kept
    for i in range(MIN_REMEMBERED):
        play.create(f"u{i}", [TAG])
    assert all(at >= horizon for at, _ in tag_sub.known.values())
    assert {"a", "b"} <= set(tag_sub.known)


# --- news of a creation on the bus ------------------------------------------------------------------------


def test_news_of_a_creation_travels_as_its_snapshot_and_is_told_apart_from_an_entry(play: Play) -> None:
    task = play.book.create("t", tags=[OTHER, TAG])
    news = News.creation(task)
    text = news.encode()
    assert orjson.loads(text) == {
        "type": "snapshot",
        "taskId": "t",
        "version": 0,
        "reason": "new",
        "task": task_to_json(task),
    }
    assert News.decode(text) == news
    assert News.decode(text.encode()).created
    assert News.decode(text).task == task  # its tags included
    entry = play.commit("t")
    heard = News.decode(news_of(entry).encode())
    assert not heard.created and heard.frame is not None and heard.frame.type == "event"
    # Too big for a message, it still says it is a creation (the reconcile finds the task).
    bare = replace(news, frame=Frame("snapshot", 0, "x" * (MAX_PAYLOAD_BYTES + 1)))
    assert orjson.loads(bare.encode()) == {"taskId": "t", "version": 0, "created": True}
    assert News.decode(bare.encode()) == News("t", 0, created=True)
    assert News.decode('{"taskId": "t", "version": 3}') == News("t", 3)
