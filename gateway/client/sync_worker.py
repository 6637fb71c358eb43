"""``SyncWorker``: the :class:`~gateway.client.Worker` for sync job code (a Celery or RQ job, a script):
the same methods with the same signatures, answers and errors, blocking.

It is a ``Worker`` run on an event loop of its own, in a thread of its own (an anyio blocking portal,
one per ``SyncWorker``), so nothing is written twice: the callbacks, their stable ids and retries, the
fencing and the heartbeats are the ``Worker``'s. Inside ``with SyncWorker(...) as worker:`` the worker
heartbeats in the background on that thread while the job runs on its own, as ``async with Worker``
does; the job's thread cannot be interrupted, so when a heartbeat learns that the attempt is over (or the
task was cancelled), the job's next call raises :class:`~gateway.client.AttemptOver` (or
:class:`~gateway.client.TaskCancelled`), and so does the block's end. Outside ``with``, call
:meth:`close` when done (it ends the thread); there are no background heartbeats then.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from functools import partial
from typing import Any, TypeVar

import anyio.from_thread
import httpx

from gateway.client.backoff import Backoff
from gateway.client.worker import KEEPALIVE_S, Worker

__all__ = ["SyncWorker"]

T = TypeVar("T")


class SyncWorker:
    """``Worker(base_url, task_id, callback_token, ...)``'s methods from sync code; ``worker`` is the
    ``Worker`` it runs (its thread's)."""

    def __init__(
        self,
        base_url: str,
        task_id: str,
        callback_token: str,
        *,
        retries: int = 8,
        timeout_s: float = 10.0,
        backoff: Backoff | None = None,
    ) -> None:
        self._thread = anyio.from_thread.start_blocking_portal("asyncio")
        self._portal = self._thread.__enter__()
        # The worker's client is this object's: a heartbeat that ends the block's attempt must not close it
        # under a callback the job is sending meanwhile (which then gets the gateway's own answer).
        limits = httpx.Limits(keepalive_expiry=KEEPALIVE_S)
        self._client = httpx.AsyncClient(timeout=timeout_s, limits=limits)
        self.worker = Worker(
            base_url, task_id, callback_token, client=self._client, retries=retries, backoff=backoff
        )
        self._block: AbstractContextManager[Worker] | None = None
        self._closed = False

    @property
    def task_id(self) -> str:
        return self.worker.task_id

    @property
    def attempt(self) -> int | None:
        """The attempt this worker's ``start`` began (``None`` before)."""
        return self.worker.attempt

    @property
    def heartbeating(self) -> bool:
        return self.worker.heartbeating

    def __enter__(self) -> SyncWorker:
        block = self._portal.wrap_async_context_manager(self.worker)
        try:
            block.__enter__()
        except BaseException:
            self.close()
            raise
        self._block = block
        return self

    def __exit__(self, *exc: Any) -> None:
        block, self._block = self._block, None
        try:
            if block is not None:
                block.__exit__(*exc)  # raises what the heartbeat learned, as ``async with Worker`` does
        finally:
            self.close()

    def close(self) -> None:
        """Close the connections and end the thread (``with`` does it at the block's end)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._portal.call(self._client.aclose)
        finally:
            self._thread.__exit__(None, None, None)

    def _call(self, method: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        if self.worker.over is not None:  # a heartbeat learned the attempt is over: the job must stop
            raise self.worker.over
        return self._portal.call(partial(method, *args, **kwargs))

    def start(self, worker: str, *, take_over: bool = False) -> dict[str, Any]:
        """:meth:`Worker.start <gateway.client.Worker.start>`."""
        return self._call(self.worker.start, worker, take_over=take_over)

    def progress(self, progress: int, cursor: str = "", *, callback_id: str | None = None) -> dict[str, Any]:
        return self._call(self.worker.progress, progress, cursor, callback_id=callback_id)

    def succeed(self, result_ref: str, result_hash: str, *, callback_id: str | None = None) -> dict[str, Any]:
        return self._call(self.worker.succeed, result_ref, result_hash, callback_id=callback_id)

    def fail(self, error: str, *, retryable: bool, callback_id: str | None = None) -> dict[str, Any]:
        return self._call(self.worker.fail, error, retryable=retryable, callback_id=callback_id)

    def send(
        self,
        event: dict[str, Any],
        *,
        callback_id: str | None = None,
        fenced: bool = False,
        check: bool = True,
    ) -> dict[str, Any]:
        return self._call(self.worker.send, event, callback_id=callback_id, fenced=fenced, check=check)

    def heartbeat(self) -> dict[str, Any]:
        return self._call(self.worker.heartbeat)

    def write(self, name: str, text: str) -> None:
        """:meth:`Worker.write <gateway.client.Worker.write>`: ``text`` appended to the stream ``name``,
        buffered (sent within 50 ms inside ``with``; at 64 KiB this call waits for the gateway's answer)."""
        self._call(self.worker.write, name, text)

    def metadata(self, patch: Mapping[str, Any]) -> dict[str, Any]:
        """:meth:`Worker.metadata <gateway.client.Worker.metadata>`: ``patch`` merged into the task's
        metadata, as this worker's attempt (waits for the answer)."""
        return self._call(self.worker.metadata, patch)

    def message(self, text: str) -> dict[str, Any]:
        """:meth:`Worker.message <gateway.client.Worker.message>`: the status line, ``metadata.message``."""
        return self._call(self.worker.message, text)

    def flush(self) -> None:
        """:meth:`Worker.flush <gateway.client.Worker.flush>`: send everything written, now."""
        self._call(self.worker.flush)
