"""A task id made again after retention deleted its task, in the pure cores (``gateway.machine``,
``gateway.live.fanout``, ``peer``, ``tagging``), in plain calls: no event loop, no socket.

The new task is another history under the same id (another ``epoch``): version N of one is not version N
of the other. A cursor of the old one resumes with a ``snapshot`` (``recreated``) whatever its version; a
tag subscription that knew the old one announces the new one as any created task; a channel left on the
old one's last state takes the new one's entries instead of dropping them as already handed out; a
connection that reads the task for a snapshot and finds the new one says so.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.bus.base import News
from gateway.errors import InvalidRequest
from gateway.frames import Frame
from gateway.live.fanout import Peer, Subscription
from gateway.live.peer import TagSub
from gateway.live.tagging import NEW
from gateway.machine import (
    RECREATED,
    Start,
    Succeed,
    Task,
    resume_from,
    same_history,
    task_from_json,
    task_to_json,
)
from tests.unit.fake_book import FakeBook
from tests.unit.fanout_play import Play, news

TAG = "re:X"
OLD, LATER = "0123456789ab", "ba9876543210"


@pytest.fixture
def play() -> Play:
    return Play()


def seen(frames: list[Frame]) -> list[tuple[Any, ...]]:
    """Each frame as (type, version, reason, its task's epoch); ``tag`` and ``added`` as (type, tag,
    task ids or id)."""
    out: list[tuple[Any, ...]] = []
    for body in (orjson.loads(frame.text) for frame in frames):
        if body["type"] in ("tag", "added"):
            out.append((body["type"], body["tag"], body.get("taskId", body.get("taskIds"))))
        else:
            out.append((body["type"], body["version"], body.get("reason"), body["task"].get("epoch")))
    return out


def finish(play: Play, *, publish: bool = True) -> None:
    """The task starts (v1) and succeeds (v2)."""
    play.commit("t", Start(play.book.clock, "w1"), publish=publish)
    play.commit("t", Succeed(play.book.clock, "s3://r", "sha256:r"), publish=publish)


def recreate(book: FakeBook, *, tags: tuple[str, ...] = ()) -> Task:
    """Retention deletes the task; a create of its id makes another history."""
    book.delete("t")
    book.clock += 1
    return book.create("t", tags=tags, epoch=LATER)


# --- the machine: which resume a cursor of another history gets ---------------------------------------------


@pytest.mark.parametrize(
    ("cursor", "epoch", "expected"),
    [
        (2, OLD, ("caught-up", None)),  # its own history: by version, as ever
        (2, None, ("caught-up", None)),  # a bare version: taken as the history the id names now
        (1, None, ("delta", None)),
        (9, OLD, ("snapshot", "cursor-ahead")),
        (2, LATER, ("snapshot", RECREATED)),  # another history: whatever its version
        (0, LATER, ("snapshot", RECREATED)),
        (9, LATER, ("snapshot", RECREATED)),
    ],
)
def test_a_cursor_of_another_history_resumes_with_a_snapshot_whatever_its_version(
    cursor: int, epoch: str | None, expected: tuple[str, str | None]
) -> None:
    task = Task("t", "running", 10**12, 1, 3, 40, 2, epoch=OLD)
    assert resume_from(task, cursor, 8, epoch) == expected
    assert same_history(task, epoch) == (expected[1] != RECREATED)


def test_a_cursor_of_another_history_is_still_checked() -> None:
    task = Task("t", "running", 10**12, 1, 3, 40, 2, epoch=OLD)
    with pytest.raises(InvalidRequest, match="cursorVersion must be an integer >= 0"):
        resume_from(task, -1, 8, LATER)


def test_the_epoch_travels_with_the_task_and_a_task_without_one_shows_none() -> None:
    task = Task("t", "queued", 10**12, 0, 3, 0, 0, created_at_ms=5, epoch=OLD)
    assert task_to_json(task)["epoch"] == OLD
    assert task_from_json(task_to_json(task)) == task
    plain = Task("t", "queued", 10**12, 0, 3, 0, 0)
    assert "epoch" not in task_to_json(plain)
    assert task_from_json(task_to_json(plain)).epoch == ""


# --- a channel left on the old history ----------------------------------------------------------------------


def slow_old_subscriber(play: Play) -> tuple[Peer[str], Subscription[str]]:
    """A connection that subscribed to the old task and has not read its last frames yet: the channel
    stays, its last state the old one's ``succeeded v2``."""
    play.book.create("t", epoch=OLD)
    old = play.connect()
    sub = play.subscribe(old, "t", 0)
    assert seen(play.frames(old)) == [("caught-up", 0, None, OLD)]
    finish(play)
    last = play.fan.channels["t"].last
    assert last is not None and last.terminal
    return old, sub


def test_a_new_subscriber_of_a_recreated_id_gets_its_entries_on_a_channel_left_on_the_old_one(
    play: Play,
) -> None:
    old, sub = slow_old_subscriber(play)
    recreate(play.book)
    new = play.connect()
    play.subscribe(new, "t", 0)
    play.commit("t", Start(play.book.clock, "w2"))
    assert seen(play.frames(new)) == [("caught-up", 0, None, LATER), ("event", 1, None, LATER)]
    # The old subscriber gets its own history's end (its writer lets it go after it: finished).
    assert seen(play.frames(old, 2)) == [("event", 1, None, OLD), ("event", 2, None, OLD)]
    assert sub.finished


@pytest.mark.parametrize("unheard", [0, 3])
def test_news_of_a_recreated_id_is_handed_out_though_its_version_was_handed_out_before(
    play: Play, unheard: int
) -> None:
    """The channel's last state is the old ``v2``: news of the new task at v1 (or at v4, its first entries'
    news lost) is of a later history, not an echo of the old one."""
    old, sub = slow_old_subscriber(play)
    assert play.fan.wants("t", 1)  # the hub reads such news (else dropped unread as handed out before)
    recreate(play.book)
    late = play.connect()
    late_sub = play.fan.subscribe(late, "t")  # subscribed; its resume state is read later
    play.commit_many("t", unheard, publish=False)
    play.commit("t")
    assert play.fan.channels["t"].last == play.book.current("t")
    play.resumed(late_sub, 0, as_of=0)
    expected = [("caught-up", 0, None, LATER)] + [("event", v, None, LATER) for v in range(1, unheard + 2)]
    assert seen(play.frames(late)) == expected
    assert seen(play.frames(old, 2)) == [("event", 1, None, OLD), ("event", 2, None, OLD)]
    assert sub.finished


def test_a_channel_that_starts_again_stands_where_the_new_tasks_subscribers_are_not_the_old_ones(
    play: Play,
) -> None:
    """The channel learnt of the new task at version 0 and forgot the old one; a subscriber of the new one
    resumes at version 3 while a subscriber of the old one still holds its version 0: the channel goes on
    from the new one's 3 (from the old one's 0, the new task's entries would be replayed on the old task)."""
    slow_old_subscriber(play)
    recreate(play.book)
    play.receive(News("t", 0))
    play.catch_up()
    assert play.fan.channels["t"].last is None
    play.commit_many("t", 3, publish=False)
    new = play.connect()
    play.subscribe(new, "t", 3)
    play.commit("t")
    assert seen(play.frames(new)) == [("caught-up", 3, None, LATER), ("event", 4, None, LATER)]


def test_a_round_of_the_old_tasks_end_and_the_new_ones_entries_ends_a_socket_of_the_old_one_at_its_end(
    play: Play,
) -> None:
    """Both heard before fan-out's turn, one round holds the old task's last entry and the new task's first.
    A socket of the old one that takes direct writes gets them through its writer, which stops at the old
    one's end; written straight to the socket, the new one's v1 would follow the old one's end."""
    play.book.create("t", epoch=OLD)
    old = play.connect(direct=True)
    sub = play.subscribe(old, "t", 0)
    play.frames(old)
    play.commit("t", Start(play.book.clock, "w1"))  # v1: straight to the socket
    done = play.commit("t", Succeed(play.book.clock, "s3://r", "sha256:r"), publish=False)
    channel = play.fan.receive(news(done))
    recreate(play.book)
    started = play.commit("t", Start(play.book.clock, "w2"), publish=False)
    assert play.fan.receive(news(started)) is channel
    play.flush(channel)
    assert len(play.writes[old]) == 1 and play.ended == []
    assert seen(play.frames(old)) == [("event", 2, None, OLD)]
    assert sub.finished


def test_a_bare_wake_up_of_a_channel_left_on_an_ended_task_reads_which_history_it_is(play: Play) -> None:
    slow_old_subscriber(play)
    play.receive(News("t", 2))  # too big for a message: a bare wake-up, of a version handed out before
    # And the periodic check: an ended task's id may have been made again, at any version.
    assert play.fan.known() == {"t": -1}
    play.fan.behind({"t": 2})
    play.catch_up()
    assert play.reads("get") == [("get", "t", 2, 2)] and play.reads("entries") == []  # the same one
    recreate(play.book)
    play.commit("t", Start(play.book.clock, "w2"), publish=False)
    play.receive(News("t", 1))
    play.catch_up()
    assert play.fan.channels["t"].last == play.book.current("t")  # the new one's newest entry, handed out
    play.fan.behind({"t": 1})  # one that goes on is read only when the store is ahead of it
    assert not play.fan.reads_due
    assert not play.fan.wants("t", 1)


def test_a_conflated_subscriber_of_the_old_task_is_sent_the_new_one_as_recreated(play: Play) -> None:
    """Its backlog dropped (the old task's end among it), its writer reads the task for a snapshot and finds
    the task made again: a ``recreated`` snapshot, whatever the versions, then the new task's events."""
    play.book.create("t", epoch=OLD)
    peer = play.connect(backlog=1)
    play.subscribe(peer, "t", 0)
    play.frames(peer)
    finish(play)
    recreate(play.book)
    assert seen(play.frames(peer)) == [("snapshot", 0, RECREATED, LATER)]
    play.commit("t", Start(play.book.clock, "w2"))
    assert seen(play.frames(peer)) == [("event", 1, None, LATER)]


# --- a tag subscription that knew the old task --------------------------------------------------------------


def knowing(play: Play) -> tuple[Peer[str], TagSub[str]]:
    """A tag subscriber that followed the old task from its creation to its end (its stream let go after
    the terminal frame, as its writer does)."""
    peer = play.connect()
    tag_sub = play.subscribe_tag(peer, TAG)
    play.announce(play.book.create("t", tags=(TAG,), epoch=OLD))
    finish(play)
    assert seen(play.frames(peer)) == [
        ("tag", TAG, []),
        ("added", TAG, "t"),
        ("snapshot", 0, "new", OLD),
        ("event", 1, None, OLD),
        ("event", 2, None, OLD),
    ]
    play.fan.unsubscribe(peer, "t")
    return peer, tag_sub


def test_a_tag_subscriber_is_told_of_a_task_made_again_under_an_id_it_knew(play: Play) -> None:
    peer, tag_sub = knowing(play)
    made = recreate(play.book, tags=(TAG,))
    play.announce(made)
    play.announce(made)  # the same news again (a bus that repeats itself): announced once
    play.commit("t", Start(play.book.clock, "w2"))
    assert seen(play.frames(peer)) == [
        ("added", TAG, "t"),
        ("snapshot", 0, "new", LATER),
        ("event", 1, None, LATER),
    ]
    assert tag_sub.known == {"t": (made.created_at_ms, LATER)}


def test_a_reconcile_finds_a_task_made_again_whose_news_was_lost(play: Play) -> None:
    play.tagging.reconciled = True
    peer, _ = knowing(play)
    recreate(play.book, tags=(TAG,))
    play.reconcile()
    play.reconcile()
    assert seen(play.frames(peer)) == [("added", TAG, "t"), ("snapshot", 0, "new", LATER)]


def listing(play: Play, peer: Peer[str]) -> tuple[TagSub[str], list[str]]:
    """A tag's subscribe up to its listing (steps 1 to 3), the old task listed."""
    tag_sub, _ = play.tagging.subscribe(peer, TAG, play.book.clock)
    task_ids, _ = play.book.list_now(TAG, 10)
    play.tagging.listed(tag_sub, task_ids)
    return tag_sub, task_ids


@pytest.mark.parametrize("read", ["old", "none"])
def test_a_task_made_again_while_a_tag_subscribe_lists_and_reads_is_announced_after_its_listing(
    play: Play, read: str
) -> None:
    """The listing finds the old task; retention deletes it and its id is made again before the merge: the
    read found the old one (``old``) or, deleted by then, none (``none``). The new one is announced (an
    ``added`` frame for a listed task) and streamed, never the old one's state."""
    play.book.create("t", tags=(TAG,), epoch=OLD)
    finish(play, publish=False)
    peer = play.connect()
    tag_sub, task_ids = listing(play, peer)
    if read == "none":
        play.book.delete("t")
    resumes = play.book.resume_many_now(dict.fromkeys(task_ids, NEW))
    made = (
        recreate(play.book, tags=(TAG,)) if read == "old" else play.book.create("t", tags=(TAG,), epoch=LATER)
    )
    play.announce(made)  # buffered: the subscription is still listing
    channels, _ = play.tagging.resumed(tag_sub, task_ids, False, resumes, {})
    for channel in channels:
        play.flush(channel)
    listed = ["t"] if read == "old" else []
    assert seen(play.frames(peer)) == [
        ("tag", TAG, listed),
        ("added", TAG, "t"),
        ("snapshot", 0, "new", LATER),
    ]
    play.commit("t", Start(play.book.clock, "w2"))
    assert seen(play.frames(peer)) == [("event", 1, None, LATER)]
