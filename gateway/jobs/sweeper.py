"""Expiry and heartbeat leases: a loop, owned by the app's lifespan, that expires live tasks whose deadline
has passed and ends the leases of running attempts that stopped renewing them (``gateway.lease``).

Leases are swept as deadlines are, below: the sweeper wakes for the earliest lease end as for the earliest
deadline (a lease that starts or is renewed tells it, as a new task's deadline does), and ends them in
bounded batches claimed with ``SKIP LOCKED``, one transaction each, the first urgent. A pass ends leases
before it expires tasks, and the expiry claim never takes a running task whose lease ended before its
deadline (``queries.DUE``): however late a pass comes, or whichever process's comes first, the history
has the lease's end (a heartbeat-timeout fail) before the deadline's.

It runs at start (so tasks that fell due while the gateway was down expire at once), then wakes at the
next deadline it knows of: after each pass it reads the earliest deadline of the live tasks, and a task this
process creates with an earlier one wakes it sooner. It never sleeps longer than ``interval_s`` (the tasks
other processes create are found at the latest then); where this process makes every task (a SQLite file,
which no other process writes), it knows every deadline, and looks only once a second besides
(``SOLO_IDLE_S``: a wall clock set forward is noticed then), instead of reading the store five times a
second for nothing. It starts at most one pass per ``min_gap_s`` (tasks
that fall due close together expire in one batch). Passes may overlap, up to ``max_passes``: a pass starts
on time even while a slow one is still committing. A task is expired within one pass of its deadline, with
its entry and notification at ``expiresAtMs``.

A pass reads the earliest deadline first and writes only when a task is due. It works through the due
tasks in bounded, set-based batches, one transaction each, so a backlog makes
progress batch by batch and an outage only delays it: the next pass goes on from there. A pass's first
batch is an urgent write: on SQLite it goes before the callback batches and creations waiting for their
turn to write, so a stream of callbacks never starves expiry. With several gateway processes (or
overlapping passes) each batch claims its rows with ``SKIP LOCKED``: every due task is expired once, by
whichever pass gets there first.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence

import anyio
from prometheus_client import Counter

from gateway.book.book import EXPIRY_BATCH, Book
from gateway.errors import one_line
from gateway.metrics import Metrics
from gateway.store.database import database_unavailable, unavailable_reason

log = logging.getLogger("gateway.sweeper")

# The shortest time between the starts of two passes: deadlines this close together share a batch.
MIN_GAP_S = 0.05
# The longest a sweeper that knows every deadline (``solo``) sleeps when none is due sooner.
SOLO_IDLE_S = 1.0
# Passes under way at once at most (a pass starts at its time even while a slow one is committing).
MAX_PASSES = 3


async def _in_batches(
    book: Book, batch: Callable[[int, bool], Awaitable[int]], counter: Counter | None
) -> int:
    """``batch(limit, urgent)`` until one comes back short; returns how many it took in all.

    The first batch is urgent (it writes before the callbacks waiting to); the rest of a backlog (after an
    outage, say) takes its turns with them, so that catching up does not stall callbacks for long."""
    total = 0
    while True:
        # Shielded: a stop waits for the batch to end instead of tearing a connection down mid-query.
        with anyio.fail_after(book.deadline_s, shield=True):
            done = await batch(EXPIRY_BATCH, total == 0)
        total += done
        if counter is not None:
            counter.inc(done)
        if done < EXPIRY_BATCH:
            return total


async def sweep_once(book: Book, metrics: Metrics | None = None) -> int:
    """Expire every task that is due now, a batch at a time; returns how many this process expired."""
    return await _in_batches(
        book,
        lambda limit, urgent: book.expire_due(limit, urgent=urgent),
        metrics.tasks_expired if metrics is not None else None,
    )


async def end_leases_once(book: Book, metrics: Metrics | None = None) -> int:
    """End every lease that ran out by now, a batch at a time, as :func:`sweep_once` expires tasks; returns
    how many this process ended."""
    return await _in_batches(
        book,
        lambda limit, urgent: book.end_leases(limit, urgent=urgent),
        metrics.leases_ended if metrics is not None else None,
    )


class Sweeper:
    def __init__(
        self,
        book: Book,
        interval_s: float,
        metrics: Metrics | None = None,
        *,
        min_gap_s: float = MIN_GAP_S,
        max_passes: int = MAX_PASSES,
        solo: bool = False,
    ) -> None:
        self.book = book
        # The longest sleep between passes; ``solo`` (every task is made by this process, which hears of
        # each deadline through ``deadline``): at least ``SOLO_IDLE_S``.
        self.interval_s = max(interval_s, SOLO_IDLE_S) if solo else interval_s
        self.metrics = metrics
        self.min_gap_s = min(min_gap_s, interval_s)
        self.max_passes = max_passes
        self._wake_at = math.inf  # when the next pass starts, on the monotonic clock
        self._sooner = anyio.Event()

    def deadline(self, expires_at_ms: int) -> None:
        """A task of this process now has this deadline: be there for it (a listener of the book)."""
        at = time.monotonic() + max(0.0, (expires_at_ms - self.book.clock()) / 1000)
        if at < self._wake_at:
            self._wake_at = at
            self._sooner.set()

    async def run(self) -> None:
        """Passes for the life of the caller (owned by the app's lifespan)."""
        in_flight = anyio.Semaphore(self.max_passes)
        async with anyio.create_task_group() as passes:
            while True:
                started = time.monotonic()
                self._wake_at = started + self.interval_s
                await in_flight.acquire()
                passes.start_soon(self._pass, in_flight)
                await self._sleep(started + self.min_gap_s)

    def expired(self, deadlines_ms: Sequence[int]) -> None:
        """An expiry batch committed (a listener of the book that expired it): how late it was."""
        if self.metrics is not None:
            self.metrics.expired(deadlines_ms, self.book.clock())

    def leases_ended(self, ends_ms: Sequence[int]) -> None:
        """A batch of leases ended (a listener of the book that ended it): how late it was."""
        if self.metrics is not None:
            self.metrics.leases_over(ends_ms, self.book.clock())

    async def _pass(self, in_flight: anyio.Semaphore) -> None:
        """End the leases that ran out, expire what is due, then learn the next deadline. Passes overlap: a
        slow commit holds up only the tasks of its own batch, not those falling due while it runs."""
        try:
            # A read first: a pass with nothing due writes nothing (on SQLite it would take the write turn,
            # and a callback arriving meanwhile would wait for it, five times a second), and a pass writes
            # only for the kind that is due (deadlines, lease ends).
            deadline, lease_end = await self.book.next_due()
            now = self.book.clock()
            # Leases first: a lease that ran out before its task's deadline is ended at its end (the expiry
            # claim leaves such a task alone), and the task it requeued past its deadline expires next.
            if lease_end is not None and lease_end <= now:
                await end_leases_once(self.book, self.metrics)
            if deadline is not None and deadline <= now:
                await sweep_once(self.book, self.metrics)
            if now >= min(deadline or math.inf, lease_end or math.inf):
                deadline, lease_end = await self.book.next_due()
            next_ms = min((t for t in (deadline, lease_end) if t is not None), default=None)
        except Exception as exc:  # a database outage must not end expiry for the life of the process
            if database_unavailable(exc):  # one line per pass, not a traceback every 200 ms
                log.warning("expiry pass failed: %s (%s); retrying", unavailable_reason(exc), one_line(exc))
            else:
                log.exception("expiry pass failed; retrying in %.1fs", self.interval_s)
            return
        finally:
            in_flight.release()
        if next_ms is not None:
            self.deadline(next_ms + 1)  # +1: the clock's milliseconds are floored

    async def _sleep(self, not_before: float) -> None:
        """Until ``_wake_at`` (which ``deadline`` may bring forward), but not before ``not_before``."""
        while True:
            self._sooner = anyio.Event()
            remaining = max(self._wake_at, not_before) - time.monotonic()
            if remaining <= 0:
                return
            with anyio.move_on_after(remaining):
                await self._sooner.wait()
