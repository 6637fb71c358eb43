"""Which of a task's ``metadata`` and ``children`` frames a client takes, pure (protocol.md, Metadata and
Batches): each carries the task's ``revision``, which counts the changes beside its history, and a frame
older than what the client holds (a resume frame's task, or a later frame, came first) is dropped, so that
nothing older replaces newer. ``watch`` and ``watch_tag`` hand on only what this takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

# The frames of what a task holds beside its history.
LIVE_TYPES: Final = frozenset({"metadata", "children"})


class Revisions:
    """The revision each task's metadata and each task's children were last taken at."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], int] = {}

    def task(self, task_id: str, task: Mapping[str, Any]) -> None:
        """A frame's ``task`` (a resume frame's, an event's) was handed on: its metadata and children are
        those of its revision."""
        revision = task.get("revision")
        if isinstance(revision, int):
            for kind in LIVE_TYPES:
                key = (task_id, kind)
                self._held[key] = max(revision, self._held.get(key, revision))

    def take(self, frame: Mapping[str, Any]) -> bool:
        """Whether to hand on a ``metadata`` or ``children`` frame: not older than what is held (a frame
        without a revision is taken as it is)."""
        task_id, kind, revision = frame.get("taskId"), frame.get("type"), frame.get("revision")
        if not isinstance(task_id, str) or not isinstance(revision, int) or kind not in LIVE_TYPES:
            return True
        key = (task_id, str(kind))
        if revision < self._held.get(key, revision):
            return False
        self._held[key] = revision
        return True

    def forget(self, task_id: str) -> None:
        """The task is gone (made again under its id): its revisions start over."""
        for kind in LIVE_TYPES:
            self._held.pop((task_id, kind), None)
