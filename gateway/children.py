"""A batch's counts (protocol.md, Batches): the ``children`` of a parent task, kept by the gateway in the same
transaction as each child's creation and change, so that a read never counts rows. Pure: no I/O, no clock.

A child counts in ``total`` from its creation and in exactly one of the other five by its state, so that
``total`` is always their sum; a cancelled child is ``failed`` (its state). A parent created with
``progressFromChildren`` has its progress moved as its children end: :func:`children_progress` decides the
``progress`` event, which the machine then judges as any other (only upward, only while the parent runs).
"""

from __future__ import annotations

from typing import Final

from gateway.machine import CHILDREN_FIELDS, Progress, Task

Counts = tuple[int, int, int, int, int, int]
NONE: Final[Counts] = (0, 0, 0, 0, 0, 0)
_AT: Final = {state: index for index, state in enumerate(CHILDREN_FIELDS) if index}
# The cursor of a progress entry the gateway appends for a parent's children: ``children:ENDED/TOTAL``.
CURSOR_PREFIX: Final = "children:"


def moved(counts: Counts | None, before: str | None, after: str) -> Counts:
    """The counts once a child moved from state ``before`` (``None``: the child is new) to ``after``."""
    values = list(counts or NONE)
    if before is None:
        values[0] += 1
    else:
        values[_AT[before]] -= 1
    values[_AT[after]] += 1
    return (values[0], values[1], values[2], values[3], values[4], values[5])


def ended(counts: Counts) -> int:
    """How many of the children have ended (succeeded, failed or expired)."""
    return counts[3] + counts[4] + counts[5]


def children_progress(parent: Task, at_ms: float) -> Progress | None:
    """The ``progress`` event a parent created with ``progressFromChildren`` is moved by, now that its counts
    are ``parent.children``: ``floor(ended * 100 / total)``, when the parent runs and that is above its
    progress (the machine accepts nothing else); ``None`` otherwise."""
    counts = parent.children
    if not parent.progress_from_children or counts is None or parent.state != "running":
        return None
    if at_ms >= parent.expires_at_ms:  # the machine would expire it: that is the sweeper's to do
        return None
    done = ended(counts)
    progress = done * 100 // counts[0]
    if progress <= parent.progress:
        return None
    return Progress(at_ms, progress, f"{CURSOR_PREFIX}{done}/{counts[0]}")
