"""Who hears of what a book (``gateway.book``) has committed: hooks are subscriptions, not slots."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class Listeners:
    """Who hears of what a book has committed, one explicit list per kind, set up by the composition root
    (``gateway.runtime``) before anything runs. Each is called on the book's event loop right after the
    commit it tells of, and must not block: they are wake-ups, the store is the truth."""

    __slots__ = ("deadline", "expired", "leases_ended", "notifications")

    def __init__(
        self,
        *,
        deadline: Sequence[Callable[[int], None]] = (),
        expired: Sequence[Callable[[Sequence[int]], None]] = (),
        leases_ended: Sequence[Callable[[Sequence[int]], None]] = (),
        notifications: Sequence[Callable[[], None]] = (),
    ) -> None:
        # A new task's deadline or a lease's new end, once committed (the sweeper's wake-up).
        self.deadline = list(deadline)
        # An expiry batch committed, with its tasks' deadlines (the lateness metric).
        self.expired = list(expired)
        # A batch of ended leases committed, with their ends (the lease lateness metric).
        self.leases_ended = list(leases_ended)
        # A commit wrote notifications to the outbox (the webhook relay's wake-up).
        self.notifications = list(notifications)

    def deadline_set(self, expires_at_ms: int) -> None:
        for listener in self.deadline:
            listener(expires_at_ms)

    def tasks_expired(self, deadlines_ms: Sequence[int]) -> None:
        for listener in self.expired:
            listener(deadlines_ms)

    def leases_over(self, ends_ms: Sequence[int]) -> None:
        for listener in self.leases_ended:
            listener(ends_ms)

    def notified(self) -> None:
        for listener in self.notifications:
            listener()
