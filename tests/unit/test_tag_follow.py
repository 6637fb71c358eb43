"""A tag subscription's client side without a server (``gateway.client.tag_follow``, under ``watch_tag``):
the cursors map it sends, what it hands on of each frame and when it asks again. Examples of what a gateway
may send (an overlap after a resubscribe, a task made anew, a limit), then Hypothesis: a simulated gateway
whose tasks change while frames are lost, connections drop and ids are deleted and made again: the client
hands on each task's entries in order, none twice, a snapshot only for a task it had no cursor for (or one
made again under an id it knew), and ends holding every task's final version."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.client.errors import WatchError
from gateway.client.tag_follow import TagFollower, Then
from tests.support.examples import examples

TAG = "owner:u42"


def task(task_id: str, version: int, created: int, state: str = "running", epoch: str = "") -> dict[str, Any]:
    made = {
        "id": task_id,
        "state": state,
        "expiresAtMs": 2_000_000_000_000,
        "attempts": 1,
        "maxAttempts": 3,
        "progress": 0,
        "version": version,
        "tags": [TAG],
        "createdAtMs": created,
    }
    if epoch:
        made["epoch"] = epoch
    return made


CREATED = {"a": 1, "b": 2, "c": 3, "d": 4}


def entry(version: int) -> dict[str, Any]:
    return {"version": version, "event": {"type": "progress", "atMs": 1, "progress": version, "cursor": ""}}


def snapshot(task_id: str, version: int, reason: str = "new", epoch: str = "") -> dict[str, Any]:
    made = task(task_id, version, CREATED[task_id], epoch=epoch)
    return {"type": "snapshot", "taskId": task_id, "version": version, "reason": reason, "task": made}


def caught_up(task_id: str, version: int) -> dict[str, Any]:
    return {"type": "caught-up", "taskId": task_id, "version": version, "task": task(task_id, version, 0)}


def delta(task_id: str, version: int, versions: list[int]) -> dict[str, Any]:
    made = task(task_id, version, CREATED[task_id])
    return {
        "type": "delta",
        "taskId": task_id,
        "version": version,
        "events": [entry(v) for v in versions],
        "task": made,
    }


def event(task_id: str, version: int, epoch: str = "") -> dict[str, Any]:
    made = task(task_id, version, CREATED[task_id], epoch=epoch)
    return {
        "type": "event",
        "taskId": task_id,
        "version": version,
        "event": entry(version)["event"],
        "task": made,
    }


def listing(*ids: str, more: bool = False) -> dict[str, Any]:
    return {"type": "tag", "tag": TAG, "taskIds": list(ids), "more": more}


def sent(follower: TagFollower) -> dict[str, Any]:
    message: dict[str, Any] = orjson.loads(follower.subscribe_message())
    return message


def play(follower: TagFollower, *frames: dict[str, Any]) -> list[tuple[Any, Then]]:
    return [follower.take(frame) for frame in frames]


def handed(results: list[tuple[Any, Then]]) -> list[tuple[str, str, int]]:
    return [
        (f.get("taskId", f.get("tag")), f["type"], f.get("version", -1)) for f, _ in results if f is not None
    ]


def test_the_subscribe_message_sends_every_cursor_and_the_map_is_the_callers() -> None:
    mine = {"a": 4}
    follower = TagFollower(TAG, "tag-token", mine)
    assert sent(follower) == {"type": "subscribe", "tag": TAG, "cursors": {"a": 4}, "token": "tag-token"}
    assert sent(TagFollower(TAG, None)) == {"type": "subscribe", "tag": TAG, "cursors": {}}  # open mode
    play(follower, listing("b", "a"), snapshot("b", 0), delta("a", 6, [5, 6]), event("b", 1))
    assert mine == {"a": 6, "b": 1}  # kept up to date in place, finished tasks and all
    with pytest.raises(ValueError, match="cursors\\['a'\\]: must be an integer >= 0, got -1"):
        TagFollower(TAG, None, {"a": -1})


def test_a_gap_asks_again_once_and_nothing_is_handed_twice() -> None:
    follower = TagFollower(TAG, None)
    sent(follower)
    first = play(follower, listing("b", "a"), snapshot("b", 3), snapshot("a", 1), event("b", 4))
    assert handed(first) == [(TAG, "tag", -1), ("b", "snapshot", 3), ("a", "snapshot", 1), ("b", "event", 4)]
    # b's entry 5 is lost: ask again, once, however many frames follow before the answer.
    assert follower.take(event("b", 6)) == (None, Then.SUBSCRIBE)
    assert sent(follower)["cursors"] == {"b": 4, "a": 1}
    assert follower.take(event("b", 7)) == (None, Then.NOTHING)
    # Frames of the old subscription still on their way are applied when they follow on, never twice.
    later = play(follower, event("a", 2), event("a", 2), listing("b", "a"), delta("b", 7, [5, 6, 7]))
    later += play(follower, delta("a", 2, [2]), event("b", 7), event("b", 8))
    assert handed(later) == [
        ("a", "event", 2),
        (TAG, "tag", -1),
        ("b", "delta", 7),
        ("a", "delta", 2),
        ("b", "event", 8),
    ]
    overlap = later[4][0]
    assert overlap is not None and overlap["events"] == []  # entry 2 was handed on already
    assert follower.cursors == {"b": 8, "a": 2}


def test_added_tasks_a_task_made_anew_and_tasks_no_longer_listed() -> None:
    follower = TagFollower(TAG, None, {"a": 4, "gone": 9})
    sent(follower)
    results = play(
        follower,
        listing("a"),  # "gone" was deleted by retention: forgotten
        snapshot("a", 2, reason="cursor-ahead"),  # a was made anew: its lower version replaces the old
        caught_up("a", 1),  # stale: behind what was applied
        event("a", 3),
        {"type": "added", "tag": TAG, "taskId": "d"},
        event("d", 1),  # before its snapshot: not applied
        snapshot("d", 1),
        event("d", 2),
        event("c", 1),  # not this tag's task
        {"type": "tag", "tag": "project:7", "taskIds": ["x"], "more": False},  # another tag's
    )
    assert handed(results) == [
        (TAG, "tag", -1),
        ("a", "snapshot", 2),
        ("a", "event", 3),
        ("d", "added", -1),
        ("d", "snapshot", 1),
        ("d", "event", 2),
    ]
    assert follower.cursors == {"a": 3, "d": 2}
    assert set(follower.tasks) == {"a", "d"}
    assert all(then is Then.NOTHING for _, then in results)


def test_more_cursors_than_the_gateway_takes_are_cut_to_the_newest_then_it_gives_up() -> None:
    follower = TagFollower(TAG, None)
    sent(follower)
    play(follower, listing("b", "a"), snapshot("b", 1), snapshot("a", 1))
    play(follower, {"type": "added", "tag": TAG, "taskId": "c"}, snapshot("c", 0))
    assert sent(follower)["cursors"] == {"b": 1, "a": 1, "c": 0}
    refused = {"type": "error", "code": "invalid-request", "message": "cursors: at most 2", "tag": TAG}
    assert follower.take(refused) == (None, Then.SUBSCRIBE)
    assert sent(follower)["cursors"] == {"c": 0, "b": 1}  # the two newest
    with pytest.raises(WatchError, match=r"^invalid-request: cursors: at most 2 \(tag owner:u42\)$"):
        follower.take(refused)


def test_a_listing_cut_short_bounds_the_cursors_sent() -> None:
    follower = TagFollower(TAG, None)
    sent(follower)
    play(follower, listing("b", "a", more=True), snapshot("b", 1), snapshot("a", 1))
    play(follower, {"type": "added", "tag": TAG, "taskId": "c"}, snapshot("c", 0))
    assert sent(follower)["cursors"] == {"c": 0, "b": 1}


def test_cursors_carry_their_tasks_epochs_and_a_task_made_again_replaces_the_one_known() -> None:
    """Each cursor goes with the epoch of its task's history (``version:epoch``), kept in the caller's map
    beside the versions; a task made again under an id it knew comes as a ``recreated`` snapshot (after a
    reconnect) or as ``added`` then a ``snapshot`` (while it follows), and replaces what it held."""
    mine, epochs = {"a": 4}, {"a": "e1"}
    follower = TagFollower(TAG, None, mine, epochs)
    assert sent(follower)["cursors"] == {"a": "4:e1"}
    results = play(
        follower,
        listing("b", "a"),
        snapshot("a", 0, "recreated", epoch="e2"),  # the a it knew was deleted, and its id made again
        event("a", 1, epoch="e2"),
        snapshot("b", 3, epoch="e3"),
        {"type": "added", "tag": TAG, "taskId": "b"},  # b deleted and made again while followed
        event("b", 4, epoch="e3"),  # the old b's, on its way: its state is gone
        snapshot("b", 0, epoch="e4"),
        event("b", 1, epoch="e4"),
    )
    assert handed(results) == [
        (TAG, "tag", -1),
        ("a", "snapshot", 0),
        ("a", "event", 1),
        ("b", "snapshot", 3),
        ("b", "added", -1),
        ("b", "snapshot", 0),
        ("b", "event", 1),
    ]
    assert (mine, epochs) == ({"a": 1, "b": 1}, {"a": "e2", "b": "e4"})
    assert sent(follower)["cursors"] == {"b": "1:e4", "a": "1:e2"}
    follower.take(event("a", 2))  # a task with no epoch (a gateway before epochs): a bare version
    assert sent(follower)["cursors"] == {"b": "1:e4", "a": 2}
    with pytest.raises(ValueError, match="epochs\\['a'\\]: must be a task's epoch, got 'e 1'"):
        TagFollower(TAG, None, {"a": 1}, {"a": "e 1"})


def test_the_cursors_sent_fit_the_gateways_limit_on_a_message_newest_first() -> None:
    """300 tasks of 42-character ids: 4 KiB on a new socket (the newest that fit), 64 KiB once it answered
    (all of them), half as much after a close 1009 (a gateway with a lower limit)."""
    ids = [f"nightly-export-of-the-ledger-{n:05d}-eu-west" for n in range(300)]
    follower = TagFollower(TAG, "t" * 200, dict.fromkeys(ids, 7))
    first = follower.subscribe_message()
    assert 3_500 < len(first.encode()) <= 4_096
    sent = list(orjson.loads(first)["cursors"])
    assert 50 < len(sent) < 300 and sent == sorted(ids, reverse=True)[: len(sent)]  # by id, no task known yet
    later = follower.subscribe_message(authorized=True)
    assert len(orjson.loads(later)["cursors"]) == 300 and len(later.encode()) <= 65_536
    # Once the tasks are known, the newest by creation (ids[0] the newest here).
    play(follower, listing(*ids), *({**caught_up(i, 7), "task": task(i, 7, -n)} for n, i in enumerate(ids)))
    follower.too_big()
    halved = follower.subscribe_message()
    assert len(halved.encode()) <= 2_048
    kept = list(orjson.loads(halved)["cursors"])
    assert kept == ids[: len(kept)] and 20 < len(kept) < len(sent)


@pytest.mark.parametrize("code", ["unauthorized", "forbidden", "invalid-request"])
def test_a_refusal_retrying_cannot_cure_raises(code: str) -> None:
    follower = TagFollower(TAG, "bad")
    sent(follower)
    with pytest.raises(WatchError) as raised:
        follower.take({"type": "error", "code": code, "message": "no", "tag": TAG})
    assert (raised.value.code, raised.value.tag, raised.value.task_id) == (code, TAG, None)


def test_other_errors_are_retried_later_and_errors_of_others_ignored() -> None:
    follower = TagFollower(TAG, None)
    sent(follower)
    unavailable = {"type": "error", "code": "unavailable", "message": "the database", "tag": TAG}
    assert follower.take(unavailable) == (None, Then.RETRY_LATER)
    other = {"type": "error", "code": "forbidden", "message": "no", "tag": "project:7"}
    assert follower.take(other) == (None, Then.NOTHING)
    task_error = {"type": "error", "code": "unknown-task", "message": "no", "taskId": "a"}
    assert follower.take(task_error) == (None, Then.NOTHING)
    assert follower.take({"type": "pong"}) == (None, Then.NOTHING)


# --- a simulated gateway ---------------------------------------------------------------------------------


@dataclass
class Gateway:
    """The tag's tasks (id -> version, creation order, the epoch of each id's history) and the frames on
    their way to the client."""

    versions: dict[str, int] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    epochs: dict[str, str] = field(default_factory=dict)
    wire: list[dict[str, Any]] = field(default_factory=list)
    made: int = 0  # tasks created, ids made again included: each one's epoch

    def task(self, task_id: str) -> dict[str, Any]:
        return task(task_id, self.versions[task_id], self.order.index(task_id), epoch=self.epochs[task_id])

    def subscribe(self, message: str) -> None:
        """Answer a subscribe: the listing, each task's resume frame from the client's cursor."""
        cursors = orjson.loads(message)["cursors"]
        newest = list(reversed(self.order))
        self.wire.append({"type": "tag", "tag": TAG, "taskIds": newest, "more": False})
        for task_id in newest:
            version, sent, epoch = self.versions[task_id], cursors.get(task_id), None
            cursor = int(sent.split(":")[0]) if isinstance(sent, str) else sent
            if isinstance(sent, str):
                epoch = sent.split(":")[1]
            base = {"taskId": task_id, "version": version, "task": self.task(task_id)}
            if cursor is None:
                self.wire.append({"type": "snapshot", "reason": "new", **base})
            elif epoch is not None and epoch != self.epochs[task_id]:
                self.wire.append({"type": "snapshot", "reason": "recreated", **base})
            elif cursor == version:
                self.wire.append({"type": "caught-up", **base})
            else:
                self.wire.append(
                    {"type": "delta", "events": [entry(v) for v in range(cursor + 1, version + 1)], **base}
                )

    def create(self, task_id: str | None = None) -> None:
        """A task created (with a new id; ``task_id``: the id of one deleted just before, made again)."""
        task_id = task_id or f"t{len(self.order)}"
        self.versions[task_id] = 0
        self.order.append(task_id)
        self.made += 1
        self.epochs[task_id] = f"e{self.made}"
        self.wire.append({"type": "added", "tag": TAG, "taskId": task_id})
        self.wire.append(
            {"type": "snapshot", "taskId": task_id, "version": 0, "reason": "new", "task": self.task(task_id)}
        )

    def recreate(self, pick: int) -> None:
        """Retention deletes a task; its id is made again (another epoch), announced as any creation."""
        if self.order:
            task_id = self.order.pop(pick % len(self.order))
            self.create(task_id)

    def commit(self, pick: int, lost: bool) -> None:
        if not self.order:
            return
        task_id = self.order[pick % len(self.order)]
        self.versions[task_id] += 1
        version = self.versions[task_id]
        if not lost:
            frame = {"type": "event", "taskId": task_id, "version": version, "event": entry(version)["event"]}
            self.wire.append({**frame, "task": self.task(task_id)})


STEPS = st.lists(
    st.one_of(
        st.just(("create", 0)),
        st.tuples(st.just("commit"), st.integers(0, 9)),
        st.tuples(st.just("lose"), st.integers(0, 9)),
        st.tuples(st.just("deliver"), st.integers(1, 6)),
        st.just(("drop", 0)),
        st.tuples(st.just("recreate"), st.integers(0, 9)),
    ),
    max_size=60,
)


@settings(max_examples=examples(300), deadline=None)
@given(steps=STEPS, known=st.integers(0, 3))
def test_through_losses_and_drops_no_entry_comes_twice_or_out_of_order_and_all_end_exact(
    steps: list[tuple[str, int]], known: int
) -> None:
    gateway = Gateway()
    for _ in range(known):  # tasks there before the first subscription
        gateway.create()
    gateway.wire.clear()
    follower = TagFollower(TAG, None)
    have: dict[str, int] = {}  # what the client was handed, per task: the version it reached
    held: dict[str, str] = {}  # and the epoch of that task's history

    def check(frame: dict[str, Any]) -> None:
        kind, task_id = frame["type"], frame.get("taskId")
        if kind in ("tag", "added"):
            return
        assert task_id is not None
        epoch = frame["task"]["epoch"]
        if kind == "snapshot" and held.get(task_id, epoch) != epoch:
            # A task made again under an id it held: replaced, whatever its version, never carried on.
            assert frame["reason"] in ("new", "recreated"), frame
            have.pop(task_id)
        held[task_id] = epoch
        if kind == "snapshot":
            # Only for a task it did not know when it subscribed (nothing conflates here): one it learned of
            # while that subscription was on its way comes again, at its version then (which a lost entry
            # may have moved on: the snapshot is the task after it); so does one made again meanwhile.
            assert task_id not in have or frame["version"] >= have[task_id], (frame, have)
            assert task_id not in have or frame["reason"] in ("new", "recreated"), frame
        elif kind == "event":
            assert frame["version"] == have[task_id] + 1, (frame, have)
        elif kind == "delta":
            assert [e["version"] for e in frame["events"]] == list(
                range(have[task_id] + 1, frame["version"] + 1)
            )
        else:
            assert frame["version"] == have[task_id], (frame, have)
        have[task_id] = frame["version"]

    def deliver(count: int) -> None:
        for _ in range(count):
            if not gateway.wire:
                return
            shown, then = follower.take(gateway.wire.pop(0))
            if shown is not None:
                check(shown)
            if then is Then.SUBSCRIBE:
                gateway.subscribe(follower.subscribe_message())  # same socket: after what is on its way

    gateway.subscribe(follower.subscribe_message())
    for step, arg in steps:
        if step == "create":
            gateway.create()
        elif step == "recreate":
            gateway.recreate(arg)
        elif step in ("commit", "lose"):
            gateway.commit(arg, lost=step == "lose")
        elif step == "deliver":
            deliver(arg)
        else:  # the connection drops: what was on its way is lost; a new one subscribes with the cursors
            gateway.wire.clear()
            gateway.subscribe(follower.subscribe_message())
    deliver(10_000)
    # A lost entry with nothing after it is noticed only by the next subscription (a reconnect, say).
    gateway.subscribe(follower.subscribe_message())
    deliver(10_000)
    assert have == gateway.versions
    assert dict(follower.cursors) == gateway.versions
    assert {task_id: t["version"] for task_id, t in follower.tasks.items()} == gateway.versions
    assert held == dict(follower.epochs) == gateway.epochs
