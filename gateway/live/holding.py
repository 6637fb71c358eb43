"""A connection held to having a subscription (protocol.md, Close codes: ``/v1/ws``): one that has held none
for a deadline (since it opened, or since its last subscription ended) or has had a number of messages
refused while holding none is closed after a frame that says why, so that a socket with no credential costs
a bounded time and work whatever it sends. :class:`Holding` is ``gateway.live.peer.Peer``'s part of it,
pure: the driver's clock is passed in.
"""

from __future__ import annotations

from collections.abc import Mapping


class Holding:
    """The deadline and the refusals of a connection (``Peer``)."""

    __slots__ = ("deadline_s", "idle_since", "max_refusals", "refusals")

    def __init__(self) -> None:
        # Held to having a subscription (hold_to): the deadline, and since when it has held none (the driver's
        # clock; None while it holds one); its messages refused since it last held one.
        self.deadline_s: float | None = None
        self.max_refusals = 0
        self.idle_since: float | None = None
        self.refusals = 0

    # The connection's, read here.
    close_code: int | None
    closing: int | None
    subscriptions: Mapping[str, object]
    tags: Mapping[str, object]

    def hold_to(self, now: float, deadline_s: float, max_refusals: int) -> None:
        """From ``now`` on, this connection is closed when it holds no subscription for ``deadline_s``
        (:meth:`idle_overdue`) or at its ``max_refusals``-th message refused while it holds none
        (:meth:`refused`)."""
        self.deadline_s = deadline_s
        self.max_refusals = max_refusals
        self.idle_since = now

    def held(self) -> None:
        """One of its subscriptions was authorized and resumed: no deadline, no refusal counted, while it
        holds one."""
        self.idle_since = None
        self.refusals = 0

    def let_go(self, now: float) -> None:
        """A subscription of it ended: when it was the last (a tag's counts while it lasts), the deadline
        starts again from ``now``."""
        if self.deadline_s is not None and self.idle_since is None and not (self.subscriptions or self.tags):
            self.idle_since = now

    def refused(self) -> bool:
        """One of its messages was refused (an error frame answers it); ``True`` when that is the
        ``max_refusals``-th since it last held a subscription (or opened): then close it."""
        if self.idle_since is None:
            return False
        self.refusals += 1
        return self.refusals >= self.max_refusals

    def idle_overdue(self, now: float) -> bool:
        """Whether it has held no subscription for its deadline (one being authorized or resumed counts as
        held): then close it."""
        return (
            self.deadline_s is not None
            and self.idle_since is not None
            and not (self.subscriptions or self.tags)
            and self.close_code is None
            and self.closing is None
            and now - self.idle_since >= self.deadline_s
        )
