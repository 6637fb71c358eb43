"""``gateway_gc_pause_seconds``: the garbage collector's pauses of the process, by generation, observed while
the metrics watch them (``Metrics.watching_gc``, entered by a running gateway), and only then."""

from __future__ import annotations

import gc

from gateway.metrics import Metrics


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
