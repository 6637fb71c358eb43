"""``Worker``: the job's side. Posts callbacks with a stable ``callbackId`` per logical callback, so a
retry after a timeout, a dropped connection or a 5xx is recognised by the gateway and changes nothing
twice; fences ``progress``/``succeed``/``fail`` with the attempt its ``start`` began.

A callback that has no effect is never silent: the gateway's refusals (a 4xx such as ``stale-attempt``)
raise :class:`CallbackError`, and answers that changed nothing the worker asked for (``terminal-conflict``,
``not-running``, ...) raise :class:`CallbackIgnored` (:class:`TaskCancelled` when the task was cancelled:
its work is no longer wanted); both are :class:`WorkerError`, carrying the reason and the task. A
harmless repeat (the same progress or result again, a retried callback the gateway had already applied) is
not an error. ``start`` never adopts an attempt another worker began unless told to (``take_over=True``).
"""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import httpx

from gateway.client.backoff import Backoff
from gateway.client.errors import CallbackError, CallbackIgnored, TaskAlreadyRunning, TaskCancelled, ignored

__all__ = [
    "APPLIED",
    "HARMLESS",
    "CallbackError",
    "CallbackIgnored",
    "TaskAlreadyRunning",
    "TaskCancelled",
    "Worker",
]

# Reasons of an answer that did what the callback asked (the reference's transitions).
APPLIED = frozenset({"started", "progress", "succeeded", "failed", "requeued"})
# Reasons of an answer that changed nothing because it had been done already: the same progress or the
# same result again, or a retry of a callback the gateway had applied (its first answer was lost).
HARMLESS = frozenset({"duplicate-progress", "duplicate-result", "duplicate-callback"})


# Below the gateway's idle timeout (GATEWAY_IDLE_TIMEOUT_MS, 5 s by default).
KEEPALIVE_S = 2.0


class Worker:
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

    async def __aenter__(self) -> Worker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def start(self, worker: str, *, take_over: bool = False) -> dict[str, Any]:
        """Begin an attempt. On a task that is already running (``already-running``: another worker holds
        the same token, or an earlier run of this job is still going) raise :class:`TaskAlreadyRunning`,
        unless ``take_over`` is true: then this worker adopts the running attempt and fences its callbacks
        with it (the other worker's are refused from its next requeue on, not before)."""
        answer = await self.send({"type": "start", "worker": worker}, check=False)
        reason, task = answer["reason"], answer["task"]
        if reason == "already-running" and not take_over:
            raise TaskAlreadyRunning("start", reason, task)
        # "duplicate-callback": this start was committed but its first answer was lost, so the task as it
        # is now tells the attempt it began. (Ambiguous only if, between the two, the attempt failed, was
        # requeued and was started again by another worker: the gateway does not keep the first answer.)
        if task["state"] == "running" and reason in ("started", "already-running", "duplicate-callback"):
            self.attempt = task["attempts"]
            return answer
        _check("start", answer)
        return answer

    async def progress(self, progress: int, cursor: str = "") -> dict[str, Any]:
        return await self.send({"type": "progress", "progress": progress, "cursor": cursor}, fenced=True)

    async def succeed(self, result_ref: str, result_hash: str) -> dict[str, Any]:
        event = {"type": "succeed", "resultRef": result_ref, "resultHash": result_hash}
        return await self.send(event, fenced=True)

    async def fail(self, error: str, *, retryable: bool) -> dict[str, Any]:
        return await self.send({"type": "fail", "error": error, "retryable": retryable}, fenced=True)

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
        false, :class:`CallbackIgnored` when the answer says the callback had no effect."""
        body: dict[str, Any] = {"callbackId": callback_id or str(uuid.uuid4()), "event": event}
        if fenced and self.attempt is not None:
            body["attempt"] = self.attempt
        self.backoff.reset()
        for attempt in range(self.retries + 1):
            try:
                response = await self._client.post(self.url, json=body, headers=self.headers)
            except httpx.TransportError:
                if attempt == self.retries:
                    raise
            else:
                if response.status_code < 300:
                    result: dict[str, Any] = response.json()
                    if check:
                        _check(str(event.get("type")), result)
                    return result
                if response.status_code < 500 and response.status_code != 429:
                    error = _error_of(response)
                    raise CallbackError(
                        response.status_code,
                        error.get("code", ""),
                        error.get("message", ""),
                        task_id=self.task_id,
                    )
                if attempt == self.retries:
                    response.raise_for_status()
                retry_after = response.headers.get("retry-after", "")
                if retry_after.isdigit():  # 429 (too many callbacks for this task) and 503 say when
                    await anyio.sleep(max(int(retry_after), self.backoff.next_delay()))
                    continue
            await anyio.sleep(self.backoff.next_delay())
        raise AssertionError("unreachable")


def _check(event_type: str, answer: dict[str, Any]) -> None:
    """Raise :class:`CallbackIgnored` unless the answer applied the callback or harmlessly repeated it."""
    reason = answer.get("reason", "")
    if reason in APPLIED or reason in HARMLESS:
        return
    raise ignored(event_type, reason, answer.get("task") or {})


def _error_of(response: httpx.Response) -> dict[str, str]:
    try:
        error = response.json().get("error", {})
    except ValueError:  # not JSON: a proxy's page, say
        return {"code": f"http-{response.status_code}", "message": response.text[:200]}
    return error if isinstance(error, dict) else {}
