"""The WebSocket keep-alive pings of one event loop, batched on one timer (a wheel).

uvicorn pings each socket on timers of its own: a timer for the next ping and one for the pong's deadline,
cancelled when the pong comes, so two timers per socket per interval, and each ping framed apart with a
random payload. At thousands of sockets a process that is otherwise idle spends its time on those timers.
The wheel instead keeps one repeating timer per loop (and interval) that ticks every ``TICK_S`` (the
interval cut in that many buckets); a connection joins the bucket that comes round one interval later,
and each tick serves one bucket: a connection whose last ping is still unanswered (its pong is an
interval late, as ``ping_timeout == ping_interval`` asks) is timed out, every other one is sent the same
ping frame, framed once for the tick with a payload of its own (a counter), so that a pong to an older
ping does not count.

What a connection keeps is what uvicorn's ``handle_pong`` reads (``pending_ping_payload``, ``ping_sent_at``):
it clears the pending payload when the pong comes and, with no ``pong_timer``, schedules nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

from gateway.server.http_protocol import drop

log = logging.getLogger("gateway")

# A tick serves one bucket, its pings written in one go: small enough a batch not to hold up the loop (at
# 16,000 sockets pinged every 20 s, 40 pings a tick), few enough ticks to cost nothing (20 a second).
TICK_S = 0.05
_ATTRIBUTE = "_gateway_keepalive_wheels"  # on the loop: its wheels by interval, gone with the loop
_PING_HEADER = b"\x89\x04"  # FIN + ping; a server's frame is not masked; 4 bytes of payload


class Pinged(Protocol):
    """What the wheel reads and sets on a connection (uvicorn's ``WebSocketsSansIOProtocol``)."""

    keepalive_bucket: dict[Pinged, None] | None  # the wheel's bucket it is in, set by the wheel
    pending_ping_payload: bytes | None
    ping_sent_at: float
    close_sent: bool
    disconnected: bool
    transport: asyncio.Transport

    def keepalive_timeout(self) -> None: ...


class KeepaliveWheel:
    """The keep-alive pings of the connections of one loop that share one interval."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, interval_s: float, buckets: int | None = None
    ) -> None:
        if buckets is None:
            buckets = max(1, round(interval_s / TICK_S))
        self._loop = loop
        self.interval_s = interval_s
        self.tick_s = interval_s / buckets
        # Insertion-ordered sets: a connection stays in its bucket from its start to its end.
        self._buckets: list[dict[Pinged, None]] = [{} for _ in range(buckets)]
        self._next = 0  # the bucket the next tick serves
        self._size = 0
        self._timer: asyncio.TimerHandle | None = None
        self._tick_at = 0.0
        self._count = 0  # the ping payload of the last tick

    def __len__(self) -> int:
        return self._size

    @property
    def running(self) -> bool:
        """Whether the wheel's timer is set (it is while any connection is in it)."""
        return self._timer is not None

    def join(self, member: Pinged) -> None:
        """Ping ``member`` from one interval on (nothing if it is already in)."""
        if member.keepalive_bucket is not None:
            return
        if self._timer is None:
            self._tick_at = self._loop.time() + self.tick_s
            self._timer = self._loop.call_at(self._tick_at, self._tick)
        # The bucket served last comes round again after as many ticks as buckets: an interval from now.
        bucket = self._buckets[self._next - 1]
        bucket[member] = None
        member.keepalive_bucket = bucket
        self._size += 1

    def leave(self, member: Pinged) -> None:
        bucket = member.keepalive_bucket
        if bucket is None:
            return
        member.keepalive_bucket = None
        del bucket[member]
        self._size -= 1
        if not self._size and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        self._timer = None
        bucket = self._buckets[self._next]
        self._next = (self._next + 1) % len(self._buckets)
        if bucket:
            self._count = (self._count + 1) & 0xFFFF_FFFF
            payload = self._count.to_bytes(4, "big")
            frame = _PING_HEADER + payload
            now = self._loop.time()
            # A copy: a connection that is timed out leaves its bucket meanwhile.
            for member in list(bucket):
                try:
                    if member.close_sent or member.disconnected or member.transport.is_closing():
                        self.leave(member)
                    elif member.pending_ping_payload is not None:  # no pong to the last ping, an interval ago
                        self.leave(member)
                        member.keepalive_timeout()
                    else:
                        member.pending_ping_payload = payload
                        member.ping_sent_at = now
                        member.transport.write(frame)
                except Exception:  # one connection's failure must not stop the pings of every other
                    log.exception("keep-alive: pinging a WebSocket failed; dropping it")
                    self.leave(member)
                    # Fail closed: a socket no longer pinged would outlive a peer that vanished.
                    with contextlib.suppress(Exception):
                        drop(member.transport)
        if self._size and self._timer is None:
            # Each tick a step after the last one was due, so the wheel does not drift; after a stall of
            # the loop, the next one at once and then a step apart (the ticks missed are not run in a burst).
            self._tick_at = max(self._tick_at + self.tick_s, self._loop.time())
            self._timer = self._loop.call_at(self._tick_at, self._tick)


def wheel_for(loop: asyncio.AbstractEventLoop, interval_s: float) -> KeepaliveWheel | None:
    """The loop's wheel for ``interval_s``, made on first use; kept on the loop itself so that it goes with
    it (nothing outlives a loop). None if the loop takes no attribute (then uvicorn's own timers ping)."""
    wheels: dict[float, KeepaliveWheel] | None = getattr(loop, _ATTRIBUTE, None)
    if wheels is None:
        wheels = {}
        try:
            setattr(loop, _ATTRIBUTE, wheels)
        except AttributeError:
            return None
    wheel = wheels.get(interval_s)
    if wheel is None:
        wheel = wheels[interval_s] = KeepaliveWheel(loop, interval_s)
    return wheel
