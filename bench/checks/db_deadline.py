"""**db-deadline**: in a frozen partition, a gateway answers within its database deadline
(docs/configuration.md: "within about a second" past ``GATEWAY_DB_DEADLINE_MS``), on PostgreSQL.

``gateway serve`` with a 2 s deadline reaches its PostgreSQL database through a relay
(tests/support/pgrelay.py) that then freezes: nothing passes either way, nothing is closed. Callbacks keep
coming, one every tenth of the deadline, more batches than commit at once, plus a read and a create. Held
to: every one answered ``503`` within the deadline and 1 s of when it was sent (no rollback, commit or
wait for a batch's turn stacks another deadline on top).

The suite holds the behaviour without the bound (tests/integration/test_unavailable.py: each answered 503,
none hangs, the warnings name a reason, the gateway recovers with nothing lost or written).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping

import anyio
import httpx

from bench.checks.under_load import database
from bench.lib import harness
from bench.lib.verdict import Figure
from tests.support.pgrelay import Relay, relayed

DEADLINE_MS = 2_000
MARGIN_S = 1.0  # what the gateway documents for an answer past the deadline: tearing down, answering
TASKS = 8

Request = Callable[[], Awaitable[httpx.Response]]


async def frozen(
    relay: Relay, deadline_s: float, callbacks: Mapping[str, Request], others: Mapping[str, Request]
) -> list[tuple[str, int, float]]:
    """Freeze ``relay``; send each of ``callbacks`` a tenth of the deadline after the one before, then each
    of ``others``; thaw once all are answered. Returns (what, status, seconds from its sending to its
    answer) for each, in the order answered; a request unanswered after 4 deadlines and 30 s fails."""
    answers: list[tuple[str, int, float]] = []

    async def timed_answer(what: str, request: Request) -> None:
        started = time.monotonic()
        with anyio.fail_after(4 * deadline_s + 30):  # an answer, not a hang
            answer = await request()
        answers.append((what, answer.status_code, time.monotonic() - started))

    relay.freeze()
    try:
        async with anyio.create_task_group() as tg:
            # One callback every tenth of the deadline: batches pile up behind the ones stuck committing.
            for what, request in callbacks.items():
                tg.start_soon(timed_answer, what, request)
                await anyio.sleep(deadline_s / 10)
            for what, request in others.items():
                tg.start_soon(timed_answer, what, request)
    finally:
        relay.thaw()
    return answers


def start(client: httpx.AsyncClient, task_id: str, token: str) -> Request:
    """A ``start`` callback of ``task_id``, to send when asked."""
    body = {"event": {"type": "start", "worker": "w1"}}
    headers = {"Authorization": f"Bearer {token}"}
    return lambda: client.post(f"/v1/tasks/{task_id}/callbacks", json=body, headers=headers)


async def answered() -> list[Figure]:
    deadline_s = DEADLINE_MS / 1000
    env = {"GATEWAY_DB_DEADLINE_MS": str(DEADLINE_MS)}
    async with (
        database("postgresql") as url,
        relayed(str(url)) as (relay, through),
        harness.gateway(through, env=env) as gw,
        httpx.AsyncClient(base_url=gw.http, timeout=4 * deadline_s + 30) as client,
    ):
        callbacks = {}
        for i in range(TASKS):
            body = {"id": f"f{i}", "ttlMs": 600_000, "maxAttempts": 1}
            made = (await client.post("/v1/tasks", json=body)).raise_for_status().json()
            callbacks[f"callback f{i}"] = start(client, f"f{i}", made["callbackToken"])
        others: dict[str, Request] = {
            "read": lambda: client.get("/v1/tasks/f0"),
            "create": lambda: client.post("/v1/tasks", json={"id": "new", "ttlMs": 60_000, "maxAttempts": 1}),
        }
        answers = await frozen(relay, deadline_s, callbacks, others)
    check = "db-deadline (PostgreSQL)"
    detail = ", ".join(f"{what} {status} in {took:.2f} s" for what, status, took in answers)
    return [
        Figure(
            check,
            "answers other than 503",
            sum(1 for _, status, _ in answers if status != 503),
            "",
            0,
            detail=detail,
        ),
        Figure(
            check,
            f"slowest answer ({DEADLINE_MS} ms deadline)",
            max(took for _, _, took in answers),
            "s",
            deadline_s + MARGIN_S,
            digits=2,
            detail=detail,
        ),
    ]
