"""The bus interface."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from gateway.machine import Entry, Task

# Called with a committed entry, the task after it, and the entry's event as stored (JSON bytes).
Listener = Callable[[Task, Entry, bytes], None]


class Bus(Protocol):
    def publish(self, task: Task, entry: Entry, encoded_event: bytes) -> None:
        """Announce an entry; called only after its transaction has committed. Never blocks."""

    def listen(self, listener: Listener) -> None:
        """Have ``listener`` called for every entry published from now on."""
