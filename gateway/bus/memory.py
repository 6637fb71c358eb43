"""The in-memory twin of a bus that links processes: gateways in one Python process that name the same
broker (``GATEWAY_BUS_URL=memory://NAME``) hear each other's entries, delivered on a later turn of the
event loop as a real bus would. For tests of what several processes do, without the processes.

Like Redis, a broker carries several channels: each deployment's (``deployment_channel``, named by
``join``), or the one configured (``GATEWAY_BUS_CHANNEL``). Gateways on different databases do not hear
each other.

``disconnect()`` and ``reconnect()`` stand in for a listener losing its connection: messages sent meanwhile
are lost to it, and reconnecting asks its hub to resync from the store, as the real buses do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import anyio
from anyio.abc import TaskStatus

from gateway.bus.base import News, OnNews, OnResync, deployment_channel
from gateway.store.base import WriteTx

# Listeners by broker name and channel.
_BROKERS: dict[tuple[str, str], set[MemoryBus]] = {}


class MemoryBus:
    shared = True

    def __init__(self, name: str, channel: str | None = None) -> None:
        self.name = name
        self.channel = channel
        self.connected = False
        self.reconnects = 0
        self._on_news: OnNews | None = None
        self._on_resync: OnResync | None = None

    def join(self, deployment_id: str) -> None:
        if self.channel is None:
            self.channel = deployment_channel(deployment_id)

    async def run(self, on_news: OnNews, on_resync: OnResync, *, task_status: TaskStatus[None]) -> None:
        if self.channel is None:
            raise RuntimeError("MemoryBus.run() before join(): no channel")
        key = (self.name, self.channel)
        self._on_news, self._on_resync = on_news, on_resync
        listeners = _BROKERS.setdefault(key, set())
        listeners.add(self)
        self.reconnect()
        task_status.started()
        try:
            await anyio.sleep_forever()
        finally:
            listeners.discard(self)
            if not listeners:
                _BROKERS.pop(key, None)
            self._on_news = self._on_resync = None
            self.connected = False

    async def announce(self, tx: WriteTx, news: Sequence[News]) -> None:
        pass

    def publish(self, news: News) -> None:
        if self._on_news is None:
            return
        self._on_news(news)
        loop = asyncio.get_running_loop()
        for other in _BROKERS.get((self.name, self.channel or ""), ()):
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
