"""A gateway whose PostgreSQL database stops answering answers ``503`` within its database deadline
(docs/deploy.md: "within ``GATEWAY_DB_DEADLINE_MS`` (10 s) plus about a second"; ``/readyz`` asks the
database for 3 s). Two checks, two kinds of partition:

**db-deadline**: in a frozen partition, a gateway answers within its database deadline.

``gateway serve`` with a 2 s deadline reaches its PostgreSQL database through a relay
(tests/support/pgrelay.py) that then freezes: nothing passes either way, nothing is closed. Callbacks keep
coming, one every tenth of the deadline, more batches than commit at once, plus a read and a create. Held
to: every one answered ``503`` within the deadline and 1 s of when it was sent (no rollback, commit or
wait for a batch's turn stacks another deadline on top).

**db-partition**: in a partition that swallows packets (the relay passes nothing and answers nothing, on
connections old and new), on the default deadline (10 s). A task started, then every route that reads or
writes the database at once: a read, its events, a callback, a create, a drain, and ``/readyz``. Held to:
each answered ``503``, within the deadline and 1 s; ``/readyz`` within its 3 s and 2 s (a readiness
probe's timeout must be above that).

The suite holds the behaviour without the bounds (tests/integration/test_unavailable.py: each answered 503,
none hangs, the warnings name a reason, the gateway recovers with nothing lost or written), through the
same requests (:func:`frozen`, :func:`blackholed`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import anyio
import httpx

from bench.checks.under_load import database
from bench.lib import harness
from bench.lib.verdict import Figure
from tests.support.pgrelay import Relay, relayed

DEADLINE_MS = 2_000
MARGIN_S = 1.0  # what the gateway documents for an answer past the deadline: tearing down, answering
TASKS = 8
# The default database deadline (GATEWAY_DB_DEADLINE_MS), which db-partition runs on, and /readyz's own:
# its ``SELECT 1`` is given 3 s (gateway/store/database.py), and a probe's answer 2 s more.
DEFAULT_DEADLINE_S = 10.0
PROBE_S = 3.0 + 2.0

Request = Callable[[], Awaitable[httpx.Response]]
Answer = tuple[str, httpx.Response, float]  # what was asked, its answer, seconds from its sending


async def timed(what: str, request: Request, within_s: float, answers: list[Answer]) -> None:
    """Send ``request`` and add its answer to ``answers``; ``TimeoutError`` saying ``what`` hung when it is
    unanswered after ``within_s``."""
    started = time.monotonic()
    try:
        with anyio.fail_after(within_s):
            answer = await request()
    except TimeoutError:
        raise TimeoutError(f"{what}: no answer within {within_s:.0f} s") from None
    answers.append((what, answer, time.monotonic() - started))


async def frozen(
    relay: Relay, deadline_s: float, callbacks: Mapping[str, Request], others: Mapping[str, Request]
) -> list[tuple[str, int, float]]:
    """Freeze ``relay``; send each of ``callbacks`` a tenth of the deadline after the one before, then each
    of ``others``; thaw once all are answered. Returns (what, status, seconds from its sending to its
    answer) for each, in the order answered; a request unanswered after 4 deadlines and 30 s fails."""
    answers: list[Answer] = []
    within_s = 4 * deadline_s + 30  # an answer, not a hang
    relay.freeze()
    try:
        async with anyio.create_task_group() as tg:
            # One callback every tenth of the deadline: batches pile up behind the ones stuck committing.
            for what, request in callbacks.items():
                tg.start_soon(timed, what, request, within_s, answers)
                await anyio.sleep(deadline_s / 10)
            for what, request in others.items():
                tg.start_soon(timed, what, request, within_s, answers)
    finally:
        relay.thaw()
    return [(what, answer.status_code, took) for what, answer, took in answers]


async def blackholed(relay: Relay, requests: Mapping[str, Request], within_s: float) -> list[Answer]:
    """Every one of ``requests`` at once while ``relay`` swallows what passes (a partition: nothing refused,
    nothing answered); each answer, in the order answered. A request unanswered after ``within_s`` fails.
    The partition is healed afterwards: what was swallowed is lost, so the stalled connections are dropped
    too."""
    answers: list[Answer] = []
    relay.blackhole()
    try:
        async with anyio.create_task_group() as tg:
            for what, request in requests.items():
                tg.start_soon(timed, what, request, within_s, answers)
    finally:
        await relay.refuse()
        await relay.up()
    return answers


def start(client: httpx.AsyncClient, task_id: str, token: str) -> Request:
    """A ``start`` callback of ``task_id``, to send when asked."""
    body = {"event": {"type": "start", "worker": "w1"}}
    headers = {"Authorization": f"Bearer {token}"}
    return lambda: client.post(f"/v1/tasks/{task_id}/callbacks", json=body, headers=headers)


def every_route(
    client: httpx.AsyncClient, task_id: str, token: str, callback: Mapping[str, object]
) -> dict[str, Request]:
    """A request to each route that asks the database, to send when asked: ``/readyz``, a read of
    ``task_id`` and of its events, ``callback`` on it (with its callback ``token``), a create (of ``new``),
    a drain."""
    headers = {"Authorization": f"Bearer {token}"}
    return {
        "readyz": lambda: client.get("/readyz"),
        "get": lambda: client.get(f"/v1/tasks/{task_id}"),
        "events": lambda: client.get(f"/v1/tasks/{task_id}/events", params={"cursor": 0}),
        "callback": lambda: client.post(f"/v1/tasks/{task_id}/callbacks", json=callback, headers=headers),
        "create": lambda: client.post("/v1/tasks", json={"id": "new", "ttlMs": 60_000, "maxAttempts": 1}),
        "drain": lambda: client.post("/v1/notifications/drain"),
    }


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
    return answered_within(
        "db-deadline (PostgreSQL)",
        answers,
        f"slowest answer ({DEADLINE_MS} ms deadline)",
        deadline_s + MARGIN_S,
    )


def answered_within(
    check: str, answers: Sequence[tuple[str, int, float]], slowest: str, limit_s: float, apart: str = ""
) -> list[Figure]:
    """A partition's figures: the ``answers`` (what, status, seconds) other than 503, none; the slowest of
    them but ``apart`` (held to a bound of its own) within ``limit_s``."""
    detail = ", ".join(f"{what} {status} in {took:.2f} s" for what, status, took in answers)
    return [
        Figure(
            check,
            "answers other than 503",
            sum(status != 503 for _, status, _ in answers),
            "",
            0,
            detail=detail,
        ),
        Figure(
            check,
            slowest,
            max(took for what, _, took in answers if what != apart),
            "s",
            limit_s,
            digits=2,
            detail=detail,
        ),
    ]


async def partition() -> list[Figure]:
    within_s = DEFAULT_DEADLINE_S + 60  # an answer, not a hang
    async with (
        database("postgresql") as url,
        relayed(str(url)) as (relay, through),
        harness.gateway(through) as gw,
        httpx.AsyncClient(base_url=gw.http, timeout=within_s + 10) as client,
    ):
        body = {"id": "kept", "ttlMs": 600_000, "maxAttempts": 2}
        made = (await client.post("/v1/tasks", json=body)).raise_for_status().json()
        token = made["callbackToken"]
        (await start(client, "kept", token)()).raise_for_status()
        progress = {"event": {"type": "progress", "progress": 40, "cursor": "r40"}}
        answers = await blackholed(relay, every_route(client, "kept", token, progress), within_s)
    statuses = [(what, answer.status_code, took) for what, answer, took in answers]
    check = "db-partition (PostgreSQL)"
    slowest = f"slowest answer but /readyz's ({DEFAULT_DEADLINE_S:.0f} s deadline)"
    (readyz_s,) = [took for what, _, took in statuses if what == "readyz"]
    return [
        *answered_within(check, statuses, slowest, DEFAULT_DEADLINE_S + MARGIN_S, apart="readyz"),
        Figure(check, "/readyz answered after (its 3 s ping)", readyz_s, "s", PROBE_S, digits=2),
    ]
