"""The pure cores beside a task's history (issue 34), in plain calls: metadata and its merge patches
(``gateway.metadata``), a batch's counts and the parent's progress from them (``gateway.children``), what
the gateway records of runs (``gateway.task_times``), the task's JSON, the frames and bus message of the
state beside the history (``gateway.frames.Beside``) and a subscription's side of them
(``gateway.live.beside``): only the newest state waits, nothing older than what the client holds goes."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from gateway.children import children_progress, ended, moved
from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.frames import Beside
from gateway.json_merge_patch import merge_patch
from gateway.live.beside import BesideOut
from gateway.live.fanout import Peer, Subscription
from gateway.machine import (
    Entry,
    Expire,
    Fail,
    Progress,
    Start,
    Succeed,
    Task,
    Transition,
    apply_event,
    create_task,
    task_from_json,
    task_to_json,
)
from gateway.metadata import MAX_METADATA_BYTES, encoded, patched
from gateway.task_times import stamped
from tests.unit.fanout_play import Play


def task(**fields: object) -> Task:
    made = create_task(id="t", now_ms=0, ttl_ms=10_000, max_attempts=2)
    return replace(made, epoch="e1", **fields)  # type: ignore[arg-type]


# --- metadata -------------------------------------------------------------------------------------------


def test_merge_patch_is_rfc_7396() -> None:
    # The RFC's own examples (appendix A), a few of them.
    assert merge_patch({"a": "b"}, {"a": "c"}) == {"a": "c"}
    assert merge_patch({"a": "b"}, {"b": "c"}) == {"a": "b", "b": "c"}
    assert merge_patch({"a": "b"}, {"a": None}) == {}
    assert merge_patch({"a": "b", "b": "c"}, {"a": None}) == {"b": "c"}
    assert merge_patch({"a": ["b"]}, {"a": "c"}) == {"a": "c"}
    assert merge_patch({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}) == {"a": {"b": "d"}}
    assert merge_patch({"a": [{"b": "c"}]}, {"a": [1]}) == {"a": [1]}
    assert merge_patch({"e": None}, {"a": 1}) == {"e": None, "a": 1}
    assert merge_patch("a", {"b": None}) == {}
    assert merge_patch({}, {"a": {"bb": {"ccc": None}}}) == {"a": {"bb": {}}}


def test_metadata_is_at_most_8_kib_as_compact_json_and_a_number_it_cannot_hold_is_refused() -> None:
    fits = {"k": "x" * (MAX_METADATA_BYTES - len('{"k":""}'))}
    assert len(encoded(fits)) == MAX_METADATA_BYTES
    with pytest.raises(PayloadTooLarge) as refused:
        encoded({"k": "x" * MAX_METADATA_BYTES})
    assert (refused.value.status, refused.value.code) == (413, "metadata-too-large")
    assert encoded({"é": 1}) == '{"é":1}'  # UTF-8, not escaped: bytes are what counts
    with pytest.raises(InvalidRequest, match="metadata"):
        encoded({"n": 2**64})


def test_a_patch_counts_a_revision_only_when_it_changes_the_metadata_as_json() -> None:
    start = task(metadata='{"n":1}', revision=3)
    assert patched(start, {"n": 1}) is None
    assert patched(start, {"gone": None}) is None
    as_float = patched(start, {"n": 1.0})  # 1 and 1.0 are one number to Python, not to a JSON reader
    assert as_float is not None and (as_float.metadata, as_float.revision) == ('{"n":1.0}', 4)
    as_true = patched(start, {"n": True})
    assert as_true is not None and as_true.metadata == '{"n":true}'
    message = patched(start, {"message": "Rendering page 3 of 12"})
    assert message is not None and orjson.loads(message.metadata) == {
        "n": 1,
        "message": "Rendering page 3 of 12",
    }
    assert message.version == start.version  # beside the history


# --- children -------------------------------------------------------------------------------------------


def test_a_childs_creation_and_moves_keep_total_the_sum_of_the_states() -> None:
    counts = moved(None, None, "queued")
    assert counts == (1, 1, 0, 0, 0, 0)
    counts = moved(moved(counts, None, "queued"), "queued", "running")
    assert counts == (2, 1, 1, 0, 0, 0)
    counts = moved(moved(counts, "running", "queued"), "queued", "failed")  # requeued, then cancelled
    counts = moved(moved(counts, "queued", "expired"), None, "queued")
    assert counts == (3, 1, 0, 0, 1, 1)
    assert counts[0] == sum(counts[1:]) and ended(counts) == 2


def test_the_parents_progress_moves_up_with_its_ended_children_only_while_it_runs() -> None:
    running = apply_event(task(progress_from_children=True, children=(4, 1, 1, 1, 1, 0)), Start(5, "w")).task
    event = children_progress(running, 10)
    assert event == Progress(10, 50, "children:2/4")
    assert apply_event(running, event).reason == "progress"
    assert children_progress(replace(running, progress=50), 10) is None  # only upward
    assert children_progress(replace(running, progress_from_children=False), 10) is None
    assert children_progress(replace(running, children=None), 10) is None
    assert children_progress(task(progress_from_children=True, children=(4, 0, 0, 4, 0, 0)), 10) is None
    assert children_progress(running, 10_000) is None  # at its deadline: the sweeper's to expire
    third = replace(running, children=(3, 2, 0, 1, 0, 0))
    assert children_progress(third, 10) == Progress(10, 33, "children:1/3")  # floor


# --- what the gateway records of runs, and the task's JSON ---------------------------------------------


def test_a_start_records_its_worker_and_time_and_an_end_its_notification_time() -> None:
    queued = task()
    started = stamped(apply_event(queued, Start(7, "w1")), 7)
    assert (started.task.worker, started.task.started_at_ms, started.task.ended_at_ms) == ("w1", 7, None)
    moved_on = apply_event(started.task, Progress(8, 10, ""))
    assert stamped(moved_on, 8) is moved_on
    unchanged = apply_event(started.task, Start(9, "w2"))  # already-running: no entry
    assert stamped(unchanged, 9) is unchanged
    done = stamped(apply_event(started.task, Succeed(12, "r", "h")), 13)
    assert (done.task.worker, done.task.started_at_ms, done.task.ended_at_ms) == ("w1", 7, 13)
    late = stamped(apply_event(started.task, Fail(20_000, "x", False)), 20_000)  # past the deadline
    assert late.entry == Entry(2, Expire(10_000)) and late.task.ended_at_ms == 20_000


def test_the_tasks_json_carries_the_fields_beside_its_history_and_reads_back() -> None:
    full = task(
        title="Monthly export",
        parent="p",
        progress_from_children=True,
        metadata='{"message":"page 3"}',
        children=(3, 1, 1, 1, 0, 0),
        revision=5,
        worker="w1",
        started_at_ms=7,
        ended_at_ms=9,
    )
    data = task_to_json(full)
    assert {k: data[k] for k in ("title", "parent", "progressFromChildren", "metadata", "revision")} == {
        "title": "Monthly export",
        "parent": "p",
        "progressFromChildren": True,
        "metadata": {"message": "page 3"},
        "revision": 5,
    }
    assert data["children"] == {
        "total": 3,
        "queued": 1,
        "running": 1,
        "succeeded": 1,
        "failed": 0,
        "expired": 0,
    }
    assert (data["worker"], data["startedAtMs"], data["endedAtMs"]) == ("w1", 7, 9)
    assert task_from_json(orjson.loads(orjson.dumps(data))) == full
    plain = task_to_json(task())
    assert plain["metadata"] == {} and plain["revision"] == 0
    assert not {"title", "parent", "progressFromChildren", "children", "worker"} & set(plain)
    assert task_from_json(plain) == task()


# --- the state beside the history as frames and bus messages ----------------------------------------------


def test_the_frames_that_bring_a_client_to_a_state_are_those_whose_content_differs() -> None:
    state = Beside("t", 4, '{"m":1}', (2, 1, 1, 0, 0, 0), "e1")
    both = state.frames(None)
    assert [orjson.loads(f.text) for f in both] == [
        {"type": "metadata", "taskId": "t", "revision": 4, "metadata": {"m": 1}},
        {
            "type": "children",
            "taskId": "t",
            "revision": 4,
            "children": {"total": 2, "queued": 1, "running": 1, "succeeded": 0, "failed": 0, "expired": 0},
        },
    ]
    assert all(f.version == -1 for f in both)
    assert state.frames(replace(state, revision=3)) == []
    assert [f.type for f in state.frames(replace(state, metadata="{}"))] == ["metadata"]
    assert [f.type for f in state.frames(replace(state, children=None))] == ["children"]
    assert Beside("t", 1, "{}").frames(None)[0].type == "metadata"  # no child: no children frame
    assert Beside.of(task(revision=2, metadata='{"a":2}')) == Beside("t", 2, '{"a":2}', None, "e1")


def test_a_bus_message_of_the_state_reads_back_and_a_bare_one_says_read_the_store() -> None:
    for state in (Beside("t", 4, '{"m":[1,"x"]}', (2, 1, 1, 0, 0, 0), "e1"), Beside("t", 1, "{}")):
        assert Beside.decode(orjson.loads(state.message())) == state
    bare = Beside("t", 9, None, None, "e1")
    assert bare.bare and Beside.decode(orjson.loads(bare.message())) == bare
    head = {"type": "beside", "taskId": "t", "epoch": "", "revision": 1}
    for wrong in (
        {**head, "revision": True},
        {**head, "taskId": 3},
        {**head, "metadata": []},
        {**head, "metadata": {}, "children": [1, 2]},
        {**head, "metadata": {}, "children": [1, 1, 0, 0, 0, "0"]},
        {**head, "metadata": {}, "children": {"total": 1}},
    ):
        with pytest.raises(TypeError):
            Beside.decode(wrong)


# --- a subscription's side: the newest kept, nothing older than the client holds ------------------------


def state(
    revision: int, metadata: str = "{}", children: tuple[int, ...] | None = None, epoch: str = "e1"
) -> Beside:
    return Beside("t", revision, metadata, children, epoch)


def test_only_the_newest_state_waits_and_none_older_than_the_client_holds() -> None:
    out = BesideOut()
    last = task(revision=3, metadata='{"v":3}')
    assert not out.offer(state(3), last)  # the client's task has it already
    assert out.offer(state(5, '{"v":5}'), last)
    assert not out.offer(state(4, '{"v":4}'), last)  # older than what waits
    assert out.offer(state(6, '{"v":6}'), last)
    assert not out.offer(state(7, epoch="other"), last)  # another history of the id
    assert out.revision(last) == 3
    assert [orjson.loads(f.text)["revision"] for f in out.take(last)] == [6]
    assert out.revision(last) == 6 and out.pending is None
    assert out.take(last) == []
    assert not out.offer(state(6), last)
    # A newer task reached the client meanwhile (an entry's): it holds that.
    newer = replace(last, revision=8, metadata='{"v":8}')
    assert out.held(newer) == Beside.of(newer) and not out.offer(state(7), newer)


def test_a_state_heard_before_the_resume_frame_goes_after_it_only_if_newer() -> None:
    out = BesideOut()
    assert out.revision(None) == -1 and out.offer(state(2, '{"v":2}'), None)
    resumed = task(revision=4, metadata='{"v":4}')
    assert out.frames(resumed) == []  # the resume frame's task is newer
    out.sent_now()
    assert out.pending is None and out.offer(state(5, '{"v":5}'), resumed)
    assert [f.type for f in out.frames(resumed)] == ["metadata"]
    assert out.frames(replace(resumed, epoch="other")) == []  # the id made again: not its state
    out.sent_now()
    assert out.held(replace(resumed, epoch="other")).epoch == "other"  # type: ignore[union-attr]
    out.sent_now()


def test_a_slow_subscribers_writer_sends_the_newest_state_once_after_its_resume_frame() -> None:
    play = Play()
    play.book.create("t")
    play.commit("t")
    peer = play.connect()
    sub: Subscription[str] = play.fan.subscribe(peer, "t")
    sub.beside = BesideOut()
    for revision in (1, 2, 3):  # heard before the resume state was read: merged
        sub.beside.offer(state(revision, f'{{"v":{revision}}}', (1, 0, 1, 0, 0, 0), ""), sub.last)
    play.resumed(sub, 0)
    frames = play.frames(peer)
    assert [f.type for f in frames] == ["delta", "metadata", "children"]
    assert {orjson.loads(f.text)["revision"] for f in frames[1:]} == {3}
    sub.beside.offer(state(4, '{"v":3}', (1, 0, 0, 1, 0, 0), ""), sub.last)
    peer.wake(sub)
    assert [f.type for f in play.frames(peer)] == ["children"]  # the metadata did not change
    assert not sub.has_work()


def test_has_work_counts_a_state_waiting() -> None:
    peer: Peer[str] = Peer("c")
    sub: Subscription[str] = Subscription("t", peer)
    assert not sub.has_work()
    sub.beside = BesideOut()
    assert not sub.has_work()
    sub.beside.offer(state(1), None)
    assert sub.has_work()


def test_a_transition_carries_the_fields_beside_the_history_unchanged() -> None:
    beside = task(title="x", metadata='{"a":1}', revision=4, children=(1, 1, 0, 0, 0, 0), worker="w0")
    for event in (Start(1, "w"), Expire(10_000)):
        after: Transition = apply_event(beside, event)
        assert (after.task.title, after.task.metadata, after.task.revision, after.task.children) == (
            "x",
            '{"a":1}',
            4,
            (1, 1, 0, 0, 0, 0),
        )
        assert after.task.worker == "w0"  # the machine never sets it: the book stamps it
