"""A subscription's frames of its task's state beside the history (protocol.md, Metadata and Batches): the
``metadata`` and ``children`` frames. Pure, as the rest of the fan-out core.

Each change beside the history counts one ``revision``, and a message carries the whole state at its
revision (``gateway.frames.Beside``), so that the newest one a subscription heard replaces any it has not
sent (merged for a slow subscriber, never dropped: the last is always sent) and one older than what its
client holds is never sent. What the client holds is the newer of what this sent it and the task of the
last frame it got (a resume frame, an entry), whose task carries the state too; only the frames whose
content differs from it go. A message lost on the bus, or too large for it, is made good from the store:
the hub compares each channel's revision with the store's, and reads the state of a bare wake-up
(``gateway.live.beside_delivery``).
"""

from __future__ import annotations

from gateway.frames import Beside, Frame
from gateway.machine import Task

__all__ = ["Beside", "BesideOut"]


class BesideOut:
    """One subscription's state beside the history: what it has not sent yet, and what it sent last."""

    __slots__ = ("pending", "sent")

    def __init__(self) -> None:
        self.pending: Beside | None = None
        self.sent: Beside | None = None

    def offer(self, state: Beside, last: Task | None) -> bool:
        """A state heard: ``True`` when it is newer than what the client holds and what waits (it then
        waits, in place of any older)."""
        if last is not None and not _same_history(state, last):
            return False
        if state.revision <= self.revision(last):
            return False
        pending = self.pending
        if pending is not None and state.revision <= pending.revision and _same_epoch(state, pending):
            return False
        self.pending = state
        return True

    def revision(self, last: Task | None) -> int:
        """The revision the client holds (-1 before its resume frame)."""
        held = self.held(last)
        return -1 if held is None else held.revision

    def held(self, last: Task | None) -> Beside | None:
        """What the client holds: the newer of what was sent and the last task it got (``last``)."""
        sent = self.sent
        if last is None:
            return sent
        if sent is None or sent.revision < last.revision or not _same_epoch(sent, Beside.of(last)):
            return Beside.of(last)
        return sent

    def frames(self, last: Task) -> list[Frame]:
        """The frames of the state waiting, for a client whose last task is ``last`` (its resume frame out);
        none when it holds that state already. Call :meth:`sent_now` once they are written."""
        pending = self.pending
        if pending is None or not _same_history(pending, last):
            return []
        held = self.held(last)
        if held is not None and pending.revision <= held.revision:
            return []
        return pending.frames(held)

    def sent_now(self) -> None:
        """The frames of :meth:`frames` were written (or there were none)."""
        if self.pending is not None:
            self.sent, self.pending = self.pending, None

    def take(self, last: Task) -> list[Frame]:
        """:meth:`frames`, then :meth:`sent_now`: what the connection's writer sends."""
        frames = self.frames(last)
        self.sent_now()
        return frames


def _same_epoch(a: Beside, b: Beside) -> bool:
    return not a.epoch or not b.epoch or a.epoch == b.epoch


def _same_history(state: Beside, last: Task) -> bool:
    """Whether ``state`` is of the task's history the subscription follows (an id made again is another)."""
    return not state.epoch or not last.epoch or state.epoch == last.epoch
