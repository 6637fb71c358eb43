"""``Worker``: the job's side. Posts callbacks with a stable ``callbackId`` per logical callback, so a
retry after a timeout, a dropped connection or a 5xx is recognised by the gateway and changes nothing
twice; fences ``progress``/``succeed``/``fail`` with the attempt its ``start`` began.
"""

from __future__ import annotations

import uuid
from typing import Any

import anyio
import httpx

from gateway.client.backoff import Backoff


class CallbackError(Exception):
    """The gateway refused the callback (a 4xx): retrying the same callback would not help."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code


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
        self.url = f"{base_url.rstrip('/')}/v1/tasks/{task_id}/callbacks"
        self.headers = {"Authorization": f"Bearer {callback_token}"}
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._owns_client = client is None
        self.retries = retries
        self.backoff = backoff or Backoff(base_s=0.05, cap_s=2.0)
        self.attempt: int | None = None  # the attempt this worker's start began

    async def __aenter__(self) -> Worker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def start(self, worker: str) -> dict[str, Any]:
        answer = await self.send({"type": "start", "worker": worker})
        # "duplicate-callback": this start was committed but its first answer was lost, so the task as it
        # is now tells the attempt it began. (Ambiguous only if, between the two, the attempt failed, was
        # requeued and was started again by another worker: the gateway does not keep the first answer.)
        running = answer["task"]["state"] == "running"
        if running and answer["reason"] in ("started", "already-running", "duplicate-callback"):
            self.attempt = answer["task"]["attempts"]
        return answer

    async def progress(self, progress: int, cursor: str = "") -> dict[str, Any]:
        return await self.send({"type": "progress", "progress": progress, "cursor": cursor}, fenced=True)

    async def succeed(self, result_ref: str, result_hash: str) -> dict[str, Any]:
        event = {"type": "succeed", "resultRef": result_ref, "resultHash": result_hash}
        return await self.send(event, fenced=True)

    async def fail(self, error: str, *, retryable: bool) -> dict[str, Any]:
        return await self.send({"type": "fail", "error": error, "retryable": retryable}, fenced=True)

    async def send(
        self, event: dict[str, Any], *, callback_id: str | None = None, fenced: bool = False
    ) -> dict[str, Any]:
        """Post one logical callback, retrying transport failures and 5xx with the same callback id."""
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
                    return result
                if response.status_code < 500:
                    error = response.json().get("error", {})
                    raise CallbackError(response.status_code, error.get("code", ""), error.get("message", ""))
                if attempt == self.retries:
                    response.raise_for_status()
            await anyio.sleep(self.backoff.next_delay())
        raise AssertionError("unreachable")
