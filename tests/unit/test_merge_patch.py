"""A task's metadata patches, pure (``gateway.client.merge_patch``): RFC 7396 as the gateway applies it,
what a client refuses before it sends, two waiting patches sent as one only when one patch says both (a
Hypothesis property over any document), and a run's queue of patches in the job's order."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.client.merge_patch import MAX_METADATA_BYTES, PatchQueue, check_patch, compose
from gateway.json_merge_patch import merge_patch as apply

KEYS = st.sampled_from(["a", "b", "c"])
VALUES = st.recursive(
    st.none() | st.integers(-3, 3) | st.text(max_size=2) | st.lists(st.integers(0, 2), max_size=2),
    lambda inner: st.dictionaries(KEYS, inner, max_size=3),
    max_leaves=8,
)
OBJECTS = st.dictionaries(KEYS, VALUES, max_size=3)


def test_a_patch_merges_removes_with_null_and_replaces_what_is_not_an_object() -> None:
    doc = {"a": {"b": 1, "c": 2}, "d": [1], "e": "x"}
    patch = {"a": {"b": None, "f": {"g": None, "h": 1}}, "d": {"x": 1}, "e": None, "z": [2]}
    assert apply(doc, patch) == {"a": {"c": 2, "f": {"h": 1}}, "d": {"x": 1}, "z": [2]}
    assert doc == {"a": {"b": 1, "c": 2}, "d": [1], "e": "x"}  # neither is changed
    assert apply(doc, [1]) == [1] and apply(5, {"a": None}) == {}


@settings(deadline=None)  # a loaded machine's first example can take longer than Hypothesis's 200 ms
@given(OBJECTS, OBJECTS, OBJECTS)
def test_two_patches_composed_do_what_both_do_to_any_document(
    doc: dict[str, Any], first: dict[str, Any], then: dict[str, Any]
) -> None:
    both = compose(first, then)
    if both is not None:
        assert apply(doc, both) == apply(apply(doc, first), then)


@settings(deadline=None)
@given(OBJECTS, OBJECTS)
def test_a_patch_is_idempotent_so_a_retry_after_a_lost_answer_changes_nothing(
    doc: dict[str, Any], patch: dict[str, Any]
) -> None:
    once = apply(doc, patch)
    assert apply(once, patch) == once


def test_what_no_single_patch_can_say_stays_two() -> None:
    assert compose({"a": None}, {"a": {"b": 1}}) is None  # a removed, then exactly {"b": 1}
    assert compose({"a": 5}, {"a": {"b": None}}) is None
    assert compose({"a": {"x": None}}, {"a": {"x": {"y": 1}}}) is None  # the same, a level down
    assert compose({"a": {"x": 1}}, {"a": {"y": 2}, "b": None}) == {"a": {"x": 1, "y": 2}, "b": None}
    assert compose({"current": 1, "total": 9}, {"current": 2}) == {"current": 2, "total": 9}


def test_a_patch_a_client_sends_is_a_json_object_of_at_most_8_kib() -> None:
    assert check_patch({"rows": 3, "name": "é"}) == {"rows": 3, "name": "é"}
    for bad, words in [
        ([1], "must be a JSON object"),
        ({"a": {1, 2}}, "must be JSON"),
        ({"a": float("nan")}, "must be JSON"),
        ({"a": "x" * MAX_METADATA_BYTES}, "at most 8192"),
    ]:
        with pytest.raises(ValueError, match=words):
            check_patch(bad)


def test_the_queue_sends_patches_in_order_one_at_a_time_and_composes_those_waiting() -> None:
    queue = PatchQueue()
    assert queue.due(progress_waits=False) is None
    queue.add({"current": 1}, after_progress=False)
    assert queue.due(progress_waits=False) == {"current": 1}  # on its way now
    queue.add({"current": 2}, after_progress=False)  # not into the one on its way
    queue.add({"current": 3, "total": 9}, after_progress=False)
    assert len(queue) == 2
    assert queue.due(progress_waits=False) == {"current": 1}  # the same again until answered
    queue.answered()
    assert queue.due(progress_waits=False) == {"current": 3, "total": 9}
    queue.again()  # a new attempt sends it from the start
    queue.add({"total": None}, after_progress=False)  # composes: the first is no longer on its way
    assert queue.pending() == [{"current": 3, "total": None}]
    queue.answered()  # nothing on its way: nothing to forget
    assert queue.due(progress_waits=False) == {"current": 3, "total": None}
    queue.answered()
    assert len(queue) == 0


def test_a_patch_made_after_a_waiting_progress_goes_after_it() -> None:
    queue = PatchQueue()
    queue.add({"a": 1}, after_progress=False)
    queue.add({"b": 2}, after_progress=True)  # the job reported progress between the two: kept apart
    assert len(queue) == 2
    assert queue.due(progress_waits=True) == {"a": 1}
    queue.answered()
    assert queue.due(progress_waits=True) is None  # waits for the progress before it
    queue.progress_sent()
    assert queue.due(progress_waits=True) == {"b": 2}
    queue.add({"a": None}, after_progress=False)
    queue.add({"a": {"x": 1}}, after_progress=False)  # not one patch with the one before: kept apart
    assert PatchQueue.resume(queue.pending()).pending() == [{"b": 2}, {"a": None}, {"a": {"x": 1}}]
    queue.add({"blob": "x" * 5_000}, after_progress=False)
    queue.add({"more": "y" * 5_000}, after_progress=False)  # one would pass 8 KiB: kept apart
    assert [sorted(patch) for patch in queue.pending()[2:]] == [["a", "blob"], ["more"]]
    assert PatchQueue.resume(None).pending() == []
