"""``gateway_gc_pause_seconds``: the garbage collector's pauses of the process, by generation, observed while
the metrics watch them (``Metrics.watching_gc``, entered by a running gateway), and only then; and the
survivors of a full collection frozen (``gateway.server.serve.freeze_survivors``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from gateway.metrics import Metrics
from gateway.server.serve import freeze_survivors


def pauses(metrics: Metrics, generation: int) -> float:
    labels = {"generation": str(generation)}
    value = metrics.registry.get_sample_value("gateway_gc_pause_seconds_count", labels)
    return value or 0.0


def test_a_full_collection_is_observed_in_generation_2() -> None:
    metrics = Metrics()
    with metrics.watching_gc():
        gc.collect()
    assert pauses(metrics, 2) >= 1
    text = metrics.render().decode()
    assert 'gateway_gc_pause_seconds_bucket{generation="2",le="+Inf"}' in text


def test_a_young_collection_is_observed_in_its_own_generation() -> None:
    metrics = Metrics()
    with metrics.watching_gc():
        gc.collect(0)
    assert pauses(metrics, 0) >= 1


def test_nothing_is_observed_once_the_block_ended() -> None:
    metrics = Metrics()
    with metrics.watching_gc():
        pass
    callbacks = list(gc.callbacks)
    gc.collect()
    assert pauses(metrics, 2) == 0
    assert gc.callbacks == callbacks


@pytest.fixture
def survivors_frozen() -> Iterator[None]:
    hook = freeze_survivors()
    try:
        yield
    finally:
        gc.callbacks.remove(hook)
        gc.unfreeze()


@pytest.mark.usefixtures("survivors_frozen")
def test_what_survives_a_full_collection_is_frozen_and_still_freed_when_dropped() -> None:
    """A gateway process's full collections walk only what arrived since the last (gateway.server.serve):
    the survivors are frozen; reference counting still frees them once nothing refers to them."""
    kept: list[list[int]] = [[] for _ in range(1000)]
    before = gc.get_freeze_count()
    gc.collect(0)
    assert gc.get_freeze_count() == before  # a young collection freezes nothing
    gc.collect()
    frozen = gc.get_freeze_count()
    assert frozen >= before + 1000
    del kept
    assert gc.get_freeze_count() <= frozen - 1000
