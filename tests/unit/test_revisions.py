"""Which ``metadata`` and ``children`` frames a client hands on (``gateway.client.revisions``): none older
than what it holds of the task, from a frame or from a task a resume or event frame carried."""

from __future__ import annotations

from gateway.client.revisions import Revisions


def frame(kind: str, revision: object, task_id: str = "t1") -> dict[str, object]:
    return {"type": kind, "taskId": task_id, "revision": revision}


def test_a_frame_older_than_what_is_held_is_dropped_and_each_kind_counts_apart() -> None:
    held = Revisions()
    assert held.take(frame("metadata", 3))
    assert held.take(frame("metadata", 3))  # the same revision again: taken (>=)
    assert not held.take(frame("metadata", 2))
    assert held.take(frame("children", 1))  # the children's own
    assert held.take(frame("metadata", 1, task_id="t2"))  # another task's


def test_a_task_a_resume_frame_carries_holds_both_and_a_task_made_again_starts_over() -> None:
    held = Revisions()
    held.take(frame("metadata", 9))
    held.task("t1", {"revision": 5})  # older than the frame taken: the frame's stays
    assert not held.take(frame("metadata", 8))
    assert not held.take(frame("children", 4))
    assert held.take(frame("children", 5))
    held.task("t1", {"state": "running"})  # a task without a revision holds nothing new
    held.forget("t1")
    assert held.take(frame("metadata", 1))


def test_what_has_no_revision_or_is_not_such_a_frame_is_handed_on_as_it_is() -> None:
    held = Revisions()
    assert held.take(frame("metadata", None))
    assert held.take({"type": "metadata", "revision": 1})
    assert held.take(frame("event", 1))
