"""Expiry: a loop, owned by the app's lifespan, that expires live tasks whose deadline has passed.

It runs at start (so tasks that fell due while the gateway was down expire at once) and then every
``interval_s``; a task is expired within ``interval_s`` plus one pass of its deadline, with its entry and
notification at ``expiresAtMs``. A pass works through the due tasks in bounded batches, one transaction
each, so a backlog makes progress batch by batch and an outage only delays it: the next pass goes on from
there. With several gateway processes each batch claims its rows with ``SKIP LOCKED``: every due task is
expired once, by whichever process gets there first.
"""

from __future__ import annotations

import logging

import anyio

from gateway.book import DB_DEADLINE_S, EXPIRY_BATCH, Book
from gateway.metrics import Metrics
from gateway.store.database import database_unavailable

log = logging.getLogger("gateway.sweeper")


async def sweep_once(book: Book, metrics: Metrics | None = None) -> int:
    """Expire every task that is due now, a batch at a time; returns how many this process expired."""
    total = 0
    while True:
        # Shielded: a stop waits for the batch to end instead of tearing a connection down mid-query.
        with anyio.fail_after(DB_DEADLINE_S, shield=True):
            expired = await book.expire_due(EXPIRY_BATCH)
        total += expired
        if metrics is not None:
            metrics.tasks_expired.inc(expired)
        if expired < EXPIRY_BATCH:
            return total


async def run_sweeper(book: Book, interval_s: float, metrics: Metrics | None = None) -> None:
    while True:
        try:
            await sweep_once(book, metrics)
        except Exception as exc:  # a database outage must not end expiry for the life of the process
            if database_unavailable(exc):  # one line per pass, not a traceback every 200 ms
                log.warning("expiry pass failed: the database is unreachable (%s); retrying", exc)
            else:
                log.exception("expiry pass failed; retrying in %.1fs", interval_s)
        await anyio.sleep(interval_s)
