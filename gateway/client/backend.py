"""``Backend`` (sync) and ``AsyncBackend``: the management side of the gateway, with the API key: create
tasks, issue tag tokens, cancel, read and list tasks, take deliveries, drain notifications.

Each method is one :class:`~gateway.client.backend_wire.Call` (built and read in ``backend_wire``), sent
through :mod:`gateway.client.exchange` as the ``Worker``'s callbacks are: transport failures, 5xx and 429
are retried with backoff and the same request. Every call here is safe to repeat: a create without an id
is given one here (a UUID), and a repeated create with the same parameters is answered ``200`` with the
task (``Created.created`` is then false, also when it was this create's first, lost answer that made it);
a retried cancel whose first answer was lost is answered ``terminal-conflict`` on the cancelled task;
deliveries and drains carry an ``Idempotency-Key``, which a drain makes itself when not given one (so its
retries take the same batch: at least once). A 4xx raises :class:`~gateway.client.errors.BackendError`
(``TaskExists``, ``UnknownTask``); a 5xx or 429 still answered after ``retries`` retries raises
``httpx.HTTPStatusError``, and a transport failure the last ``httpx.TransportError``, as ``Worker`` does.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import httpx

from gateway.client.backend_wire import Call, Created, Drained, Page, TagToken, Wire
from gateway.client.backoff import Backoff
from gateway.client.exchange import Steps, asend, send, tries
from gateway.client.worker import KEEPALIVE_S

__all__ = ["AsyncBackend", "Backend", "Created", "Drained", "Page", "TagToken"]

T = TypeVar("T")
C = TypeVar("C", httpx.Client, httpx.AsyncClient)


class _Sender(Generic[C]):
    """What both classes hold: the calls' builder, the client that sends them, the retries. ``api_key``
    ``None``: a gateway in open mode. ``client``: one of the caller's, which closing the backend leaves
    open; by default the backend makes its own."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 10.0,
        retries: int = 8,
        client: C | None = None,
    ) -> None:
        self.wire = Wire(base_url, api_key)
        self.retries = retries
        self._client: C = client if client is not None else self._new_client(timeout_s)
        self._owns_client = client is None

    def _new_client(self, timeout_s: float) -> C:
        raise NotImplementedError

    def _tries(self, call: Call[Any]) -> Steps:
        backoff = Backoff(base_s=0.05, cap_s=2.0)
        return tries(call.request(self._client), retries=self.retries, backoff=backoff)


# As the Worker's: a pooled connection is not reused once idle for long, well before the gateway closes it
# (GATEWAY_IDLE_TIMEOUT_MS), so a request is never sent on a connection being closed.
LIMITS = httpx.Limits(keepalive_expiry=KEEPALIVE_S)


class AsyncBackend(_Sender[httpx.AsyncClient]):
    """The management API from async code: ``AsyncBackend(base_url, api_key=None, *, timeout_s=10.0,
    retries=8, client=None)``, ``client`` an ``httpx.AsyncClient`` (not closed by :meth:`aclose`)."""

    def _new_client(self, timeout_s: float) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=timeout_s, limits=LIMITS)

    async def __aenter__(self) -> AsyncBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def _run(self, call: Call[T]) -> T:
        return call.answer((await asend(self._client, self._tries(call))).response)

    async def create(
        self,
        task_id: str | None = None,
        *,
        ttl_ms: int,
        max_attempts: int = 1,
        heartbeat_ms: int | None = None,
        tags: Sequence[str] = (),
        title: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        parent: str | None = None,
        progress_from_children: bool = False,
    ) -> Created:
        """``POST /v1/tasks``; ``task_id`` ``None``: a fresh UUID (named here, so that a retry cannot
        make a second task). ``title``: what a person reads for the task (1 to 200 characters);
        ``metadata``: its first metadata (a JSON object, at most 8 KiB); ``parent``: the batch it is a
        child of (a task that has not ended); ``progress_from_children``: the gateway moves this task's
        progress as its children end (protocol.md, Batches)."""
        call = self.wire.create(
            task_id,
            ttl_ms=ttl_ms,
            max_attempts=max_attempts,
            heartbeat_ms=heartbeat_ms,
            tags=tags,
            title=title,
            metadata=metadata,
            parent=parent,
            progress_from_children=progress_from_children,
        )
        return await self._run(call)

    async def patch_metadata(
        self, task_id: str, patch: Mapping[str, Any], *, attempt: int | None = None
    ) -> dict[str, Any]:
        """Merge ``patch`` into the task's metadata (RFC 7396: ``None`` removes a key), with the API key:
        any task, an ended one too (``attempt``: only while that attempt runs). Returns the task's JSON."""
        return await self._run(self.wire.patch_metadata(task_id, patch, attempt))

    async def tag_token(self, tag: str, *, ttl_s: int | None = None) -> TagToken:
        return await self._run(self.wire.tag_token(tag, ttl_s=ttl_s))

    async def cancel(self, task_id: str, reason: str | None = None) -> dict[str, Any]:
        """The cancel's answer (``reason``: ``cancelled``, ``terminal-conflict``, ``expired``)."""
        return await self._run(self.wire.cancel(task_id, reason))

    async def get(self, task_id: str) -> dict[str, Any]:
        return await self._run(self.wire.get(task_id))

    async def list(
        self,
        *,
        state: str | None = None,
        tags: Sequence[str] = (),
        cursor: str | None = None,
        limit: int | None = None,
    ) -> Page:
        return await self._run(self.wire.list(state=state, tags=tags, cursor=cursor, limit=limit))

    async def list_all(
        self, *, state: str | None = None, tags: Sequence[str] = (), limit: int | None = None
    ) -> AsyncIterator[dict[str, Any]]:
        """Every task :meth:`list` lists, page after page (``limit``: a page's size)."""
        cursor: str | None = None
        while True:
            page = await self.list(state=state, tags=tags, cursor=cursor, limit=limit)
            for task in page.tasks:
                yield task
            if (cursor := page.next_cursor) is None:
                return

    async def deliver(self, task_id: str, idempotency_key: str) -> dict[str, Any]:
        """The delivery's answer, with its ``receipt``."""
        return await self._run(self.wire.deliver(task_id, idempotency_key))

    async def drain(self, *, limit: int | None = None, idempotency_key: str | None = None) -> Drained:
        return await self._run(self.wire.drain(limit=limit, idempotency_key=idempotency_key))


class Backend(_Sender[httpx.Client]):
    """The management API from sync code, :class:`AsyncBackend`'s methods blocking: ``Backend(base_url,
    api_key=None, *, timeout_s=10.0, retries=8, client=None)``, ``client`` an ``httpx.Client`` (not closed
    by :meth:`close`)."""

    def _new_client(self, timeout_s: float) -> httpx.Client:
        return httpx.Client(timeout=timeout_s, limits=LIMITS)

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_client:
            self._client.close()

    def _run(self, call: Call[T]) -> T:
        return call.answer(send(self._client, self._tries(call)).response)

    def create(
        self,
        task_id: str | None = None,
        *,
        ttl_ms: int,
        max_attempts: int = 1,
        heartbeat_ms: int | None = None,
        tags: Sequence[str] = (),
        title: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        parent: str | None = None,
        progress_from_children: bool = False,
    ) -> Created:
        """``POST /v1/tasks``; ``task_id`` ``None``: a fresh UUID (named here, so that a retry cannot
        make a second task). ``title``: what a person reads for the task (1 to 200 characters);
        ``metadata``: its first metadata (a JSON object, at most 8 KiB); ``parent``: the batch it is a
        child of (a task that has not ended); ``progress_from_children``: the gateway moves this task's
        progress as its children end (protocol.md, Batches)."""
        call = self.wire.create(
            task_id,
            ttl_ms=ttl_ms,
            max_attempts=max_attempts,
            heartbeat_ms=heartbeat_ms,
            tags=tags,
            title=title,
            metadata=metadata,
            parent=parent,
            progress_from_children=progress_from_children,
        )
        return self._run(call)

    def patch_metadata(
        self, task_id: str, patch: Mapping[str, Any], *, attempt: int | None = None
    ) -> dict[str, Any]:
        """Merge ``patch`` into the task's metadata (RFC 7396: ``None`` removes a key), with the API key:
        any task, an ended one too (``attempt``: only while that attempt runs). Returns the task's JSON."""
        return self._run(self.wire.patch_metadata(task_id, patch, attempt))

    def tag_token(self, tag: str, *, ttl_s: int | None = None) -> TagToken:
        return self._run(self.wire.tag_token(tag, ttl_s=ttl_s))

    def cancel(self, task_id: str, reason: str | None = None) -> dict[str, Any]:
        """The cancel's answer (``reason``: ``cancelled``, ``terminal-conflict``, ``expired``)."""
        return self._run(self.wire.cancel(task_id, reason))

    def get(self, task_id: str) -> dict[str, Any]:
        return self._run(self.wire.get(task_id))

    def list(
        self,
        *,
        state: str | None = None,
        tags: Sequence[str] = (),
        cursor: str | None = None,
        limit: int | None = None,
    ) -> Page:
        return self._run(self.wire.list(state=state, tags=tags, cursor=cursor, limit=limit))

    def list_all(
        self, *, state: str | None = None, tags: Sequence[str] = (), limit: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """Every task :meth:`list` lists, page after page (``limit``: a page's size)."""
        cursor: str | None = None
        while True:
            page = self.list(state=state, tags=tags, cursor=cursor, limit=limit)
            yield from page.tasks
            if (cursor := page.next_cursor) is None:
                return

    def deliver(self, task_id: str, idempotency_key: str) -> dict[str, Any]:
        """The delivery's answer, with its ``receipt``."""
        return self._run(self.wire.deliver(task_id, idempotency_key))

    def drain(self, *, limit: int | None = None, idempotency_key: str | None = None) -> Drained:
        return self._run(self.wire.drain(limit=limit, idempotency_key=idempotency_key))
