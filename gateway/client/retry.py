"""When a request to the gateway is sent again, and after how long: the one rule of every Python client,
pure. ``exchange.tries`` applies it for the ``Worker`` and the backends, the queue integrations' sender
(``gateway.integrations.outbox``) for every report, cancel and create it sends.

Sent again: a request that got no answer (refused, reset, timed out), and one answered with a 5xx or a 429;
any other answer, a 4xx included, is the answer. Before the next try the client waits: exponential backoff
with full jitter (:class:`~gateway.client.backoff.Backoff`), and at least what the answer's ``Retry-After``
says (the gateway sends it, in whole seconds, with a 429 and a 503; the HTTP-date form is not the
gateway's, and is read as no header at all). Every try sends the same request: the same callback id or
``Idempotency-Key``, so that a try whose answer was lost changes nothing twice.
"""

from __future__ import annotations

from gateway.client.backoff import Backoff


def retried(status: int) -> bool:
    """Whether an answer with this status is tried again: a 5xx (the gateway, or a proxy before it, could
    not answer now) or a 429 (too many callbacks for this task: later)."""
    return status >= 500 or status == 429


def retry_after_s(value: str | None) -> float | None:
    """The delay a ``Retry-After`` header asks for, in seconds; ``None`` without one (or a date)."""
    value = (value or "").strip()
    return float(value) if value.isdigit() else None


def pause_s(backoff: Backoff, retry_after: str | None = None) -> float:
    """How long to wait before the next try: the backoff's next delay (it counts the failure), and at
    least the answer's ``Retry-After``."""
    delay = backoff.next_delay()
    asked = retry_after_s(retry_after)
    return delay if asked is None else max(asked, delay)
