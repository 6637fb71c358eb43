"""A lock with two queues: an urgent holder goes before every ordinary one still waiting.

SQLite has one writer at a time, so this process's writes take turns on one lock. Expiry is urgent: under
a stream of callback batches and task creations its pass would otherwise wait behind every transaction
queued before it, and a task's expiry would be as late as the queue is long. Each queue is first come,
first served; the lock is handed straight to the next waiter, so a newcomer never overtakes it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class PriorityLock:
    def __init__(self) -> None:
        self._held = False
        self._urgent: deque[asyncio.Future[None]] = deque()
        self._ordinary: deque[asyncio.Future[None]] = deque()

    def locked(self) -> bool:
        return self._held

    @asynccontextmanager
    async def hold(self, *, urgent: bool = False) -> AsyncIterator[None]:
        await self._acquire(urgent)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, urgent: bool) -> None:
        if not self._held and not self._urgent and not self._ordinary:
            self._held = True
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._urgent if urgent else self._ordinary
        queue.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release()  # handed the lock as it was cancelled: hand it on
            elif waiter in queue:  # (a release may have dropped it already)
                queue.remove(waiter)
            raise

    def _release(self) -> None:
        for queue in (self._urgent, self._ordinary):
            while queue:
                waiter = queue.popleft()
                if not waiter.done():
                    waiter.set_result(None)  # the lock passes to it, held all along
                    return
        self._held = False
