"""The in-process bus: every publish reaches this process's listeners at once, in publish order."""

from __future__ import annotations

from gateway.bus.base import Listener
from gateway.machine import Entry, Task


class LocalBus:
    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def publish(self, task: Task, entry: Entry, encoded_event: bytes) -> None:
        for listener in self._listeners:
            listener(task, entry, encoded_event)

    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)
