"""Group commit: worker callbacks that arrive together are applied in one transaction and one commit.

Each callback route hands its request to :meth:`Committer.submit` and waits. One task (owned by the app's
lifespan) takes whatever has queued, up to ``max_batch``, and applies it with :meth:`Book.callbacks`: one
lock query, one dedup query, set-based writes, one commit (one fsync on SQLite, one flush of the WAL on
PostgreSQL), then answers each request with its own outcome. Nothing waits for a batch to fill: a lone
callback is applied at once, and callbacks that arrive while a commit is in flight form the next batch,
so batches grow exactly when the database is the bottleneck. Every answer still follows its commit.

On SQLite one batch commits at a time (writes take turns there anyway); on PostgreSQL a few commit side by
side, each on a connection of its own, so that one batch's round trips and WAL flush do not idle the
process while the next batch waits.

Each callback is answered within the database deadline (``Book.deadline_s``) of its arrival, whatever
it waited for: one still queued at its deadline (every batch slot stuck on a database that does not
answer) is answered 503 and never applied, and a batch runs under the deadline of its earliest callback.
Deadlines do not stack: waiting for a slot, the statements, the commit and the rollback share one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterator

import anyio

from gateway.book.book import Book, CallbackOutcome, CallbackRequest
from gateway.errors import GatewayError, Unavailable

# Callbacks one batch applies at most (one transaction's worth of locks and statements).
MAX_BATCH = 128
# Callbacks waiting for a batch at most; past that the gateway answers 503 with Retry-After.
MAX_QUEUED = 10_000


class Committer:
    def __init__(
        self, book: Book, *, max_batch: int = MAX_BATCH, max_queued: int = MAX_QUEUED, concurrency: int = 1
    ) -> None:
        self.book = book
        # Batches committing at once: 1 where writes take turns anyway (SQLite); on PostgreSQL several,
        # each on a connection of its own (their rows are locked in id order, so they cannot deadlock; a
        # callback id two of them insert is a race that the second one runs again, and then sees).
        self.concurrency = concurrency
        self.max_batch = max_batch
        self.max_queued = max_queued
        self.batches = 0
        self.applied = 0
        self._queue: deque[_Waiting] = deque()
        self._wakeup = asyncio.Event()
        self._running = False
        self.in_flight = 0

    def busy(self) -> bool:
        """Whether callbacks are being answered: read, waiting for their batch or its commit, or answering
        (fan-out yields to them)."""
        return self.in_flight > 0

    @contextlib.contextmanager
    def answering(self) -> Iterator[None]:
        """Around a callback route, from its first line to its answer: the callback counts as waiting from
        the moment it is read, not only once it is queued for a batch."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    async def submit(self, request: CallbackRequest) -> CallbackOutcome:
        """Apply one callback with whatever else is queued; its outcome, or the error that refused it."""
        if not self._running:  # not started (an app without its lifespan): a batch of one
            (outcome,) = await self.book.callbacks([request])
            if isinstance(outcome, GatewayError):
                raise outcome
            return outcome
        if len(self._queue) >= self.max_queued:
            raise Unavailable("too many callbacks waiting for the database; retry shortly")
        within_s = self.book.deadline_s
        waiting = _Waiting(request, anyio.current_time() + within_s)
        self._queue.append(waiting)
        self._wakeup.set()
        # Shielded: a client that hangs up does not take its callback out of a batch being committed.
        with anyio.move_on_after(within_s):
            return await asyncio.shield(waiting.future)
        if not waiting.taken:  # still queued: it never will be applied
            waiting.future.cancel()
            raise Unavailable(
                f"the database did not answer within {within_s:g} s; retry (this callback was not applied)"
            )
        return await asyncio.shield(waiting.future)  # its batch ends by this callback's deadline

    async def run(self) -> None:
        self._running = True
        slots = asyncio.Semaphore(self.concurrency)
        batches: set[asyncio.Task[None]] = set()
        try:
            while True:
                if not self._queue:
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                await slots.acquire()  # callbacks that queue meanwhile join this batch
                batch: list[_Waiting] = []
                while self._queue and len(batch) < self.max_batch:
                    waiting = self._queue.popleft()
                    if not waiting.future.done():  # else answered already, at its deadline
                        waiting.taken = True
                        batch.append(waiting)
                if not batch:
                    slots.release()
                    continue
                applying = asyncio.get_running_loop().create_task(self._apply(batch))
                batches.add(applying)
                applying.add_done_callback(batches.discard)
                applying.add_done_callback(lambda _: slots.release())
        finally:
            self._running = False
            if batches:  # the commits under way end first (their work is shielded), each answering its own
                with anyio.CancelScope(shield=True):
                    await asyncio.wait(tuple(batches))
            while self._queue:
                future = self._queue.popleft().future
                if not future.done():
                    future.set_exception(Unavailable("the gateway is stopping; retry"))

    async def _apply(self, batch: list[_Waiting]) -> None:
        try:
            # By the earliest deadline of its callbacks (the book's operation takes the sooner one).
            with anyio.fail_after(min(w.deadline for w in batch) - anyio.current_time()):
                outcomes = await self.book.callbacks([w.request for w in batch])
        except asyncio.CancelledError:  # stopped during a commit: its outcome is not known here
            for waiting in batch:
                future = waiting.future
                if not future.done():
                    future.set_exception(
                        Unavailable("the gateway is stopping; retry (a retry is applied once)")
                    )
            raise
        except Exception as exc:  # the transaction failed (a database outage): each is told
            for waiting in batch:
                future = waiting.future
                if not future.done():
                    future.set_exception(exc)
            return
        self.batches += 1
        self.applied += len(batch)
        for waiting, outcome in zip(batch, outcomes, strict=True):
            future = waiting.future
            if future.done():
                continue
            if isinstance(outcome, GatewayError):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)


class _Waiting:
    """A callback waiting for its batch: answered through ``future`` by ``deadline`` (anyio's clock)."""

    __slots__ = ("deadline", "future", "request", "taken")

    def __init__(self, request: CallbackRequest, deadline: float) -> None:
        self.request = request
        self.deadline = deadline
        self.future: asyncio.Future[CallbackOutcome] = asyncio.get_running_loop().create_future()
        self.taken = False  # in a batch: answered by that batch
