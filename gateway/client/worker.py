"""``Worker``: the job's side. Posts callbacks with a stable ``callbackId`` per logical callback, so a
retry after a timeout, a dropped connection or a 5xx is recognised by the gateway and changes nothing
twice; fences ``progress``/``succeed``/``fail`` with the attempt its ``start`` began.

A callback that has no effect is never silent: the gateway's refusals (a 4xx such as ``stale-attempt``)
raise :class:`CallbackError`, and answers that changed nothing the worker asked for (``terminal-conflict``,
``not-running``, ...) raise :class:`CallbackIgnored` (:class:`TaskCancelled` when the task was cancelled:
its work is no longer wanted); both are :class:`WorkerError`, carrying the reason and the task. A
harmless repeat (the same progress or result again, a retried callback the gateway had already applied) is
not an error. ``start`` never adopts an attempt another worker began unless told to (``take_over=True``).

**Heartbeats.** On a task created with ``heartbeatMs``, the gateway tells the worker its lease in the
answer to ``start`` (and to every callback of the attempt). Inside ``async with Worker(...)`` the worker
then heartbeats in the background (``POST /v1/tasks/{id}/heartbeat``) at a third of the lease, unless a
callback renewed it more recently, until the attempt ends (its ``succeed`` or ``fail``, or the block's end).
When the gateway answers a heartbeat that the attempt is over (requeued after its lease ran out, started
again elsewhere, ended), the block's job is cancelled and the block raises :class:`AttemptOver`, or
:class:`TaskCancelled` when the task was cancelled (the ``409 not-running`` answer carries the task). The job
must leave the event loop free for this (blocking work in a thread: ``anyio.to_thread.run_sync``); a job
that blocks the loop cannot heartbeat, and its lease runs out as a vanished worker's does.

**A job that outlives its lease.** When the lease ran out while the job still ran (the gateway down or out
of reach longer than the lease, the worker's process stopped), the gateway has requeued the task
(``heartbeat-timeout``). Told so (a callback answered ``not-running``, a heartbeat ``409 not-running``),
a worker whose task is queued at its own attempt by that lease's end, no newer attempt started, takes it
back (:mod:`gateway.client.retake`): a new ``start`` as the next attempt, the progress it had reached
again, and the callback it was sending, as that attempt (with a new id: the old one was answered), logged
at WARNING; the job goes on and never sees it. A task that went on without the worker (a newer attempt
started, the lease ended its last attempt) is logged at ERROR with what is lost (the result, the failure,
the progress), and raised as before (:class:`AttemptOver`, :class:`CallbackIgnored`).

**Streams.** ``await worker.write(name, text)`` appends ``text`` to the task's stream ``name`` (protocol.md,
Streams: a model's tokens, a log's lines), buffered (:mod:`gateway.client.stream_out` decides): inside
``async with`` a background task sends a stream's buffer 50 ms after its oldest write; a buffer of 64 KiB
is sent by the write that filled it, which waits for its answer (so a job cannot write faster than the
gateway takes); outside the block a write sends what is due itself. ``flush()`` sends everything now, and
``succeed``/``fail`` flush before they report. A batch whose answer is lost is sent again with the same
``seq`` (the gateway appends it once). A write raises :class:`AttemptOver` (:class:`TaskCancelled`) once
the attempt is over, as a callback does; a batch the gateway refuses for good (``413 stream-full``, ``409
too-many-streams``) raises :class:`CallbackError` from the write or flush that learns it (a background
send's, from the next one). A worker that takes its task back sends what it had not had taken as the new
attempt's, whose text starts over (the gateway drops an earlier attempt's chunks).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

import anyio
import anyio.abc
import httpx

from gateway.client.backoff import Backoff
from gateway.client.errors import (
    AttemptOver,
    CallbackError,
    CallbackIgnored,
    TaskAlreadyRunning,
    TaskCancelled,
    WorkerError,
    cancelled,
    ignored,
)
from gateway.client.exchange import asend, tries
from gateway.client.merge_patch import MESSAGE, check_patch
from gateway.client.retake import TakeBack, WentOn, lost, outlived
from gateway.client.worker_streams import StreamWriting, refusal

__all__ = [
    "APPLIED",
    "HARMLESS",
    "AttemptOver",
    "CallbackError",
    "CallbackIgnored",
    "TaskAlreadyRunning",
    "TaskCancelled",
    "Worker",
]

log = logging.getLogger("gateway.client")

# Reasons of an answer that did what the callback asked (the transitions of protocol.md's task life).
APPLIED = frozenset({"started", "progress", "succeeded", "failed", "requeued"})
# Reasons of an answer that changed nothing because it had been done already: the same progress or the
# same result again, or a retry of a callback the gateway had applied (its first answer was lost).
HARMLESS = frozenset({"duplicate-progress", "duplicate-result", "duplicate-callback"})


# Below the gateway's idle timeout (GATEWAY_IDLE_TIMEOUT_MS, 5 s by default).
KEEPALIVE_S = 2.0
# The reasons of a fenced callback's answer that say the worker's attempt is over.
ATTEMPT_ENDED = frozenset({"not-running", "terminal-conflict", "expired"})
# The ``event_type`` of an error a heartbeat raises.
HEARTBEAT = "heartbeat"
# A heartbeat goes at this fraction of the lease after the lease's last renewal.
HEARTBEAT_FRACTION = 1 / 3


class Worker(StreamWriting):
    def __init__(
        self,
        base_url: str,
        task_id: str,
        callback_token: str,
        *,
        client: httpx.AsyncClient | None = None,
        retries: int = 8,
        timeout_s: float = 10.0,
        backoff: Backoff | None = None,
    ) -> None:
        self.task_id = task_id
        self.url = f"{base_url.rstrip('/')}/v1/tasks/{task_id}/callbacks"
        self.heartbeat_url = f"{base_url.rstrip('/')}/v1/tasks/{task_id}/heartbeat"
        self.streams_url = f"{base_url.rstrip('/')}/v1/tasks/{task_id}/streams"
        self.metadata_url = f"{base_url.rstrip('/')}/v1/tasks/{task_id}/metadata"
        self.headers = {"Authorization": f"Bearer {callback_token}"}
        # A pooled connection is not reused after KEEPALIVE_S idle: well before the gateway closes it
        # (GATEWAY_IDLE_TIMEOUT_MS, 5 s), so a callback is never sent on a connection being closed.
        self._client = client or httpx.AsyncClient(
            timeout=timeout_s, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S)
        )
        self._owns_client = client is None
        self.retries = retries
        self.backoff = backoff or Backoff(base_s=0.05, cap_s=2.0)
        self.attempt: int | None = None  # the attempt this worker's start began
        # The lease of that attempt, as the gateway last said: its length, and when (on anyio's clock) a
        # request that renewed it was sent.
        self.heartbeat_ms: int | None = None
        self._renewed_at = 0.0
        self._heartbeats: anyio.abc.TaskGroup | None = None  # inside ``async with``: where they run
        self._beating: anyio.CancelScope | None = None  # the heartbeat of the current attempt
        self._ending = False  # the attempt's last callback is on its way: a 409 to a heartbeat is expected
        # What a heartbeat learned (the attempt is over, or the task was cancelled); raised from the block.
        self._over: AttemptOver | TaskCancelled | None = None
        self._block: anyio.CancelScope | None = None  # around the block's job, which a heartbeat may cancel
        self._name: str | None = None  # the ``worker`` of its start, for a start that takes the task back
        self._reached: tuple[int, str] | None = None  # the attempt's last progress taken (value, cursor)
        self._retaking: anyio.Lock | None = None  # one take-back at a time (made in the event loop)
        self._init_streams()

    @property
    def heartbeating(self) -> bool:
        """Whether this worker heartbeats in the background now: its attempt runs, on a task with a lease,
        inside ``async with``."""
        return self._beating is not None

    @property
    def over(self) -> AttemptOver | TaskCancelled | None:
        """What the background heartbeat learned, once it has: the attempt is over, or the task was
        cancelled (what the ``async with`` block raises); else ``None``."""
        return self._over

    async def __aenter__(self) -> Worker:
        # The heartbeats' task group, then a scope of the block's own inside it: the block's exceptions
        # leave through that scope alone (never wrapped in an exception group), and a heartbeat that learns
        # the attempt is over cancels the job through it.
        self._heartbeats = anyio.create_task_group()
        await self._heartbeats.__aenter__()
        self._block = anyio.CancelScope().__enter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        unsent: BaseException | None = None  # what sending the job's last writes ran into
        if exc[0] is None and self._over is None and self._ended_by is None and self.attempt is not None:
            try:
                await self.flush()
            except (WorkerError, httpx.HTTPError) as failed:
                unsent = failed
        self._stop_heartbeat()
        self._stop_flushing()
        heartbeats, block = self._heartbeats, self._block
        self._heartbeats = self._block = None
        assert heartbeats is not None and block is not None
        try:
            cancelled_by_heartbeat = block.__exit__(*exc)  # swallows only its own cancellation
        finally:
            try:
                await heartbeats.__aexit__(None, None, None)  # the heartbeat, cancelled, has ended
            finally:
                if self._owns_client:
                    await self._client.aclose()
        if self._over is not None and (cancelled_by_heartbeat or exc[0] is None):
            raise self._over from None  # not from the job's cancellation, which it caused
        if unsent is not None:
            raise unsent

    async def start(self, worker: str, *, take_over: bool = False) -> dict[str, Any]:
        """Begin an attempt. On a task that is already running (``already-running``: another worker holds
        the same token, or an earlier run of this job is still going) raise :class:`TaskAlreadyRunning`,
        unless ``take_over`` is true: then this worker adopts the running attempt and fences its callbacks
        with it (the other worker's are refused from its next requeue on, not before)."""
        answer = await self.send({"type": "start", "worker": worker}, check=False)
        self._name, self._reached = worker, None
        reason, task = answer["reason"], answer["task"]
        if reason == "already-running" and not take_over:
            raise TaskAlreadyRunning("start", reason, task)
        # "duplicate-callback": this start was committed but its first answer was lost, so the task as it
        # is now tells the attempt it began. (Ambiguous only if, between the two, the attempt failed, was
        # requeued and was started again by another worker: the gateway does not keep the first answer.)
        if task["state"] == "running" and reason in ("started", "already-running", "duplicate-callback"):
            self.attempt = task["attempts"]
            self._start_heartbeat(self.attempt)
            return answer
        _check("start", answer)
        return answer

    async def progress(
        self, progress: int, cursor: str = "", *, callback_id: str | None = None
    ) -> dict[str, Any]:
        """Report progress (0 to 100, rising) of this worker's attempt. ``callback_id`` (here and on
        ``succeed``, ``fail``): the callback's id, for a caller that must send the same logical callback
        again from another process (a redelivered job); by default a fresh UUID, which this call's own
        retries reuse."""
        event = {"type": "progress", "progress": progress, "cursor": cursor}
        answer = await self.send(event, callback_id=callback_id, fenced=True)
        self._reached = (progress, cursor)
        return answer

    async def metadata(self, patch: Mapping[str, Any]) -> dict[str, Any]:
        """Merge ``patch`` into the task's metadata (RFC 7396: ``None`` removes a key; protocol.md,
        Metadata), as this worker's attempt; returns the answer (``{"task": ...}``, the task after it). As
        :meth:`progress`, it waits for its answer, so it goes after every callback before it and before the
        outcome; a lost answer is retried with the same body (a patch is idempotent). Raises ``ValueError``
        for a patch that is not a JSON object of at most 8 KiB, :class:`CallbackError` for one the gateway
        refuses (``413 metadata-too-large``: the metadata would pass 8 KiB), :class:`AttemptOver` /
        :class:`TaskCancelled` once the attempt is over (a worker that outlived its lease takes its task
        back first, and the patch goes as the new attempt's)."""
        checked = check_patch(patch)
        if self._over is not None:
            raise self._over
        if self._ended_by is not None:
            raise self._ended_by
        attempt = self.attempt
        if attempt is None:
            raise RuntimeError("metadata() before start(): this worker holds no attempt")
        try:
            body = {"attempt": attempt, "patch": checked}
            return await self._post(self.metadata_url, body, self.backoff, "metadata")
        except AttemptOver as over:
            if not await self._outlived(attempt, over.task, None):
                raise
        return await self.metadata(checked)  # as the attempt the task was taken back as

    async def message(self, text: str) -> dict[str, Any]:
        """The status line a person reads under the progress bar (``metadata.message``, protocol.md):
        :meth:`metadata` ``({"message": text})``."""
        return await self.metadata({MESSAGE: text})

    async def succeed(
        self, result_ref: str, result_hash: str, *, callback_id: str | None = None
    ) -> dict[str, Any]:
        event = {"type": "succeed", "resultRef": result_ref, "resultHash": result_hash}
        return await self._last(event, callback_id)

    async def fail(self, error: str, *, retryable: bool, callback_id: str | None = None) -> dict[str, Any]:
        return await self._last({"type": "fail", "error": error, "retryable": retryable}, callback_id)

    async def _last(self, event: dict[str, Any], callback_id: str | None) -> dict[str, Any]:
        """The attempt's last callback, after what the job wrote: its heartbeat stops once it is answered
        (or refused)."""
        if self.attempt is not None:
            await self.flush()
        self._ending = True
        try:
            return await self.send(event, callback_id=callback_id, fenced=True)
        finally:
            self._stop_heartbeat()

    async def send(
        self,
        event: dict[str, Any],
        *,
        callback_id: str | None = None,
        fenced: bool = False,
        check: bool = True,
    ) -> dict[str, Any]:
        """Post one logical callback, retrying transport failures, 5xx and 429 (after its Retry-After)
        with the same callback id.

        Returns the gateway's answer; raises :class:`CallbackError` on a 4xx and, unless ``check`` is
        false, :class:`CallbackIgnored` when the answer says the callback had no effect. A fenced callback
        answered that the attempt's lease ran out while this worker still ran takes the task back and is
        sent again as the next attempt (the module's docstring), with ``<id>@<attempt>`` as its id."""
        callback_id = callback_id or str(uuid.uuid4())
        attempt = self.attempt if fenced else None
        body: dict[str, Any] = {"callbackId": callback_id, "event": event}
        if attempt is not None:
            body["attempt"] = attempt
        try:
            result = await self._post(self.url, body, self.backoff, str(event.get("type")))
        except AttemptOver as over:  # 409 stale-attempt: another attempt has started since
            if attempt is None or not await self._outlived(attempt, over.task, event):
                raise
            return await self._resend(event, callback_id, check)
        if (
            attempt is not None
            and result.get("reason") in ATTEMPT_ENDED
            and await self._outlived(attempt, result.get("task"), event)
        ):
            return await self._resend(event, callback_id, check)
        if check:
            _check(str(event.get("type")), result)
        return result

    async def heartbeat(self) -> dict[str, Any]:
        """Renew the lease of this worker's attempt now (the background heartbeat does so by itself);
        returns ``{"leaseUntilMs", "heartbeatMs"}``. Raises :class:`AttemptOver` when the attempt is over,
        :class:`TaskCancelled` when it is over because the task was cancelled."""
        if self.attempt is None:
            raise RuntimeError("heartbeat() before start(): this worker holds no attempt")
        return await self._post(self.heartbeat_url, {"attempt": self.attempt}, Backoff(0.05, 2.0), HEARTBEAT)

    async def _post(self, url: str, body: dict[str, Any], backoff: Backoff, what: str) -> dict[str, Any]:
        """POST ``body`` (``what``: the event's type, or a heartbeat), retrying transport failures, 5xx and
        429 as :mod:`gateway.client.exchange` does; the answer's JSON, or :class:`CallbackError`
        (:class:`AttemptOver`) on a 4xx (:class:`TaskCancelled` for an attempt over because its task was
        cancelled). An answer that carries the lease counts as its renewal, from when the request was sent."""
        request = self._client.build_request("POST", url, json=body, headers=self.headers)
        sent = await asend(self._client, tries(request, retries=self.retries, backoff=backoff))
        if sent.response.status_code >= 300:
            raise refusal(sent.response, what, self.task_id)
        result: dict[str, Any] = sent.response.json()
        self._renewed(result, sent.sent_at)
        return result

    def _renewed(self, answer: dict[str, Any], sent_at: float) -> None:
        """An answer that carries the lease counts as its renewal, from when its request was sent."""
        if answer.get("heartbeatMs") is not None:
            self.heartbeat_ms = int(answer["heartbeatMs"])
            self._renewed_at = max(self._renewed_at, sent_at)

    # --- a job that outlives its lease ---------------------------------------------------------------------

    async def _resend(self, event: dict[str, Any], callback_id: str, check: bool) -> dict[str, Any]:
        """A callback the worker's old attempt could not make, as the attempt it took the task back as."""
        return await self.send(event, callback_id=f"{callback_id}@{self.attempt}", fenced=True, check=check)

    async def _outlived(
        self, attempt: int, task: dict[str, Any] | None, event: dict[str, Any] | None
    ) -> bool:
        """The gateway says ``attempt`` is over (``task``: as its answer carries it; ``event``: the callback
        it refused, ``None`` for a heartbeat). True when this worker now runs a newer attempt (it took the
        task back, here or in another of its calls), and what was refused is to be sent again as that one;
        false when the task went on without it (logged at ERROR, but for a cancel) or was cancelled."""
        if self._retaking is None:
            self._retaking = anyio.Lock()
        async with self._retaking:
            if self.attempt != attempt:  # taken back meanwhile (the heartbeat, or another callback)
                return self.attempt is not None
            if task is not None and cancelled(task):
                return False  # raised as TaskCancelled: the work is not wanted, nothing is lost
            verdict = outlived(task, attempt)
            if isinstance(verdict, TakeBack):
                assert self._name is not None  # an attempt is this worker's by its start
                answer = await self.send({"type": "start", "worker": self._name}, check=False)
                task = answer["task"]
                if task["state"] == "running" and answer["reason"] in ("started", "duplicate-callback"):
                    self.attempt = int(task["attempts"])
                    log.warning(
                        "task %s: the lease of attempt %s ran out while this worker still ran it (the "
                        "gateway requeued the task); took the task back as attempt %s",
                        self.task_id,
                        attempt,
                        self.attempt,
                    )
                    await self._again()
                    return True
                if cancelled(task):
                    return False
                verdict = outlived(task, attempt)
            why = verdict.why if isinstance(verdict, WentOn) else "it could not be started again"
            log.error("task %s went on without this worker (%s); lost: %s", self.task_id, why, lost(event))
            return False

    async def _again(self) -> None:
        """The progress the attempt taken back had reached, again (a start sets it to 0); an answer that
        it had no effect changes nothing here."""
        if self._reached is not None:
            value, cursor = self._reached
            body = {
                "callbackId": str(uuid.uuid4()),
                "attempt": self.attempt,
                "event": {"type": "progress", "progress": value, "cursor": cursor},
            }
            await self._post(self.url, body, self.backoff, "progress")

    # --- the background heartbeat -------------------------------------------------------------------------

    def _start_heartbeat(self, attempt: int) -> None:
        """Heartbeat for ``attempt`` while it runs, if its task has a lease and the block is entered."""
        self._stop_heartbeat()
        self._ending = False
        if self.heartbeat_ms is not None and self._heartbeats is not None:
            self._beating = anyio.CancelScope()
            self._heartbeats.start_soon(self._beat, attempt, self._beating)

    def _stop_heartbeat(self) -> None:
        if self._beating is not None:
            self._beating.cancel()
            self._beating = None

    async def _beat(self, attempt: int, scope: anyio.CancelScope) -> None:
        """Renew the lease a third of it after its last renewal (a callback's or a heartbeat's), until
        cancelled. Told the attempt is over, cancel the block (which raises it); a gateway that cannot be
        reached is tried again at the next beat (the lease may run out meanwhile: the next answer says so)."""
        backoff = Backoff(base_s=0.05, cap_s=2.0)
        with scope:
            while True:
                assert self.heartbeat_ms is not None
                due = self._renewed_at + self.heartbeat_ms / 1000 * HEARTBEAT_FRACTION
                if anyio.current_time() < due:
                    await anyio.sleep_until(due)
                    continue  # a callback may have renewed the lease meanwhile
                try:
                    await self._post(self.heartbeat_url, {"attempt": attempt}, backoff, HEARTBEAT)
                except (CallbackError, TaskCancelled) as exc:
                    if self._ending:  # the attempt's last callback ended it: nothing is wrong
                        return
                    if isinstance(exc, AttemptOver) and await self._outlived(attempt, exc.task, None):
                        assert self.attempt is not None
                        attempt = self.attempt  # taken back: the next heartbeats are the new attempt's
                        continue
                    self._over = exc if isinstance(exc, (AttemptOver, TaskCancelled)) else _over(exc)
                    if self._block is not None:
                        self._block.cancel()  # the job, in the block
                    return
                except httpx.HTTPError:
                    self._renewed_at = anyio.current_time()  # not renewed; try again a beat later


def _over(exc: CallbackError) -> AttemptOver:
    """A heartbeat refused for good (a 4xx other than the attempt's end, e.g. a token that expired): the
    lease cannot be held, so the attempt is as good as over."""
    return AttemptOver(exc.status, exc.code, f"heartbeats are refused: {exc}", task_id=exc.task_id)


def _check(event_type: str, answer: dict[str, Any]) -> None:
    """Raise :class:`CallbackIgnored` unless the answer applied the callback or harmlessly repeated it."""
    reason = answer.get("reason", "")
    if reason in APPLIED or reason in HARMLESS:
        return
    raise ignored(event_type, reason, answer.get("task") or {})
