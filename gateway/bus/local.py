"""The in-process bus: one gateway process (the SQLite default). A publish reaches the hub at once."""

from __future__ import annotations

from collections.abc import Sequence

import anyio
from anyio.abc import TaskStatus

from gateway.bus.base import News, OnNews, OnResync
from gateway.store.base import WriteTx


class LocalBus:
    shared = False

    def __init__(self) -> None:
        self._on_news: OnNews | None = None
        self.connected = False
        self.reconnects = 0

    def join(self, deployment_id: str) -> None:
        pass  # it links nothing: no channel

    async def run(self, on_news: OnNews, on_resync: OnResync, *, task_status: TaskStatus[None]) -> None:
        self._on_news = on_news
        self.connected, self.reconnects = True, 1
        task_status.started()
        try:
            await anyio.sleep_forever()
        finally:
            self._on_news = None
            self.connected = False

    async def announce(self, tx: WriteTx, news: Sequence[News]) -> None:
        pass

    def publish(self, news: News) -> None:
        if self._on_news is not None:
            self._on_news(news)
