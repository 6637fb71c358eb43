"""A gateway whose PostgreSQL database becomes unreachable answers ``503 unavailable`` with ``Retry-After``
(protocol.md: never a 500, never a hang), writes nothing, and recovers by itself once the database is back.

Two honest ways to lose the database, both from outside the gateway:

- the database refuses connections: ``ALTER DATABASE ... ALLOW_CONNECTIONS false`` and every open
  connection terminated (what an administrator, a failover or a restart does to a pool);
- the network path goes away: the gateway reaches PostgreSQL through a TCP relay in the test, which stops
  listening (connection refused) or swallows traffic without answering (a partition).

Every request is bounded in time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import httpx
import pytest

from bench.checks.db_deadline import blackholed, every_route, frozen, start
from tests.support import STEP_S, Running, bearer, eventually, pg_admin, postgres_database, running_gateway
from tests.support.pgrelay import Relay, relayed

pytestmark = pytest.mark.postgres

# How long one request may take while the database is down: an answer, not a hang.
REQUEST_BOUND_S = 10.0
# A partition swallows packets without an error: only the gateway's deadline on a database operation
# (10 s by default; 2 s in these tests, PARTITION_DEADLINE_MS) ends the wait, a step after it is a hang. How
# soon each is answered (within the deadline and a second; /readyz within its 3 s and 2 s) is no test, a
# loaded machine can miss it: it is the bench check ``db-partition`` (bench/checks/db_deadline.py), whose
# requests these are.
PARTITION_DEADLINE_MS = 2_000
PARTITION_WAIT_S = PARTITION_DEADLINE_MS / 1000 + STEP_S
# How long the gateway may take to notice that the database is back.
RECOVERY_BOUND_S = 20.0


# --- the database refuses connections -----------------------------------------------------------------------


def _database_name(url: str) -> str:
    return url.rsplit("/", 1)[1]


async def allow_connections(name: str, allowed: bool) -> None:
    await pg_admin(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {"true" if allowed else "false"}')
    if not allowed:
        await pg_admin(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )


@pytest.fixture
def pg_url() -> Iterator[str]:
    with postgres_database() as url:
        try:
            yield url
        finally:
            # Whatever the test did, let connections in again before the database is dropped.
            asyncio.run(allow_connections(_database_name(url), True))


# --- the network path goes away -----------------------------------------------------------------------------


# --- the checks --------------------------------------------------------------------------------------------


Request = Callable[[], Awaitable[httpx.Response]]


async def timed(request: Request) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    with anyio.fail_after(REQUEST_BOUND_S):
        answer = await request()
    return answer, time.monotonic() - started


def problems(answer: httpx.Response, what: str) -> list[str]:
    """Why ``answer`` is not a proper ``503 unavailable`` (empty when it is)."""
    found: list[str] = []
    if answer.status_code != 503:
        found.append(f"{what}: status {answer.status_code}: {answer.text[:200]}")
        return found
    if answer.json().get("error", {}).get("code") != "unavailable":
        found.append(f"{what}: body {answer.text[:200]}")
    retry_after = answer.headers.get("retry-after")
    if retry_after is None or not retry_after.isdigit() or int(retry_after) < 1:
        found.append(f"{what}: Retry-After {retry_after!r}")
    return found


class Scenario:
    """A task with a history, the requests to try while the database is down, and the checks after."""

    def __init__(self, gw: Running) -> None:
        self.gw = gw
        self.progress = {"callbackId": "p-40", "event": {"type": "progress", "progress": 40, "cursor": "r40"}}
        self.token = ""
        self.cb: dict[str, str] = {}
        self.before_task: dict[str, Any] = {}
        self.before_events: dict[str, Any] = {}

    async def prepare(self) -> None:
        client = self.gw.client
        made = (
            await client.post("/v1/tasks", json={"id": "kept", "ttlMs": 600_000, "maxAttempts": 2})
        ).json()
        self.token = made["callbackToken"]
        self.cb = bearer(self.token)
        answer = await client.post(
            "/v1/tasks/kept/callbacks", json={"event": {"type": "start", "worker": "w1"}}, headers=self.cb
        )
        assert answer.status_code == 200, answer.text
        self.before_task = (await client.get("/v1/tasks/kept")).json()
        self.before_events = (await client.get("/v1/tasks/kept/events", params={"cursor": 0})).json()
        assert (await client.get("/readyz")).status_code == 200

    def requests(self) -> dict[str, Request]:
        return every_route(self.gw.client, "kept", self.token, self.progress)

    async def while_down(self, rounds: int = 3, concurrent: int = 30) -> tuple[list[str], float]:
        """Every request, several rounds (the first meets the pool's dead connections, the later ones a
        database that cannot be reached), then many callbacks at once; returns what was wrong and the
        slowest answer."""
        found: list[str] = []
        slowest = 0.0
        for _ in range(rounds):
            for what, request in self.requests().items():
                answer, took = await timed(request)
                slowest = max(slowest, took)
                found += problems(answer, what)
        answers: list[tuple[httpx.Response, float]] = []

        async def one() -> None:
            answers.append(await timed(self.requests()["callback"]))

        async with anyio.create_task_group() as tg:
            for _ in range(concurrent):
                tg.start_soon(one)
        for answer, took in answers:
            slowest = max(slowest, took)
            found += problems(answer, "concurrent callback")
        health = await self.gw.client.get("/healthz")
        assert health.status_code == 200, "the process itself stays alive"
        return found, slowest

    async def recovered(self) -> float:
        """Wait (bounded) until ready again; then check that nothing was lost or written meanwhile."""
        client = self.gw.client
        started = time.monotonic()
        with anyio.fail_after(RECOVERY_BOUND_S):
            while (await client.get("/readyz")).status_code != 200:  # noqa: ASYNC110  (polling the server)
                await anyio.sleep(0.05)
        took = time.monotonic() - started
        assert (await client.get("/v1/tasks/kept")).json() == self.before_task
        assert (await client.get("/v1/tasks/kept/events", params={"cursor": 0})).json() == self.before_events
        assert (await client.get("/v1/tasks/new")).status_code == 404, "a create that failed wrote nothing"
        # The callback that failed was not recorded: its id is new, and it applies now.
        answer = await client.post("/v1/tasks/kept/callbacks", json=self.progress, headers=self.cb)
        assert answer.status_code == 200, answer.text
        assert answer.json()["duplicateCallback"] is False and answer.json()["changed"] is True
        assert answer.json()["task"]["version"] == self.before_task["version"] + 1
        created = await client.post("/v1/tasks", json={"id": "new", "ttlMs": 60_000, "maxAttempts": 1})
        assert created.status_code == 201, created.text
        assert (await client.post("/v1/notifications/drain")).status_code == 200
        return took


# --- the tests ----------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_database_refusing_connections_answers_503(pg_url: str, record_property: Any) -> None:
    name = _database_name(pg_url)
    async with running_gateway(pg_url) as gw:
        scenario = Scenario(gw)
        await scenario.prepare()
        await allow_connections(name, False)
        try:
            found, slowest = await scenario.while_down()
        finally:
            await allow_connections(name, True)
        record_property("slowest_answer_while_down_s", round(slowest, 3))
        recovered = await scenario.recovered()
        record_property("recovered_s", round(recovered, 3))
        print(f"\nrefusing database: slowest answer {slowest:.3f}s, ready again after {recovered:.3f}s")
        assert found == []


@pytest.mark.anyio
async def test_database_refusing_connections_recovers_without_loss(pg_url: str) -> None:
    """The half of the scenario above that holds today: answers stay bounded, no 2xx while down, and the
    gateway recovers with nothing lost or written."""
    name = _database_name(pg_url)
    async with running_gateway(pg_url) as gw:
        scenario = Scenario(gw)
        await scenario.prepare()
        await allow_connections(name, False)
        try:
            found, _ = await scenario.while_down(rounds=2, concurrent=10)
        finally:
            await allow_connections(name, True)
        assert all(" status 2" not in f for f in found), found
        await scenario.recovered()


@pytest.mark.anyio
async def test_network_refused_answers_503_and_recovers(pg_url: str, record_property: Any) -> None:
    async with relayed(pg_url) as (relay, url), running_gateway(url) as gw:
        scenario = Scenario(gw)
        await scenario.prepare()
        await relay.refuse()
        try:
            found, slowest = await scenario.while_down()
        finally:
            await relay.up()
        recovered = await scenario.recovered()
        record_property("slowest_answer_while_down_s", round(slowest, 3))
        record_property("recovered_s", round(recovered, 3))
        print(f"\nconnection refused: slowest answer {slowest:.3f}s, ready again after {recovered:.3f}s")
        assert found == []


async def partitioned(scenario: Scenario, relay: Relay, names: list[str]) -> list[str]:
    """The named requests, all at once while the network path is swallowing traffic (healed afterwards):
    what was wrong with each answer (empty when each was a proper 503)."""
    requests = {what: request for what, request in scenario.requests().items() if what in names}
    answers = await blackholed(relay, requests, PARTITION_WAIT_S)
    for what, answer, took in answers:
        print(f"\npartition: {what} answered {answer.status_code} in {took:.1f}s")
    assert sorted(what for what, _, _ in answers) == sorted(names)
    return [problem for what, answer, _ in answers for problem in problems(answer, what)]


@pytest.mark.anyio
async def test_network_partition_answers_503(pg_url: str) -> None:
    """A partition (packets swallowed, nothing refused) gives no error to react to: only a deadline ends
    the wait. The gateway abandons a database operation at its deadline (``GATEWAY_DB_DEADLINE_MS``, 10 s)
    and answers 503 (here at 2 s: the default's own figure is the bench check's)."""
    async with (
        relayed(pg_url) as (relay, url),
        running_gateway(url, db_deadline_ms=PARTITION_DEADLINE_MS) as gw,
    ):
        gw.client.timeout = httpx.Timeout(PARTITION_WAIT_S + 10)
        scenario = Scenario(gw)
        await scenario.prepare()
        found = await partitioned(scenario, relay, ["get", "events", "callback", "create", "drain"])
        await scenario.recovered()
        assert found == []


@pytest.mark.anyio
async def test_readyz_answers_503_during_a_network_partition(pg_url: str) -> None:
    async with (
        relayed(pg_url) as (relay, url),
        running_gateway(url, db_deadline_ms=PARTITION_DEADLINE_MS) as gw,
    ):
        scenario = Scenario(gw)
        await scenario.prepare()
        found = await partitioned(scenario, relay, ["readyz"])
        await scenario.recovered()
        assert found == []


# --- a frozen partition: one deadline for the whole write -------------------------------------------------

# The database deadline of these tests (GATEWAY_DB_DEADLINE_MS).
FROZEN_DEADLINE_MS = 2_000


@pytest.mark.anyio
async def test_callbacks_in_a_frozen_partition_are_answered_503(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL's traffic frozen (nothing passes, nothing is closed): callbacks keep arriving, more batches
    than commit at once, plus a read and a create. Every one is answered 503, none hangs. The warnings name
    a reason. Once the partition heals the gateway recovers with nothing lost or written. How soon each is
    answered (within the database deadline and about a second) is no test, a loaded machine can miss it:
    it is the bench check ``db-deadline`` (bench/checks/db_deadline.py), whose requests these are."""
    deadline_s = FROZEN_DEADLINE_MS / 1000
    async with relayed(pg_url) as (relay, url), running_gateway(url, db_deadline_ms=FROZEN_DEADLINE_MS) as gw:
        scenario = Scenario(gw)
        await scenario.prepare()
        client = gw.client
        tokens = {}
        for i in range(8):
            made = await client.post("/v1/tasks", json={"id": f"f{i}", "ttlMs": 600_000, "maxAttempts": 1})
            tokens[f"f{i}"] = made.json()["callbackToken"]
        callbacks = {f"callback {task}": start(client, task, token) for task, token in tokens.items()}
        others = {"read": scenario.requests()["get"], "create": scenario.requests()["create"]}
        answers = await frozen(relay, deadline_s, callbacks, others)
        took = sorted(round(t, 2) for _, _, t in answers)
        print(f"\nfrozen partition, deadline {deadline_s} s: answered after {took} s")
        assert sorted(what for what, _, _ in answers) == sorted([*callbacks, *others])
        assert [(what, status) for what, status, _ in answers if status != 503] == []
        reasons = [
            r.getMessage().split("database unavailable:", 1)[1]
            for r in caplog.records
            if "database unavailable:" in r.getMessage()
        ]
        assert reasons and all(reason.strip() for reason in reasons), reasons
        await scenario.recovered()
        # The callbacks answered 503 were not applied: each applies now, once.
        for task_id, token in tokens.items():
            answer = await start(client, task_id, token)()
            assert answer.status_code == 200 and answer.json()["changed"] is True, answer.text
        task = await eventually(
            lambda: client.get("/v1/tasks/f0"), lambda a: a.status_code == 200, "f0 readable"
        )
        assert task.json()["version"] == 1
