"""Model-based test: the real HTTP API against the in-memory model (tests/support/model.py), on SQLite and
PostgreSQL.

A seeded random driver sends the same operations to a running gateway and to the model built on the pure
machine, and compares every answer; after every operation it also compares, for every task either side
knows, the task as stored and its *whole* history (read from the store, since ``GET /events?cursor=0``
answers a snapshot once a task has more than ``retention_versions`` entries).

Operations, over a small pool of task ids plus one that is never created:

- create (new id; the same id again with the same or other parameters; invalid parameters; blank ids);
- callback: every event type with valid and invalid values (progress out of range, ``50.0``, ``50.5``,
  blank ``resultRef``/``resultHash``, ``fail`` retryable or not), HTTP-layer type errors (``atMs``, type
  ``expire``, unknown type, a missing, extra or mistyped field), callback ids fresh, reused with the same
  body, with another body or for another task, and ``attempt`` fencing (right, wrong or absent);
- ``GET /v1/tasks/{id}``; ``GET /events`` with cursors 0, current, old, ahead, far ahead and negative;
- deliveries with idempotency keys shared across tasks, and a blank one;
- cancel (the gateway's own event): live, ended and unknown tasks, with a reason, without one, with no body,
  and with bad bodies;
- drain; a sweep (``sweep_once``, the background sweeper is off); the clock moved by small steps, big steps,
  and to just before, at or after a live task's deadline.

After the random operations, a last sweep and drain, and ``GET /events`` at every cursor of every task.

Answers are compared whole (status and JSON, tokens of ``create`` stripped but required on a 2xx); an error
is compared by status and ``error.code``, and by message too when it is the machine's (``MACHINE_MESSAGE``).

Not sent by the random driver:

- numbers beyond ±(2**53 - 1), and a ``ttlMs`` that is not whole milliseconds:
  :func:`test_numbers_at_the_edges_match_the_model` pins each case.

Replay: every assertion message starts with the database, the seed and the operation number, and lists the
last operations; ``pytest tests/integration/test_model_based.py -k "sqlite-seed37"`` reruns one seed. Set
``MODEL_BASED_OPS`` to run longer sequences and ``MODEL_BASED_SEEDS=1,2,3`` to pick the seeds.
"""

from __future__ import annotations

import copy
import os
import random
from collections import Counter
from typing import Any

import orjson
import pytest
from sqlalchemy import select

from gateway.jobs.sweeper import sweep_once
from gateway.machine import task_to_json
from gateway.store.tables import TASK_COLUMNS, task_from_row
from gateway.store.tables import entries as entries_table
from gateway.store.tables import tasks as tasks_table
from tests.support import FakeClock, Running, running_gateway
from tests.support.model import FENCED, MACHINE_MESSAGE, RETENTION, Answer, Model, json_equal

pytestmark = pytest.mark.anyio

SEEDS = [int(s) for s in os.environ.get("MODEL_BASED_SEEDS", "11,23,37,41,59,73").split(",")]
OPERATIONS = int(os.environ.get("MODEL_BASED_OPS", "200"))

POOL_SIZE = 4  # task ids in play at a time; a create may retire one (terminal, preferably) for a fresh id
GHOST = "t-ghost"  # never created
TOKEN_TTL_MS = 3_600_000


def seeds() -> list[Any]:
    return [pytest.param(seed, id=f"seed{seed}") for seed in SEEDS]


def outcome(answer: Answer) -> str:
    status, body = answer
    return f"{status} {body['reason'] if status == 200 else body['error']['code']}"


class Driver:
    def __init__(self, gw: Running, clock: FakeClock, seed: int, database: str = "") -> None:
        self.gw = gw
        self.database = database
        self.clock = clock
        self.seed = seed
        self.rng = random.Random(seed)
        self.model = Model()
        self.tokens: dict[str, str] = {}
        # Every callback sent with an id: (callbackId, task id, event, attempt), to send again.
        self.sent: list[tuple[str, str, dict[str, Any], int | None]] = []
        self.next_callback = 0
        self.pool = [f"t-{n}" for n in range(1, POOL_SIZE + 1)]
        self.minted = POOL_SIZE
        self.log: list[str] = []
        self.counts: Counter[str] = Counter()

    # --- reporting -----------------------------------------------------------------------------------

    def where(self, what: str = "") -> str:
        recent = "\n  ".join(self.log[-12:])
        return f"{self.database} seed={self.seed} op#{len(self.log)} {what}\n last operations:\n  {recent}"

    def note(self, kind: str, text: str) -> None:
        self.counts[kind] += 1
        self.log.append(f"[{len(self.log) + 1}] t={self.clock()} {text}")

    def compare(self, got_status: int, got: Any, want: Answer) -> None:
        want_status, want_body = want
        detail = f"\n gateway: {got_status} {got!r}\n model:   {want_status} {want_body!r}"
        assert got_status == want_status, self.where("status differs") + detail
        if want_status >= 400:
            assert isinstance(got, dict) and set(got) == {"error"}, self.where("error shape") + detail
            assert set(got["error"]) == {"code", "message"}, self.where("error shape") + detail
            assert got["error"]["code"] == want_body["error"]["code"], self.where("error code") + detail
            messages = (got["error"]["message"], want_body["error"]["message"])
            if any(MACHINE_MESSAGE.match(m) for m in messages):
                assert got["error"]["message"] == want_body["error"]["message"], (
                    self.where("machine message") + detail
                )
        else:
            assert json_equal(got, want_body), self.where("body differs") + detail

    # --- helpers -----------------------------------------------------------------------------------------

    def token(self, task_id: str) -> dict[str, str]:
        if task_id not in self.tokens:
            self.tokens[task_id] = self.gw.gateway.tokens.issue(task_id, "callback", TOKEN_TTL_MS)
        return {"Authorization": f"Bearer {self.tokens[task_id]}"}

    def any_id(self) -> str:
        return GHOST if self.rng.random() < 0.06 else self.rng.choice(self.pool)

    def live_id(self) -> str:
        """Mostly a live task of the pool (where the interesting transitions are), else any id."""
        live = self.live()
        roll = self.rng.random()
        if live and roll < 0.3:
            return live[0]  # the oldest: a long history, so that resume reaches the retention window
        return self.rng.choice(live) if live and roll < 0.8 else self.any_id()

    def live(self) -> list[str]:
        return [t for t in self.pool if self.task(t) is not None and not self.task(t).terminal]

    def task(self, task_id: str) -> Any:
        return self.model.tasks.get(task_id)

    # --- operations --------------------------------------------------------------------------------------

    async def create(self) -> None:
        rng = self.rng
        task_id = rng.choice(self.pool)
        if rng.random() < 0.25:
            # A fresh id in place of a pool member, a terminal one preferably (history stays checked).
            done = [t for t in self.pool if self.task(t) is not None and self.task(t).terminal]
            self.pool.remove(rng.choice(done or self.pool))
            self.minted += 1
            task_id = f"t-{self.minted}"
            self.pool.append(task_id)
        ttl: Any = rng.choice([300, 2_000, 10_000, 30_000, 60_000, 600_000])
        attempts: Any = rng.choice([1, 2, 2, 3, 2.0])
        if task_id in self.model.params and rng.random() < 0.5:
            ttl, attempts = self.model.params[task_id]
            if rng.random() < 0.3:
                attempts = float(attempts)  # the same parameters as another JSON number
        roll = rng.random()
        if roll < 0.05:
            ttl = rng.choice([0, -10, 1_000.5])
        elif roll < 0.10:
            attempts = rng.choice([0, 1.5, -1])
        elif roll < 0.13:
            task_id = rng.choice(["", " ", "\u3000"])
        await self.send_create(task_id, ttl, attempts)

    async def send_create(self, task_id: str, ttl: Any, attempts: Any) -> None:
        body = {"id": task_id, "ttlMs": ttl, "maxAttempts": attempts}
        self.note("create", f"create {body}")
        answer = await self.gw.client.post("/v1/tasks", content=orjson.dumps(body))
        got = answer.json()
        # A created task's epoch is made at random: the model takes the gateway's (protocol.md, Resuming).
        epoch = got["task"].get("epoch", "") if answer.status_code == 201 else ""
        want = self.model.create(task_id, self.clock(), ttl, attempts, epoch=epoch)
        if answer.status_code < 300:
            for name in ("callbackToken", "subscribeToken"):
                assert isinstance(got.get(name), str) and got[name], self.where(f"{name} missing") + repr(got)
                del got[name]
        self.compare(answer.status_code, got, want)

    def event(self, task_id: str) -> dict[str, Any]:
        rng = self.rng
        task = self.task(task_id)
        state = task.state if task is not None else "queued"
        weights = {
            "queued": [55, 10, 8, 8, 5],
            "running": [5, 40, 20, 10, 3],
        }.get(state, [15, 20, 20, 15, 6])
        live = self.live()
        if state == "running" and live and task_id == live[0] and task.progress < 100:
            weights = [3, 80, 5, 5, 2]  # the oldest live task mostly makes progress: a long history
        kind = rng.choices(["start", "progress", "succeed", "fail", "malformed"], weights)[0]
        if kind == "start":
            return {"type": "start", "worker": rng.choice(["w1", "w2"])}
        if kind == "progress":
            current = task.progress if task is not None else 0
            value: Any = rng.choice(
                [
                    *(min(current + rng.randint(1, 6), 100) for _ in range(6)),
                    current,
                    max(current - rng.randint(1, 10), 0),
                    rng.choice([100, current + 1]),
                    101,
                    -1,
                    float(min(current + 10, 100)),
                    50.0,
                    50.5,
                ]
            )
            # cursor is optional (an empty string when left out): now and then it is left out.
            cursor = {} if rng.random() < 0.2 else {"cursor": f"c{rng.randint(0, 99)}"}
            return {"type": "progress", "progress": value, **cursor}
        if kind == "succeed":
            ref = rng.choice(
                ["s3://r/1", "s3://r/2", "s3://r/1", "s3://r/3", rng.choice(["", " ", "\u00a0"])]
            )
            digest = rng.choice(["h1", "h1", "h2", "h2", "h3", rng.choice(["", "\t"])])
            return {"type": "succeed", "resultRef": ref, "resultHash": digest}
        if kind == "fail":
            return {"type": "fail", "error": rng.choice(["boom", "oom"]), "retryable": rng.random() < 0.7}
        # HTTP-layer type errors: all 400 invalid-request, none of them the machine's.
        return rng.choice(
            [
                {"type": "start", "worker": "w1", "atMs": self.clock()},
                {"type": "expire"},
                {"type": "cancel"},
                {"type": "pause"},
                {"type": "progress", "progress": 10, "cursor": 7},
                {"type": "progress", "progress": "10", "cursor": "c"},
                {"type": "fail", "error": "x", "retryable": "yes"},
                {"type": "succeed", "resultRef": "r", "resultHash": "h", "extra": 1},
                {"worker": "w1"},
            ]
        )

    def attempt(self, task_id: str, event: dict[str, Any]) -> int | None:
        roll = self.rng.random()
        if event.get("type") not in FENCED:
            # Only progress, succeed and fail are fenced: an attempt on a start is a 400, now and then.
            return 1 if roll < 0.05 else None
        current = self.task(task_id).attempts if self.task(task_id) is not None else 0
        if roll < 0.45:
            return None
        if roll < 0.88:
            return int(current)
        return int(current) + self.rng.choice([-1, 1, 2])

    async def callback(self) -> None:
        rng = self.rng
        callback_id: str | None
        if self.sent and rng.random() < 0.15:
            callback_id, task_id, event, attempt = rng.choice(self.sent)
            how = rng.choice(["same body", "same body", "same body", "other body", "other task"])
            if how == "other body":
                event = self.event(task_id)
                attempt = self.attempt(task_id, event)
            elif how == "other task":
                task_id = rng.choice([t for t in [*self.pool, GHOST] if t != task_id])
            event = copy.deepcopy(event)
            label = f"reused {callback_id} ({how})"
        else:
            task_id = self.live_id()
            event = self.event(task_id)
            attempt = self.attempt(task_id, event)
            roll = rng.random()
            if roll < 0.4:
                callback_id = None
            elif roll < 0.94:
                self.next_callback += 1
                callback_id = f"cb-{self.next_callback}"
            elif roll < 0.98:
                callback_id = f"cb-{rng.randint(1, max(self.next_callback, 1))}"  # an old id, another body
            else:
                callback_id = ""  # an id like any other: only an absent callbackId is none
            label = f"callbackId={callback_id!r}"
        await self.send_callback(task_id, event, callback_id, attempt, label)

    async def send_callback(
        self, task_id: str, event: Any, callback_id: str | None, attempt: int | None, label: str = ""
    ) -> None:
        body: dict[str, Any] = {"event": event}
        if callback_id is not None:
            body["callbackId"] = callback_id
            self.sent.append((callback_id, task_id, copy.deepcopy(event), attempt))
        if attempt is not None:
            body["attempt"] = attempt
        self.note("callback", f"callback {task_id} {label} {body}")
        want = self.model.callback(task_id, self.clock(), copy.deepcopy(event), callback_id, attempt)
        answer = await self.gw.client.post(
            f"/v1/tasks/{task_id}/callbacks", content=orjson.dumps(body), headers=self.token(task_id)
        )
        self.counts[f"callback {outcome(want)}"] += 1
        self.compare(answer.status_code, answer.json(), want)

    async def get(self) -> None:
        task_id = self.any_id()
        self.note("get", f"GET {task_id}")
        answer = await self.gw.client.get(f"/v1/tasks/{task_id}")
        self.compare(answer.status_code, answer.json(), self.model.get(task_id))

    async def events(self) -> None:
        rng = self.rng
        task_id = self.live()[0] if self.live() and rng.random() < 0.3 else self.any_id()
        version = self.task(task_id).version if self.task(task_id) is not None else 0
        cursor = rng.choice(
            [
                0,
                0,
                version,
                max(version - rng.randint(1, 12), 0),
                max(version - RETENTION, 0),  # the edge of the retention window: delta ...
                max(version - RETENTION - 1, 0),  # ... and snapshot
                version + rng.randint(1, 4),
                10**12,
                -1,
                None,
            ]
        )
        self.note("events", f"events {task_id} cursor={cursor}")
        params = {} if cursor is None else {"cursor": str(cursor)}
        want = self.model.events(task_id, 0 if cursor is None else cursor)
        answer = await self.gw.client.get(f"/v1/tasks/{task_id}/events", params=params)
        if want[0] == 200:
            self.counts[f"events {want[1]['mode']} {want[1].get('reason', '')}".strip()] += 1
        self.compare(answer.status_code, answer.json(), want)

    async def deliver(self) -> None:
        done = [t for t, task in self.model.tasks.items() if task.state == "succeeded"]
        task_id = self.rng.choice(done) if done and self.rng.random() < 0.5 else self.any_id()
        key = self.rng.choice(["k1", "k2", "k3", "k4", "k5", ""])
        self.note("deliver", f"deliver {task_id} key={key!r}")
        want = self.model.deliver(task_id, key, self.clock())
        answer = await self.gw.client.post(
            f"/v1/tasks/{task_id}/deliveries", headers={"Idempotency-Key": key}
        )
        self.counts[f"deliver {outcome(want)}"] += 1
        self.compare(answer.status_code, answer.json(), want)

    async def cancel(self) -> None:
        rng = self.rng
        live = self.live()
        # Mostly a live task but the oldest (whose long history the resume checks need), else any id.
        task_id = rng.choice(live[1:] or live) if live and rng.random() < 0.7 else self.any_id()
        body = rng.choice([None, {}, {"reason": "wrong export"}, {"reason": ""}, {"reason": 7}, {"why": "x"}])
        self.note("cancel", f"cancel {task_id} {body}")
        want = self.model.cancel(task_id, self.clock(), copy.deepcopy(body))
        answer = await self.gw.client.post(
            f"/v1/tasks/{task_id}/cancel", content=b"" if body is None else orjson.dumps(body)
        )
        self.counts[f"cancel {outcome(want)}"] += 1
        self.compare(answer.status_code, answer.json(), want)

    async def drain(self) -> None:
        self.note("drain", "drain")
        want = self.model.drain()
        answer = await self.gw.client.post("/v1/notifications/drain")
        self.counts["drained notifications"] += len(want[1])
        self.compare(answer.status_code, answer.json(), want)

    async def sweep(self) -> None:
        self.note("sweep", "sweep")
        expired = self.model.sweep(self.clock())
        count = await sweep_once(self.gw.gateway.book)
        self.counts["swept tasks"] += len(expired)
        assert count == len(expired), self.where(f"sweep expired {count}, model {expired}")

    async def advance(self) -> None:
        rng = self.rng
        live = [self.model.tasks[t] for t in self.live()]
        roll = rng.random()
        if live and roll < 0.12:
            # Any live task's deadline but the oldest one's (it grows the long history).
            deadline = int(rng.choice(live[1:] or live).expires_at_ms)
            target = deadline + rng.choice([-1, 0, 0, rng.randint(1, 200)])
            step = max(target - self.clock(), 0)
        elif roll < 0.9:
            step = rng.randint(0, 80)
        else:
            step = rng.randint(200, 4_000)
        self.note("advance", f"advance {step}")
        self.clock.advance(step)

    # --- state -------------------------------------------------------------------------------------------

    async def check_state(self) -> None:
        """Every task either side knows, as stored, and its whole history, against the model.

        Read from the store in two queries (``GET /events?cursor=0`` would answer a snapshot past
        ``retention_versions`` entries, and one request per task would make the test slow).
        """
        async with self.gw.gateway.db.read() as conn:
            columns = [tasks_table.c[name] for name in TASK_COLUMNS]
            task_rows = (await conn.execute(select(*columns))).all()
            entry_rows = (
                await conn.execute(
                    select(entries_table.c.task_id, entries_table.c.version, entries_table.c.event).order_by(
                        entries_table.c.task_id, entries_table.c.version
                    )
                )
            ).all()
        stored = {row.id: task_to_json(task_from_row(row)) for row in task_rows}
        histories: dict[str, list[dict[str, Any]]] = {}
        for row in entry_rows:
            entry = {"version": row.version, "event": orjson.loads(row.event)}
            histories.setdefault(row.task_id, []).append(entry)
        assert set(stored) == set(self.model.tasks), (
            self.where("task ids") + f"\n store: {sorted(stored)}\n model: {sorted(self.model.tasks)}"
        )
        orphans = set(histories) - set(stored)
        assert not orphans, self.where(f"entries without a task: {orphans}")
        for task_id, task in sorted(stored.items()):
            want = self.model.get(task_id)[1]
            assert json_equal(task, want), self.where(f"task {task_id}") + f"\n store: {task}\n model: {want}"
            history = histories.get(task_id, [])
            want_history = self.model.history(task_id)
            assert json_equal(history, want_history), (
                self.where(f"history of {task_id}") + f"\n store: {history}\n model: {want_history}"
            )

    async def run(self, operations: int) -> None:
        ops = [self.create, self.callback, self.get, self.events, self.deliver, self.drain, self.sweep]
        ops += [self.advance, self.cancel]
        weights = [8, 48, 5, 10, 7, 4, 6, 12, 2]
        # Start with two tasks, the first one long-lived, so that the early operations have tasks to act on.
        for task_id, ttl in zip(self.pool, [600_000, 60_000], strict=False):
            await self.send_create(task_id, ttl, 3)
        for _ in range(operations):
            await self.rng.choices(ops, weights)[0]()
            await self.check_state()
        self.counts["highest version"] = max((t.version for t in self.model.tasks.values()), default=0)
        # A last drain and sweep, so that every notification is compared once more.
        await self.sweep()
        await self.drain()
        await self.check_state()
        # And every cursor of every task, on both sides of the retention window.
        for task_id in sorted(self.model.tasks):
            for cursor in range(-1, self.model.tasks[task_id].version + 3):
                self.note("events", f"events {task_id} cursor={cursor} (final pass)")
                answer = await self.gw.client.get(f"/v1/tasks/{task_id}/events", params={"cursor": cursor})
                want = self.model.events(task_id, cursor)
                self.compare(answer.status_code, answer.json(), want)


@pytest.mark.parametrize("seed", seeds())
async def test_http_api_matches_the_model(database_url: str, clock: FakeClock, seed: int) -> None:
    async with running_gateway(database_url, clock=clock, sweep_interval_ms=0) as gw:
        driver = Driver(gw, clock, seed, database_url.split(":", 1)[0])
        await driver.run(OPERATIONS)
    print(f"seed {seed}: {sorted(driver.counts.items())}")


# --- numbers at the edges, one short sequence each ----------------------------------------------------

START = {"type": "start", "worker": "w1"}
SAFE = 2**53 - 1  # JavaScript's largest safe integer

# Numbers at the edges: the wire takes any JSON number where nothing is stored (progress, attempt, cursor) and
# lets the machine judge it in its order; ttlMs must be whole milliseconds (the gateway's one deviation from
# createAsyncTask, mirrored by the model).


def edge(steps: list[tuple[Any, ...]], reason: str | None = None, *, id: str) -> Any:
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(steps, marks=marks, id=id)


EDGES = [
    # controls: the machine decides, in its order
    edge(
        [("callback", {"type": "progress", "progress": 101, "cursor": "c"}, None)], id="progress-101-queued"
    ),
    edge(
        [("callback", {"type": "progress", "progress": SAFE, "cursor": "c"}, None)], id="progress-safe-queued"
    ),
    edge(
        [
            ("callback", START, None),
            ("callback", {"type": "progress", "progress": SAFE, "cursor": "c"}, None),
        ],
        id="progress-safe-running",
    ),
    edge([("create", "t-edge", 1_000, 2.0)], id="max-attempts-2.0"),
    edge([("create", "t-edge", 1_000, SAFE)], id="max-attempts-safe"),
    edge([("events", SAFE)], id="cursor-safe"),
    # beyond 2**53 - 1
    edge(
        [("callback", {"type": "progress", "progress": SAFE + 1, "cursor": "c"}, None)],
        id="progress-2**53-queued",
    ),
    edge(
        [
            ("callback", START, None),
            ("callback", {"type": "progress", "progress": 1e16, "cursor": "c"}, None),
        ],
        id="progress-1e16-running",
    ),
    edge([("create", "t-edge", 1_000, SAFE + 1)], id="max-attempts-2**53"),
    edge(
        [
            ("callback", START, None),
            ("callback", {"type": "progress", "progress": 5, "cursor": "c"}, SAFE + 1),
        ],
        id="attempt-2**53",
    ),
    edge([("events", 10**25)], id="cursor-10**25"),
    # ttlMs as a JSON number that is not a JSON integer
    edge([("create", "t-edge", 1_000.0, 2)], id="ttl-1000.0"),
    edge([("create", "t-edge", 1_000.5, 2)], id="ttl-1000.5-is-not-whole-ms"),
]


@pytest.mark.parametrize("steps", EDGES)
async def test_numbers_at_the_edges_match_the_model(sqlite_url: str, clock: FakeClock, steps: Any) -> None:
    """Short fixed sequences on one task ``t-1`` (queued, version 0): HTTP-layer number handling, compared
    with the model like every random operation (SQLite only: nothing here depends on the database)."""
    async with running_gateway(sqlite_url, clock=clock, sweep_interval_ms=0) as gw:
        driver = Driver(gw, clock, seed=0)
        await driver.send_create("t-1", 60_000, 3)
        for step in steps:
            clock.advance(1)
            if step[0] == "create":
                await driver.send_create(*step[1:])
            elif step[0] == "callback":
                await driver.send_callback("t-1", step[1], None, step[2])
            else:
                driver.note("events", f"events t-1 cursor={step[1]}")
                answer = await gw.client.get("/v1/tasks/t-1/events", params={"cursor": str(step[1])})
                driver.compare(answer.status_code, answer.json(), driver.model.events("t-1", step[1]))
            await driver.check_state()
