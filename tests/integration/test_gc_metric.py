"""A running gateway observes its process's garbage collections on ``/metrics``
(``gateway_gc_pause_seconds``, by generation), and stops when it stops."""

from __future__ import annotations

import gc

import pytest

from tests.support import Running, running_gateway


async def full_collections(gw: Running) -> float:
    text = (await gw.client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith('gateway_gc_pause_seconds_count{generation="2"} '):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no gateway_gc_pause_seconds_count for generation 2 in /metrics")


@pytest.mark.anyio
async def test_a_full_collection_shows_on_metrics(sqlite_url: str) -> None:
    callbacks = len(gc.callbacks)
    async with running_gateway(sqlite_url) as gw:
        before = await full_collections(gw)
        gc.collect()
        assert await full_collections(gw) >= before + 1
    assert len(gc.callbacks) == callbacks  # the hook went with the gateway
