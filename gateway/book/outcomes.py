"""What goes into the book and what comes out of it: a worker's callback (or heartbeat) to apply, its
outcome, a delivery's receipt."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.lease import Lease
from gateway.machine import Event, Transition
from gateway.store.base import Receipt
from gateway.streams import Append, Appended


@dataclass(frozen=True, slots=True)
class CallbackOutcome:
    transition: Transition
    duplicate_callback: bool
    # The attempt's lease after the callback, while the task runs (``gateway.lease``); else None.
    lease: Lease | None = None
    # A stream append's answer (``gateway.streams``), for an append.
    appended: Appended | None = None


@dataclass(frozen=True, slots=True)
class CallbackRequest:
    """One worker callback to apply: its event is made with the gateway's time once the task is locked.
    Without an event, a heartbeat, or with ``append`` a stream append: it renews the running attempt's
    lease and adds no entry."""

    task_id: str
    make_event: Callable[[int], Event] | None
    callback_id: str | None = None
    digest: str = ""
    attempt: int | None = None
    append: Append | None = None


@dataclass(frozen=True, slots=True)
class Delivery:
    ok: bool
    duplicate: bool
    reason: str
    receipt: Receipt
