"""Whether the reporter's sender can reach the gateway, as its requests find it: said once when they
cannot (a WARNING naming the gateway, why, and how many reports wait) and once when they can again (INFO),
never once per retry: a worker's log must not fill with a line a retry while the gateway is away, nor say
nothing while the job's reports pile up in its process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("gateway.integrations")


class Reach:
    """The sender's view of the gateway at ``url``; ``waiting`` counts the reports kept for it. Used by the
    sender's thread alone."""

    def __init__(self, url: str, waiting: Callable[[], int]) -> None:
        self.url = url
        self._waiting = waiting
        self.down_since: float | None = None  # monotonic: when a request first failed to reach it

    def lost(self, why: str) -> None:
        """A request did not reach the gateway (or it answered 5xx): a WARNING, unless one was said since
        the gateway last answered."""
        if self.down_since is None:
            self.down_since = time.monotonic()
            log.warning(
                "task-gateway: cannot reach %s (%s); %d reports wait and are retried until their task's "
                "deadline",
                self.url,
                why,
                self._waiting(),
            )

    def found(self) -> None:
        """The gateway answered: an INFO if it could not be reached before."""
        if self.down_since is not None:
            log.info(
                "task-gateway: reached %s again after %.1f s; sending the reports that waited",
                self.url,
                time.monotonic() - self.down_since,
            )
            self.down_since = None
