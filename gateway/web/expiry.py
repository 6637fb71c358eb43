"""A live subscription lasts no longer than the token that authorized it (protocol.md, Credentials): at the
token's ``exp`` it ends, as an HTTP read with that token would be refused then. Centrifugo and Ably do the
same on a live connection (a client renews its token or is cut off); here a client renews by subscribing
again with a new token and its cursor, and misses nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Literal

from gateway.frames import Frame
from gateway.live.feed import Feed

# What a connection subscribed to: a task, or a tag.
Key = tuple[Literal["task", "tag"], str]


class Expiries:
    """Each subscription of one connection ends when the token that authorized it expires: a timer per
    subscription, by key (``("task", task_id)`` or ``("tag", tag)``), which a new subscription of that key
    replaces and which does nothing if the subscription it watched is gone. Let go of with the connection;
    those of subscriptions that ended otherwise (a task's terminal frame) are let go of as new ones come."""

    __slots__ = ("_feed", "_timers")

    def __init__(self, feed: Feed) -> None:
        self._feed = feed
        self._timers: dict[Key, tuple[object, asyncio.TimerHandle]] = {}

    def _live(self, key: Key, watched: object) -> bool:
        kind, name = key
        feed = self._feed
        current = feed.peer.tags.get(name) if kind == "tag" else feed.subscriptions.get(name)
        return current is watched

    def watch(self, key: Key, watched: object, expires_at: float | None, end: Callable[[], object]) -> None:
        """Call ``end`` at ``expires_at`` (seconds since the epoch; ``None``: never) if ``watched`` is still
        the connection's subscription of ``key`` then."""
        self._forget(key)
        if expires_at is None:
            return
        if len(self._timers) > 2 * (len(self._feed.subscriptions) + len(self._feed.peer.tags)) + 16:
            for other, (gone, _) in list(self._timers.items()):
                if not self._live(other, gone):
                    self._forget(other)

        def expired() -> None:
            self._timers.pop(key, None)
            if self._live(key, watched):
                end()

        delay = max(0.0, expires_at - time.time())  # exp is wall-clock time (gateway.tokens)
        self._timers[key] = (watched, asyncio.get_running_loop().call_later(delay, expired))

    def _forget(self, key: Key) -> None:
        entry = self._timers.pop(key, None)
        if entry is not None:
            entry[1].cancel()

    def close(self) -> None:
        for _, timer in self._timers.values():
            timer.cancel()
        self._timers.clear()


def end_subscription(feed: Feed, ended: Frame, *, task_id: str | None = None, tag: str | None = None) -> None:
    """A ``/v1/ws`` subscription whose token expired: it ends (a task's own; a tag's with its tasks' streams),
    and the client is told; the socket stays open for its others."""
    if tag is not None:
        feed.unsubscribe_tag(tag)
    elif task_id is not None:
        feed.unsubscribe_task(task_id)
    feed.send_control(ended)
