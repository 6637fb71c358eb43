"""A TCP relay to PostgreSQL on a port of its own, to take the network path away from a gateway: refused,
swallowed (a partition) or frozen (a partition that heals). For tests/integration/test_unavailable.py, and
for bench/checks/db_deadline.py, which times a gateway's answers through a frozen one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from sqlalchemy.engine import make_url


class Relay:
    """A TCP relay to PostgreSQL on a port of its own. ``up()`` relays; ``refuse()`` drops every connection
    and stops listening (connection refused); ``blackhole()`` keeps connections open and accepts new ones,
    but passes nothing either way (a network partition). ``freeze()`` is a partition that heals: nothing
    passes either way and nothing is closed or refused, what is sent meanwhile is held (as TCP
    retransmits it), and ``thaw()`` lets it all through."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.mode = "up"
        self._thawed = asyncio.Event()
        self._thawed.set()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def up(self) -> None:
        self.mode = "up"
        if self._server is None:
            await self.start()

    async def refuse(self) -> None:
        self.mode = "refuse"
        await self._stop_listening()
        self._drop_all()

    def blackhole(self) -> None:
        self.mode = "blackhole"

    def freeze(self) -> None:
        self._thawed.clear()

    def thaw(self) -> None:
        self._thawed.set()

    async def close(self) -> None:
        await self._stop_listening()
        self._drop_all()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _stop_listening(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def _drop_all(self) -> None:
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.add(up_writer)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.ensure_future(self._pipe(source, sink))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                if self.mode == "blackhole":
                    continue  # swallowed: the peer hears nothing
                await self._thawed.wait()  # frozen: held until the partition heals
                sink.write(data)
                await sink.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            sink.transport.abort()
            self._writers.discard(sink)


@asynccontextmanager
async def relayed(url: str) -> AsyncIterator[tuple[Relay, str]]:
    """A relay to the database of ``url``, and the URL that goes through it."""
    parsed = make_url(url)
    relay = Relay(parsed.host or "127.0.0.1", parsed.port or 5432)
    await relay.start()
    try:
        yield relay, parsed.set(host="127.0.0.1", port=relay.port).render_as_string(hide_password=False)
    finally:
        await relay.close()
