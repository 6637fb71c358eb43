"""Expiry: a loop, owned by the app's lifespan, that expires live tasks whose deadline has passed.

It runs at start (so tasks that fell due while the gateway was down expire at once) and then every
``interval_s``; a task is expired within ``interval_s`` plus one pass of its deadline, with its entry and
notification at ``expiresAtMs``. A database outage only delays it: the next pass catches up.
"""

from __future__ import annotations

import logging

import anyio

from gateway.book import DB_DEADLINE_S, Book
from gateway.metrics import Metrics

log = logging.getLogger("gateway.sweeper")


async def sweep_once(book: Book, metrics: Metrics | None = None) -> int:
    """Expire every task that is due now; returns how many were expired."""
    total = 0
    while True:
        expired = await book.expire_due()
        total += expired
        if metrics is not None:
            metrics.tasks_expired.inc(expired)
        if expired == 0:
            return total


async def run_sweeper(book: Book, interval_s: float, metrics: Metrics | None = None) -> None:
    while True:
        try:
            # Shielded: a stop waits for the pass to end instead of tearing a connection down mid-query.
            with anyio.fail_after(DB_DEADLINE_S, shield=True):
                await sweep_once(book, metrics)
        except Exception:  # a database outage must not end expiry for the life of the process
            log.exception("expiry pass failed; retrying in %.1fs", interval_s)
        await anyio.sleep(interval_s)
