"""The ``Worker``'s streams (protocol.md, Streams): ``write(name, text)`` and ``flush()``, buffered as
:mod:`gateway.client.stream_out` decides, sent by the worker's own requests (the same retries, the same
client), one append on its way at a time. A mixin of :class:`~gateway.client.Worker`, which holds what it
uses (declared below) and says what an attempt over means (``_outlived``: take the task back or not).
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import anyio.abc
import httpx

from gateway.client.backoff import Backoff
from gateway.client.errors import AttemptOver, CallbackError, TaskCancelled, WorkerError, cancelled
from gateway.client.exchange import asend, problem, tries
from gateway.client.stream_out import ATTEMPT_OVER, Again, Batch, Over, Refused, StreamOut, Taken


class StreamWriting:
    """``write`` and ``flush`` of a :class:`~gateway.client.Worker` (its docstring: Streams)."""

    # The Worker's, which these methods use.
    task_id: str
    attempt: int | None
    headers: dict[str, str]
    streams_url: str
    retries: int
    backoff: Backoff
    _client: httpx.AsyncClient
    _heartbeats: anyio.abc.TaskGroup | None
    _block: anyio.CancelScope | None
    _over: AttemptOver | TaskCancelled | None
    _ending: bool

    def _init_streams(self) -> None:
        # What ``write`` kept, per name; one append on its way at a time (made in the event loop); the
        # background sender (inside ``async with``) and what wakes it; a refusal it learned, for the next
        # write or flush to raise.
        self._streams: dict[str, StreamOut] = {}
        self._appending: anyio.Lock | None = None
        self._flushing: anyio.CancelScope | None = None
        self._written: anyio.Event | None = None
        self._refused: CallbackError | None = None
        self._ended_by: WorkerError | None = None  # an append told the attempt is over: every write raises it

    async def _outlived(
        self, attempt: int, task: dict[str, Any] | None, event: dict[str, Any] | None
    ) -> bool:
        raise NotImplementedError  # the Worker's

    def _renewed(self, answer: dict[str, Any], sent_at: float) -> None:
        raise NotImplementedError  # the Worker's

    def _stop_flushing(self) -> None:
        if self._flushing is not None:
            self._flushing.cancel()
            self._flushing = None

    async def write(self, name: str, text: str) -> None:
        """Append ``text`` to the task's stream ``name`` (1 to 32 characters of ``a-z 0-9 _ -``), buffered:
        sent within 50 ms (inside ``async with``; outside, by a later write or :meth:`flush`), at once when
        64 KiB wait (this call then waits for their answer). Raises :class:`AttemptOver` /
        :class:`TaskCancelled` once the attempt is over, :class:`CallbackError` for a batch the gateway
        refused (the module's docstring)."""
        self._check_writable()
        out = self._streams.get(name)
        if out is None:
            out = self._streams[name] = StreamOut(name)
        now = anyio.current_time()
        out.write(text, now)
        if self._heartbeats is None or out.full():
            await self._send(out, flush=out.full())  # what is due now, outside the block
        elif self._flushing is None:
            self._flushing = anyio.CancelScope()
            self._written = anyio.Event()
            self._heartbeats.start_soon(self._flush_in_background, self._flushing)
        elif self._written is not None:
            self._written.set()

    async def flush(self) -> None:
        """Send everything written and not taken yet, now; raises as :meth:`write` does."""
        self._check_writable()
        for out in list(self._streams.values()):
            await self._send(out, flush=True)

    def _check_writable(self) -> None:
        if self._over is not None:
            raise self._over
        if self._ended_by is not None:
            raise self._ended_by
        if self._refused is not None:
            refused, self._refused = self._refused, None
            raise refused
        if self.attempt is None:
            raise RuntimeError("write() before start(): this worker holds no attempt")

    async def _send(self, out: StreamOut, *, flush: bool) -> None:
        """Send ``out``'s batches that are due (all: ``flush``), one at a time, each until it is answered;
        a new attempt (the task taken back) sends them as its own."""
        if self._appending is None:
            self._appending = anyio.Lock()
        async with self._appending:
            while True:
                assert self.attempt is not None
                batch = out.take(self.attempt, anyio.current_time(), flush=flush)
                if not isinstance(batch, Batch):
                    return
                await self._append(out, batch)

    async def _append(self, out: StreamOut, batch: Batch) -> None:
        """One try of ``batch`` until answered (transport failures, 5xx and 429 retried, the same body)."""
        url = f"{self.streams_url}/{batch.name}"
        request = self._client.build_request("POST", url, json=batch.body(), headers=self.headers)
        sent = await asend(self._client, tries(request, retries=self.retries, backoff=self.backoff))
        try:
            body = sent.response.json()
        except ValueError:
            body = {}
        body = body if isinstance(body, dict) else {}
        verdict = out.answered(batch, sent.response.status_code, body)
        if isinstance(verdict, Taken):
            self._renewed(body, sent.sent_at)
        elif isinstance(verdict, Over):
            if not await self._outlived(batch.attempt, verdict.task, None):
                self._ended_by = refusal(sent.response, "write", self.task_id)
                raise self._ended_by
        elif isinstance(verdict, Refused):
            raise CallbackError(verdict.status, verdict.code, verdict.message, task_id=self.task_id)
        else:
            assert isinstance(verdict, Again)  # sent again, at the number the gateway expects

    async def _flush_in_background(self, scope: anyio.CancelScope) -> None:
        """Inside ``async with``: send each stream's buffer when it is due (50 ms after its oldest write),
        until cancelled. Told the attempt is over, cancel the block (which raises it), as a heartbeat does;
        a refusal is raised by the next write; a gateway that cannot be reached is tried again later."""
        backoff = Backoff(base_s=0.05, cap_s=2.0)
        with scope:
            while True:
                assert self._written is not None
                now = anyio.current_time()
                dues = [due for out in self._streams.values() if (due := out.due(now)) is not None]
                if not dues or min(dues) > now:
                    self._written = written = anyio.Event()
                    with anyio.move_on_after(min(dues) - now if dues else math.inf):
                        await written.wait()
                    continue
                try:
                    for out in list(self._streams.values()):
                        await self._send(out, flush=False)
                    backoff.reset()
                except (AttemptOver, TaskCancelled) as exc:
                    if self._ending:
                        return
                    self._over = exc
                    if self._block is not None:
                        self._block.cancel()
                    return
                except CallbackError as exc:
                    self._refused = exc
                except httpx.HTTPError:
                    await anyio.sleep(backoff.next_delay())  # no answer: the same batches, a while later


def refusal(response: httpx.Response, what: str, task_id: str) -> WorkerError:
    """The error for a 4xx answer: :class:`AttemptOver` when it says the attempt is over (with the task the
    answer carries, if any), :class:`TaskCancelled` when it is over because the task was cancelled, else
    :class:`CallbackError`."""
    said = problem(response)
    if response.status_code != 409 or said.code not in ATTEMPT_OVER:
        return CallbackError(response.status_code, said.code, said.message, task_id=task_id)
    if said.task is not None and cancelled(said.task):
        return TaskCancelled(what, said.code, said.task)
    return AttemptOver(response.status_code, said.code, said.message, task_id=task_id, task=said.task)
