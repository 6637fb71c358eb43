"""The in-memory twin of a bus that links processes: gateways in one Python process that name the same
broker (``GATEWAY_BUS_URL=memory://NAME``) hear each other's entries, delivered on a later turn of the
event loop as a real bus would. For tests of what several processes do, without the processes.

``disconnect()`` and ``reconnect()`` stand in for a listener losing its connection: messages sent meanwhile
are lost to it, and reconnecting asks its hub to resync from the store, as the real buses do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import anyio
from anyio.abc import TaskStatus

from gateway.bus.base import News, OnNews, OnResync
from gateway.store.base import WriteTx

_BROKERS: dict[str, set[MemoryBus]] = {}


class MemoryBus:
    shared = True

    def __init__(self, name: str) -> None:
        self.name = name
        self.connected = False
        self.reconnects = 0
        self._on_news: OnNews | None = None
        self._on_resync: OnResync | None = None

    async def run(self, on_news: OnNews, on_resync: OnResync, *, task_status: TaskStatus[None]) -> None:
        self._on_news, self._on_resync = on_news, on_resync
        listeners = _BROKERS.setdefault(self.name, set())
        listeners.add(self)
        self.reconnect()
        task_status.started()
        try:
            await anyio.sleep_forever()
        finally:
            listeners.discard(self)
            if not listeners:
                _BROKERS.pop(self.name, None)
            self._on_news = self._on_resync = None
            self.connected = False

    async def announce(self, tx: WriteTx, news: Sequence[News]) -> None:
        pass

    def publish(self, news: News) -> None:
        if self._on_news is None:
            return
        self._on_news(news)
        loop = asyncio.get_running_loop()
        for other in _BROKERS.get(self.name, ()):
            if other is not self:
                loop.call_soon(other._heard, news)

    def disconnect(self) -> None:
        self.connected = False

    def reconnect(self) -> None:
        self.connected = True
        self.reconnects += 1
        if self._on_resync is not None:
            self._on_resync()

    def _heard(self, news: News) -> None:
        if self.connected and self._on_news is not None:
            self._on_news(news)
