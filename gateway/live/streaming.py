"""The streams' side of the hub (``gateway.live.hub``): chunks appended to a task's stream, committed, handed
to every subscription of the task on this process that asked for the stream (``gateway.live.peer``); and the
periodic check of the streams' offsets against the store, which finds a batch whose bus message was lost.

A batch all a subscription has to send, on a socket with nothing else queued, goes straight to the socket
(framed once for every socket in step with it), as a round's entries do; otherwise the connection's writer
sends it, merged with what waits (``gateway.live.chunks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

from gateway.bus.base import StreamRun
from gateway.live.chunks import Run
from gateway.live.fanout import Fanout
from gateway.live.published import Live, SubStreams
from gateway.machine import Task
from gateway.streams import Page

__all__ = ["DirectWriter", "StreamStore", "check_streams", "deliver"]

# The tasks of one query of the streams' check.
CHECK_CHUNK = 1000


class StreamStore(Protocol):
    """The reads of streams the hub and its feeds make (``gateway.book.stream_reads.StreamReads``)."""

    async def page(
        self, task_id: str, name: str, offset: int, epoch: str | None, limit: int, page_bytes: int = ...
    ) -> tuple[Task, Page]: ...

    async def next_offsets(self, task_ids: Sequence[str]) -> dict[str, dict[str, int]]: ...


class DirectWriter(Protocol):
    """A socket that can take already-framed bytes now (``gateway.server.ws_protocol``)."""

    def can_write(self, size: int) -> bool: ...

    def write(self, data: bytes) -> None: ...


class Handle(Protocol):
    """What this does with a connection (``gateway.live.hub.Connection`` is one)."""

    writer: DirectWriter | None

    def signal(self) -> None: ...

    def stall(self) -> None: ...


H = TypeVar("H", bound=Handle)


def deliver(fanout: Fanout[H], task_id: str, appended: StreamRun) -> int:
    """An append to a stream of ``task_id``, committed (its chunks, or a bare wake-up), to each subscription
    of the task that asked for streams; how many frames went straight to a socket."""
    channel = fanout.channels.get(task_id)
    subs = [s for s in channel.subscriptions if s.streams] if channel is not None else []
    chunks = appended.items() if subs else None
    run = None if chunks is None else Run.of(appended.attempt, appended.offset, chunks)
    wire = b""
    direct = 0
    for sub in subs:
        peer = sub.peer
        live = peer.stream_live(sub, appended.stream, run, appended.next_offset)
        if live is Live.DIRECT and run is not None:  # straight to its socket, if it has room
            wire = wire or SubStreams.wire(task_id, appended.stream, run)
            writer = peer.handle.writer
            written = writer is not None and writer.can_write(len(wire))
            if writer is not None and written:
                writer.write(wire)
                direct += 1
            live = peer.stream_written(sub, written)
        if live is Live.SLOW:  # past its backlog (4008): its send under way, if any, is cut
            peer.handle.stall()
        elif live is Live.WAKE:
            peer.handle.signal()
    return direct


async def check_streams(fanout: Fanout[H], store: StreamStore) -> None:
    """Compare the streams' offsets of every task subscribed to with streams with the store's, in one query
    per chunk of tasks: a subscription that lacks chunks reads them."""
    channels = fanout.channels.values()
    streamed = [c.task_id for c in channels if any(s.streams for s in c.subscriptions)]
    for start in range(0, len(streamed), CHECK_CHUNK):
        found = await store.next_offsets(streamed[start : start + CHECK_CHUNK])
        for task_id, offsets in found.items():
            for name, next_offset in offsets.items():
                deliver(fanout, task_id, StreamRun(name, 0, next_offset, next_offset))
