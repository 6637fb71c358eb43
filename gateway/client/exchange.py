"""One HTTP request to the gateway, retried until it is answered: the retry decisions once, sans I/O, and
the two small drivers that send for them (``asend`` on an ``httpx.AsyncClient``, ``send`` on an
``httpx.Client``). ``Worker``, ``AsyncBackend`` and ``Backend`` all post through here, so what is retried
and how long to wait is decided in one place.

What is retried, and after how long, is :mod:`gateway.client.retry`'s rule (the integrations' sender
keeps it too): a transport failure (no answer: refused, reset, timed out), a 5xx and a 429 (after its
``Retry-After``), with exponential backoff and full jitter, here up to ``retries`` times. Every try sends
the same request (the same callback id or ``Idempotency-Key``): only requests that are safe to repeat come
here. Any other answer, a 4xx included, is returned for the caller to read (:func:`problem` reads an
error's body).
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from gateway.client.backoff import Backoff
from gateway.client.retry import pause_s, retried


@dataclass(frozen=True)
class Pause:
    """Wait this long before the next try."""

    seconds: float


@dataclass(frozen=True)
class Sent:
    """The answer, and when (on the driver's clock: anyio's, or ``time.monotonic``) the try it answers was
    sent: the worker counts a lease renewed from then."""

    response: httpx.Response
    sent_at: float


# A try: the driver sends the request and sends back its answer, or throws the transport error in; a pause.
Steps = Generator[httpx.Request | Pause, httpx.Response | None, httpx.Response]


def tries(request: httpx.Request, *, retries: int, backoff: Backoff) -> Steps:
    """The tries of ``request``: yields it (or a :class:`Pause`) until an answer that is not to be retried
    comes back, and returns that answer. Past ``retries`` retries the last failure is raised: the transport
    error, or ``httpx.HTTPStatusError`` for a 5xx or 429."""
    backoff.reset()
    for attempt in range(retries + 1):
        try:
            response = yield request
        except httpx.TransportError:
            if attempt == retries:
                raise
        else:
            assert response is not None
            if not retried(response.status_code):
                return response
            if attempt == retries:
                response.raise_for_status()
            # 429 (too many callbacks for this task) and 503 say when, in Retry-After.
            yield Pause(pause_s(backoff, response.headers.get("retry-after")))
            continue
        yield Pause(pause_s(backoff))
    raise AssertionError("unreachable")


async def asend(client: httpx.AsyncClient, steps: Steps) -> Sent:
    """Drive ``steps`` on ``client``."""
    step, sent_at = next(steps), anyio.current_time()
    while True:
        try:
            if isinstance(step, Pause):
                await anyio.sleep(step.seconds)
                step = steps.send(None)
                continue
            sent_at = anyio.current_time()
            try:
                response = await client.send(step)
            except httpx.TransportError as exc:
                step = steps.throw(exc)
            else:
                step = steps.send(response)
        except StopIteration as done:
            return Sent(done.value, sent_at)


def send(client: httpx.Client, steps: Steps) -> Sent:
    """Drive ``steps`` on ``client``, blocking this thread."""
    step, sent_at = next(steps), time.monotonic()
    while True:
        try:
            if isinstance(step, Pause):
                time.sleep(step.seconds)  # the backoff itself, not a wait for a condition
                step = steps.send(None)
                continue
            sent_at = time.monotonic()
            try:
                step = steps.send(client.send(step))
            except httpx.TransportError as exc:
                step = steps.throw(exc)
        except StopIteration as done:
            return Sent(done.value, sent_at)


@dataclass(frozen=True)
class Problem:
    """An error answer's body (protocol.md, Errors): its code and message, and the task a ``409
    not-running`` carries beside them (else ``None``)."""

    code: str
    message: str
    task: dict[str, Any] | None


def problem(response: httpx.Response) -> Problem:
    """Read an error answer; one that is not the gateway's JSON (a proxy's page, say) is ``http-<status>``
    with the start of its text."""
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"code": f"http-{response.status_code}", "message": response.text[:200]}}
    body = body if isinstance(body, dict) else {}
    error, task = body.get("error"), body.get("task")
    error = error if isinstance(error, dict) else {}
    task = task if isinstance(task, dict) else None
    return Problem(str(error.get("code", "")), str(error.get("message", "")), task)
