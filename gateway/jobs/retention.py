"""Retention: a loop, owned by the app's lifespan, that deletes the tasks finished longer ago than
``GATEWAY_RETAIN_FINISHED_S`` with everything they own (history, streams, callback ids, receipts,
notification), so that the database holds the live tasks and the recent past, not every task ever run.

A task's age is counted from ``finished_at_ms``, written with the transition that ended it (its terminal
entry's time, the notification's ``atMs``, by the gateway's clock). It is deleted only once its
notification was taken: drained (``POST /v1/notifications/drain``), or, when a webhook relay is
configured, drained or relayed. A task whose notification nobody took is kept, however old, and counted
(``gateway_finished_tasks_held``, and a warning when there come to be some), so that an operator sees a
backend that stopped draining before its notifications are lost.

A pass walks the finished tasks past the cutoff once, oldest first, in bounded batches of ``batch`` tasks,
each one transaction: claim (``FOR UPDATE SKIP LOCKED`` on PostgreSQL, so that processes retaining together
take different tasks), then delete. Each batch goes on from where the last one ended (a keyset), so the
tasks a pass keeps are read once per pass, not once per batch. Batches are ordinary writes: on SQLite
each waits for its turn behind the callbacks already queued, and expiry goes before it. A pass runs at
start, then every ``interval_s``.

Once a task is deleted its id is unknown everywhere (``404 unknown-task``, close ``4404``), a late callback
included, and free for a new task.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import anyio

from gateway.metrics import Metrics
from gateway.store.base import Store, WriteTx
from gateway.store.database import database_unavailable
from gateway.store.db_deadline import DB_DEADLINE_S

log = logging.getLogger("gateway.retention")

Clock = Callable[[], int]

# Tasks deleted per transaction (each with its entries, streams, callback ids, receipts and notification).
RETENTION_BATCH = 200
# The longest and the shortest time between passes; between them, a tenth of the retention.
MAX_INTERVAL_S = 60.0
MIN_INTERVAL_S = 1.0


def interval_for(retain_s: int) -> float:
    """How often retention looks, for a retention of ``retain_s``: a tenth of it, within 1 s to 60 s (a
    task is deleted at most that long after its time has come)."""
    return min(MAX_INTERVAL_S, max(MIN_INTERVAL_S, retain_s / 10))


class Retention:
    def __init__(
        self,
        store: Store,
        clock: Clock,
        retain_s: int,
        *,
        relay: bool,
        metrics: Metrics | None = None,
        batch: int = RETENTION_BATCH,
        interval_s: float | None = None,
        db_deadline_s: float = DB_DEADLINE_S,
    ) -> None:
        self.store = store
        self.clock = clock
        self.retain_ms = retain_s * 1000
        # Whether a relayed notification counts as taken (a relay is configured).
        self.relay = relay
        self.metrics = metrics
        self.batch = batch
        self.interval_s = interval_for(retain_s) if interval_s is None else interval_s
        # The longest one of its database rounds may take (GATEWAY_DB_DEADLINE_MS).
        self.db_deadline_s = db_deadline_s
        self.held = 0

    async def run(self) -> None:
        """Passes for the life of the caller (owned by the app's lifespan)."""
        while True:
            try:
                await self.sweep()
            except Exception as exc:  # a database outage must not end retention for the life of the process
                if database_unavailable(exc):
                    log.warning("retention pass failed: the database is unreachable (%s); retrying", exc)
                else:
                    log.exception("retention pass failed; retrying in %.0f s", self.interval_s)
            await anyio.sleep(self.interval_s)

    async def sweep(self) -> int:
        """One pass: delete every task finished at or before now minus the retention whose notification
        was taken, a batch per transaction; then count the ones kept. Returns how many were deleted."""
        cutoff = self.clock() - self.retain_ms
        after: tuple[int, str] | None = None
        total = 0
        while True:
            # Shielded: a stop waits for the batch to end instead of tearing a connection down mid-query.
            with anyio.fail_after(self.db_deadline_s, shield=True):
                claimed, gone, after = await self.store.transact(
                    functools.partial(self._delete_batch, cutoff_ms=cutoff, after=after)
                )
            total += gone
            if self.metrics is not None:
                self.metrics.tasks_deleted.inc(gone)
            if claimed < self.batch:
                break
        with anyio.fail_after(self.db_deadline_s, shield=True):
            async with self.store.read() as tx:
                held = await tx.finished_held(cutoff, relay=self.relay)
        if held and not self.held:
            taken = "drained or relayed" if self.relay else "drained (POST /v1/notifications/drain)"
            log.warning(
                "retention keeps %d finished task(s) past GATEWAY_RETAIN_FINISHED_S because their "
                "notification was never %s; see gateway_finished_tasks_held",
                held,
                taken,
            )
        self.held = held
        if self.metrics is not None:
            self.metrics.retention_held.set(held)
        return total

    async def _delete_batch(
        self, tx: WriteTx, *, cutoff_ms: int, after: tuple[int, str] | None
    ) -> tuple[int, int, tuple[int, str] | None]:
        """One batch: claim up to ``batch`` tasks after ``after``, delete them; how many were claimed and
        deleted, and where the next batch goes on from."""
        claimed = await tx.claim_finished(cutoff_ms, after, self.batch, relay=self.relay)
        if not claimed:
            return 0, 0, after
        gone = await tx.forget([task_id for _, task_id in claimed])
        return len(claimed), gone, claimed[-1]
