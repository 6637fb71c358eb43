"""A real gateway served from a thread of its own, for tests written as plain functions (schemathesis and
Hypothesis run synchronous tests): the same uvicorn server as ``tests.support.running_gateway``, on its own
event loop, with every record it logs at ERROR or above kept (an unhandled exception is one)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio.from_thread
import httpx

from tests.support import STEP_S, Running, running_gateway

# Where the gateway and uvicorn report what went wrong (an exception in the ASGI app is uvicorn.error's).
LOGGERS = ("gateway", "uvicorn", "uvicorn.error")


class ErrorLog(logging.Handler):
    """Every record at ERROR or above, as logged."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def take(self) -> list[str]:
        """The records logged since the last call, as lines."""
        lines = self.lines()
        self.records.clear()
        return lines

    def lines(self) -> list[str]:
        return [f"{r.name}: {r.getMessage()} {r.exc_info[1] if r.exc_info else ''}" for r in self.records]


@dataclass
class Threaded:
    gw: Running
    client: httpx.Client
    errors: ErrorLog

    @property
    def url(self) -> str:
        return self.gw.url

    @property
    def ws_url(self) -> str:
        return self.gw.url.replace("http://", "ws://", 1)


@contextmanager
def threaded_gateway(database_url: str, **overrides: Any) -> Iterator[Threaded]:
    errors = ErrorLog()
    loggers = [logging.getLogger(name) for name in LOGGERS]
    for logger in loggers:
        logger.addHandler(errors)
    try:
        with (
            anyio.from_thread.start_blocking_portal("asyncio") as portal,
            portal.wrap_async_context_manager(running_gateway(database_url, **overrides)) as gw,
            httpx.Client(base_url=gw.url, timeout=30) as client,
        ):
            yield Threaded(gw, client, errors)
    finally:
        for logger in loggers:
            logger.removeHandler(errors)


def until(condition: Callable[[], bool], what: str, within_s: float = STEP_S) -> None:
    """``tests.support.wait_until`` for sync tests: poll a cheap ``condition`` (a request to the gateway,
    what another thread set) until it holds; past ``within_s``, fail saying ``what`` was awaited."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s} s: {what}")
        time.sleep(0.01)  # between two polls of the condition, not in place of it
