"""The drain of terminal notifications (``POST /v1/notifications/drain``): what one drain takes from the
outbox, and what a drain made with an ``Idempotency-Key`` keeps.

A drain marks what it takes as drained in the transaction that takes it. When its answer is lost on the
way (a proxy's timeout, a backend restarted mid-read), a drain without a key has lost those notifications
for good: it is at most once. With a key, the answer is kept under the key (the bytes that were sent, not
the outbox rows, which retention may delete meanwhile) for ``KEEP_MS``: the same key answers it again,
byte for byte, whatever was drained since, and a backend that retries with its key until it gets an
answer receives every notification (at least once, and once per key it moves on from).

Two drains with the same new key at once (PostgreSQL; elsewhere writes take turns, and the second finds
the first's batch): both take notifications, one commits its key first and the other's insert of the key
fails (``StoreRace``) with everything it took given back; run again, it answers the winner's batch. Two
drains with different keys take different notifications (the outbox rows are claimed ``SKIP LOCKED``).
``more`` (the answer's ``Drain-More``) is false for a batch shorter than its limit: the rows it skipped
were another transaction's at that moment (protocol.md, More to drain).

Batches past their keeping time are deleted by the drains themselves, a bounded number per drain, oldest
first: each drain adds at most one batch and deletes up to ``FORGET_PER_DRAIN`` old ones, so the table
holds about a day of batches however long the gateway runs, and nothing else has to run for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.store.base import DrainBatch, Notification, WriteTx

# How long a keyed drain's answer is kept: from then on its key is free again (a later drain deletes it).
KEEP_MS = 24 * 60 * 60 * 1000
# Notifications a drain takes at most: ``?limit=`` by default, and the most it may ask for.
DEFAULT_LIMIT = 1_000
MAX_LIMIT = 10_000
# Batches past ``KEEP_MS`` that one drain deletes at most.
FORGET_PER_DRAIN = 100

Encode = Callable[[Sequence[Notification]], bytes]


@dataclass(frozen=True, slots=True)
class Drained:
    """A drain's answer."""

    # The answer's body, as sent the first time.
    body: bytes
    # Notifications were still to drain after this batch was taken.
    more: bool
    # What this drain took from the outbox now: nothing when it answers a kept batch again.
    taken: tuple[Notification, ...]
    # It answers a kept batch again.
    replayed: bool


def in_answer_order(rows: Sequence[tuple[int, Notification]]) -> list[Notification]:
    """A batch as a drain lists it: by task id (UTF-16 code units, as JavaScript compares strings:
    protocol.md, Notifications), then time, then the order they were queued."""
    ordered = sorted(rows, key=lambda r: (r[1].task_id.encode("utf-16-be"), r[1].at_ms, r[0]))
    return [n for _, n in ordered]


async def drain(tx: WriteTx, now_ms: int, *, limit: int, key: str | None, encode: Encode) -> Drained:
    """One drain, in the caller's write transaction: the kept answer of ``key`` when it has one younger
    than ``KEEP_MS``, else up to ``limit`` of the oldest pending notifications, marked drained (and kept
    under ``key`` when there is one)."""
    if key is not None:
        kept = await tx.drain_batch(key)
        if kept is not None:
            if kept.made_at_ms > now_ms - KEEP_MS:
                return Drained(kept.body, kept.more, (), replayed=True)
            await tx.forget_drain_batch(key)  # too old: the key is free again
    await tx.forget_drain_batches(now_ms - KEEP_MS + 1, FORGET_PER_DRAIN)
    taken = in_answer_order(await tx.drain(now_ms, limit))
    # A short batch took every notification it could: nothing was left for it (on PostgreSQL the claim skips
    # rows another transaction holds: another drain's batch, or the relay recording a send for a moment).
    # A full one asks whether any is left, held ones included.
    more = len(taken) == limit and await tx.drain_pending()
    body = encode(taken)
    if key is not None:
        await tx.insert_drain_batch(DrainBatch(key, now_ms, more, body))
    return Drained(body, more, tuple(taken), replayed=False)
