"""Expiry and durability against a real server: the sweeper on the real clock, expiry across a restart,
a callback after the deadline, no double expiry, state that survives a restart, and the one-process rule
of a SQLite gateway.

What is asserted about time (protocol.md, "The task's life", its deadline, and "Notifications"):

- The sweeper expires a live task on the real clock, never before its deadline, its history entry and its
  notification both at ``expiresAtMs``; it wakes for a deadline, not at its interval; a task that fell
  due while no gateway ran expires at the next start; on PostgreSQL an expiry commits while the event loop
  is held busy. How soon (within 1 s of the deadline) is no test, a loaded machine can miss it: it is the
  bench checks ``expiry-on-time``, ``expiry-wakes``, ``expiry-at-restart`` and ``expiry-busy-loop``
  (bench/checks/expiry.py, ``python -m bench checks``).
- A callback at or after ``expiresAtMs`` expires the task (the task life's "at or after"). Its event
  is not recorded; the ``expire`` entry is, at ``expiresAtMs``. The notification of that expiry is at the
  callback's time (protocol.md, Notifications, pins the notification to ``expiresAtMs`` only for the
  sweeper).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import asyncpg  # type: ignore[import-untyped]  # no stubs, no py.typed (as in gateway/store/database.py)
import pytest
from anyio.abc import Process
from sqlalchemy import event, select
from starlette.applications import Starlette

from gateway.jobs.sweeper import sweep_once
from gateway.settings import Settings
from gateway.store import Database
from gateway.store.queries import DUE, NEXT_DEADLINE
from gateway.store.tables import tasks
from gateway.web.app import create_app
from tests.support import (
    GATEWAY_CLI,
    SECRET,
    STEP_S,
    FakeClock,
    Running,
    create_task,
    eventually,
    post_callback,
    postgres_database,
    reap_leftover_driver_tasks,
    running_gateway,
    serve,
    wait_until,
)

POLL_S = 0.01


# --- tasks the database driver leaves behind ----------------------------------------------------------------


@pytest.fixture(autouse=True)
async def _reap_driver_tasks() -> AsyncIterator[None]:
    # Keeps a regression of the bug that test_stopping_during_a_sweep_leaves_no_driver_task_behind guards
    # against from hanging the whole run at the end of some other test; that test reports it.
    yield
    await reap_leftover_driver_tasks()


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


async def get_task(gw: Running, task_id: str) -> dict[str, Any]:
    answer = await gw.client.get(f"/v1/tasks/{task_id}")
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


async def history(gw: Running, task_id: str) -> list[dict[str, Any]]:
    answer = await gw.client.get(f"/v1/tasks/{task_id}/events", params={"cursor": 0})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["mode"] in ("delta", "caught-up"), body
    return list(body["events"])


async def drain(gw: Running) -> list[dict[str, Any]]:
    answer = await gw.client.post("/v1/notifications/drain")
    assert answer.status_code == 200, answer.text
    return list(answer.json())


async def wait_expired(gw: Running, task_id: str, timeout_s: float = STEP_S) -> dict[str, Any]:
    """Poll the task until it is expired (bounded: how soon is each test's own assertion); returns it."""
    return await eventually(
        lambda: get_task(gw, task_id),
        lambda task: task["state"] == "expired",
        f"{task_id} expired",
        timeout_s,
    )


async def stored_state(database_url: str, task_id: str) -> str:
    """The task's state as stored, read straight from the database while no gateway is running."""
    db = Database(database_url)
    try:
        async with db.read() as conn:
            state = (await conn.execute(select(tasks.c.state).where(tasks.c.id == task_id))).scalar_one()
    finally:
        await db.close()
    return str(state)


def assert_expired_at_deadline(entries: list[dict[str, Any]], task: dict[str, Any]) -> None:
    assert entries[-1] == {
        "version": task["version"],
        "event": {"type": "expire", "atMs": task["expiresAtMs"]},
    }
    assert [e["event"]["type"] for e in entries].count("expire") == 1


# --- the sweeper on the real clock -------------------------------------------------------------------------


@pytest.mark.anyio
async def test_sweeper_expires_on_the_real_clock(database_url: str, record_property: Any) -> None:
    async with running_gateway(database_url) as gw:
        made = await create_task(gw, "soon", ttl_ms=300, max_attempts=2)
        deadline = made["task"]["expiresAtMs"]
        task = await wait_expired(gw, "soon")
        lag_ms = wall_ms() - deadline
        record_property("observed_after_deadline_ms", lag_ms)
        assert lag_ms >= 0, "expired before its deadline"

        entries = await history(gw, "soon")
        assert_expired_at_deadline(entries, task)
        assert task["version"] == 1
        notifications = await drain(gw)
        assert notifications == [{"taskId": "soon", "state": "expired", "atMs": deadline, "version": 1}]


@pytest.mark.anyio
async def test_the_sweeper_wakes_at_a_deadline_not_at_its_interval(database_url: str) -> None:
    """GATEWAY_SWEEP_INTERVAL_MS is the longest the sweeper sleeps, not its pace: it wakes for the next
    deadline it knows of, whether the task was made before its last pass or after. With an interval of an
    hour, each task expires within a step of the test (``wait_expired``)."""
    async with running_gateway(database_url, sweep_interval_ms=3_600_000) as gw:
        await create_task(gw, "made-after-the-first-pass", ttl_ms=300, max_attempts=1)
        await wait_expired(gw, "made-after-the-first-pass")
        # Two more, the later one made first: the sweeper knows the earlier deadline from its last pass.
        await create_task(gw, "later", ttl_ms=900, max_attempts=1)
        await create_task(gw, "sooner", ttl_ms=300, max_attempts=1)
        await wait_expired(gw, "sooner")
        await wait_expired(gw, "later")


# --- expiry across a restart --------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_task_that_fell_due_while_down_expires_at_restart(database_url: str, clock: FakeClock) -> None:
    async with running_gateway(database_url, clock=clock) as gw:
        made = await create_task(gw, "sleeper", ttl_ms=300, max_attempts=2)
        await post_callback(gw, "sleeper", made["callbackToken"], {"type": "start", "worker": "w"})
    deadline = made["task"]["expiresAtMs"]
    clock.advance(10_000)

    async with running_gateway(database_url, clock=clock) as gw:
        task = await wait_expired(gw, "sleeper")
        assert task["expiresAtMs"] == deadline
        assert_expired_at_deadline(await history(gw, "sleeper"), task)
        assert task["version"] == 2
        assert await drain(gw) == [{"taskId": "sleeper", "state": "expired", "atMs": deadline, "version": 2}]


@pytest.mark.anyio
async def test_task_that_fell_due_while_down_expires_at_restart_real_clock(database_url: str) -> None:
    # The first server runs no sweeper (one would wake at the task's deadline, which a slow stop may let
    # come first): it is the second server that expires the task.
    async with running_gateway(database_url, sweep_interval_ms=0) as gw:
        made = await create_task(gw, "sleeper", ttl_ms=300, max_attempts=2)
    deadline = made["task"]["expiresAtMs"]
    with anyio.fail_after(5):
        while wall_ms() < deadline:  # noqa: ASYNC110  (waiting for the wall clock: nothing to signal it)
            await anyio.sleep(POLL_S)
    assert await stored_state(database_url, "sleeper") == "queued"

    async with running_gateway(database_url) as gw:
        task = await wait_expired(gw, "sleeper")
        assert_expired_at_deadline(await history(gw, "sleeper"), task)
        assert await drain(gw) == [{"taskId": "sleeper", "state": "expired", "atMs": deadline, "version": 1}]


# --- a callback after the deadline -------------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("late_ms", [0, 700])
async def test_callback_at_or_after_the_deadline_expires_the_task(
    database_url: str, clock: FakeClock, late_ms: int
) -> None:
    async with running_gateway(database_url, clock=clock, sweep_interval_ms=0) as gw:
        made = await create_task(gw, "late", ttl_ms=300, max_attempts=2)
        token = made["callbackToken"]
        deadline = made["task"]["expiresAtMs"]
        await post_callback(gw, "late", token, {"type": "start", "worker": "w"})
        clock.advance(300 + late_ms)  # clock() - expiresAtMs == late_ms (the task life's "at or after")
        callback_at = clock.now

        answer = await post_callback(
            gw, "late", token, {"type": "progress", "progress": 50, "cursor": "c"}, callback_id="cb"
        )
        assert answer["reason"] == "expired"
        assert answer["changed"] is True and answer["notify"] is True and answer["duplicate"] is False
        assert answer["duplicateCallback"] is False
        assert answer["task"]["state"] == "expired" and answer["task"]["version"] == 2
        assert answer["task"]["progress"] == 0

        entries = await history(gw, "late")
        assert [e["event"]["type"] for e in entries] == ["start", "expire"]
        assert entries[1] == {"version": 2, "event": {"type": "expire", "atMs": deadline}}
        # The notification of a callback-triggered expiry is at the callback's time (protocol.md,
        # Notifications).
        assert await drain(gw) == [{"taskId": "late", "state": "expired", "atMs": callback_at, "version": 2}]

        # The sweeper finds nothing left to do; a later callback is a terminal conflict and writes nothing.
        assert await sweep_once(gw.gateway.book) == 0
        later = await post_callback(
            gw, "late", token, {"type": "succeed", "resultRef": "r", "resultHash": "h"}
        )
        assert later["reason"] == "terminal-conflict" and later["changed"] is False
        assert len(await history(gw, "late")) == 2
        assert await drain(gw) == []


@pytest.mark.anyio
async def test_callback_one_millisecond_before_the_deadline_is_applied(
    database_url: str, clock: FakeClock
) -> None:
    async with running_gateway(database_url, clock=clock, sweep_interval_ms=0) as gw:
        made = await create_task(gw, "just-in-time", ttl_ms=300, max_attempts=2)
        token = made["callbackToken"]
        await post_callback(gw, "just-in-time", token, {"type": "start", "worker": "w"})
        clock.advance(299)
        answer = await post_callback(
            gw, "just-in-time", token, {"type": "succeed", "resultRef": "r", "resultHash": "h"}
        )
        assert answer["reason"] == "succeeded"
        assert answer["task"]["state"] == "succeeded"
        clock.advance(10_000)
        assert await sweep_once(gw.gateway.book) == 0
        assert (await get_task(gw, "just-in-time"))["state"] == "succeeded"


# --- the sweeper never expires twice ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_sweeper_off_and_sweep_passes_never_double_expire(database_url: str, clock: FakeClock) -> None:
    async with running_gateway(database_url, clock=clock, sweep_interval_ms=0) as gw:
        ids = [f"due-{i}" for i in range(6)]
        deadline = 0
        for i, task_id in enumerate(ids):
            made = await create_task(gw, task_id, ttl_ms=300, max_attempts=2)
            deadline = made["task"]["expiresAtMs"]
            if i % 2:
                await post_callback(gw, task_id, made["callbackToken"], {"type": "start", "worker": "w"})
        book = gw.gateway.book

        clock.advance(299)
        assert await sweep_once(book) == 0, "not due one millisecond before the deadline"
        clock.advance(1)

        # Due now, and no background sweeper: the tasks stay live over several default sweep intervals
        # (an observation window, not a wait for a condition).
        window_end = time.monotonic() + 0.6
        while time.monotonic() < window_end:
            for task_id in ids:
                assert (await get_task(gw, task_id))["state"] in ("queued", "running")
            await anyio.sleep(0.05)

        # Two passes at once expire each task once.
        counts: list[int] = []

        async def sweep() -> None:
            counts.append(await sweep_once(book))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(sweep)
                tg.start_soon(sweep)
        assert sum(counts) == len(ids), counts

        before = {task_id: await history(gw, task_id) for task_id in ids}
        for task_id in ids:
            task = await get_task(gw, task_id)
            assert task["state"] == "expired"
            assert_expired_at_deadline(before[task_id], task)

        # Two more passes after expiry change nothing.
        assert await sweep_once(book) == 0
        clock.advance(60_000)
        assert await sweep_once(book) == 0
        assert {task_id: await history(gw, task_id) for task_id in ids} == before

        notifications = await drain(gw)
        assert sorted(n["taskId"] for n in notifications) == ids
        assert all(n["state"] == "expired" and n["atMs"] == deadline for n in notifications)


@pytest.mark.anyio
async def test_background_sweeper_then_manual_passes_add_nothing(database_url: str, clock: FakeClock) -> None:
    async with running_gateway(database_url, clock=clock, sweep_interval_ms=50) as gw:
        made = await create_task(gw, "swept", ttl_ms=300, max_attempts=2)
        clock.advance(300)
        task = await wait_expired(gw, "swept")
        entries = await history(gw, "swept")
        assert_expired_at_deadline(entries, task)
        assert await sweep_once(gw.gateway.book) == 0
        assert await sweep_once(gw.gateway.book) == 0
        assert await history(gw, "swept") == entries
        assert await drain(gw) == [
            {"taskId": "swept", "state": "expired", "atMs": made["task"]["expiresAtMs"], "version": 1}
        ]


async def expiry_lateness(gw: Running, count: int) -> dict[str, float]:
    """``gateway_expiry_lateness_seconds`` as ``/metrics`` shows it once it has ``count`` observations:
    each bucket by its ``le``, and the ``count`` and ``sum``. The sweeper observes an expiry after its
    commit (on PostgreSQL from a thread of its own), so a GET can see the task expired a moment before."""
    return await eventually(
        lambda: _expiry_lateness(gw),
        lambda found: found.get("count", 0) >= count,
        f"{count} expiries observed in gateway_expiry_lateness_seconds",
    )


async def _expiry_lateness(gw: Running) -> dict[str, float]:
    answer = await gw.client.get("/metrics")
    assert answer.status_code == 200, answer.text
    found: dict[str, float] = {}
    for line in answer.text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("gateway_expiry_lateness_seconds_bucket{"):
            found[name.split('le="')[1].split('"')[0]] = float(value)
        elif name in ("gateway_expiry_lateness_seconds_count", "gateway_expiry_lateness_seconds_sum"):
            found[name.rsplit("_", 1)[1]] = float(value)
    return found


@pytest.mark.anyio
async def test_metrics_show_how_long_after_its_deadline_each_expiry_committed(
    database_url: str, clock: FakeClock
) -> None:
    """Operators see the 1 s bound kept or not: /metrics has a histogram of the time from a task's deadline
    to the commit of the sweeper's expiry. On the fake clock, one task is expired the moment it falls due
    and one is first seen by the sweeper 700 ms after its deadline."""
    async with running_gateway(database_url, clock=clock, sweep_interval_ms=50) as gw:
        await create_task(gw, "on-time", ttl_ms=300, max_attempts=1)
        clock.advance(300)
        await wait_expired(gw, "on-time")
        await create_task(gw, "late", ttl_ms=300, max_attempts=1)
        clock.advance(300 + 700)
        await wait_expired(gw, "late")

        lateness = await expiry_lateness(gw, 2)
    assert lateness["count"] == 2
    assert lateness["sum"] == pytest.approx(0.7)
    assert lateness["0.01"] == 1  # on time
    assert lateness["0.5"] == 1
    assert lateness["0.75"] == 2  # 700 ms late
    assert lateness["1.0"] == lateness["+Inf"] == 2


@pytest.fixture
def pg_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


def stored_state_from_a_thread(database_url: str, task_id: str) -> str:
    """The task's state as stored, read on a connection and an event loop of a thread of its own while the
    caller waits: the caller's event loop runs nothing meanwhile."""

    async def read() -> str:
        conn = await asyncpg.connect(database_url, timeout=10)
        try:
            return str(await conn.fetchval("SELECT state FROM tasks WHERE id = $1", task_id))
        finally:
            await conn.close()

    with ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, read()).result()


@pytest.mark.anyio
async def test_on_postgresql_a_task_expires_while_the_event_loop_is_held_busy(pg_url: str) -> None:
    """Under load it is the gateway's event loop that makes expiry late (each statement of a pass waits
    for its turn there), so on PostgreSQL the sweeper runs off it. Here the loop is held busy from a task's
    creation, 300 ms before its deadline, until the database has the task expired: the sweeper committed
    the expiry while nothing of the loop ran (and the gateway's histogram, /metrics, counts it). How late
    it commits while the loop is busy (within 1 s) is the bench check ``expiry-busy-loop``."""
    async with running_gateway(pg_url) as gw:
        await create_task(gw, "due-while-busy", ttl_ms=300, max_attempts=1)
        held_until = time.monotonic() + 30
        # The event loop held: each read waits for a thread, nothing of the loop runs meanwhile.
        while stored_state_from_a_thread(pg_url, "due-while-busy") != "expired":
            assert time.monotonic() < held_until, "not expired while the event loop was held busy"
        await wait_expired(gw, "due-while-busy")
        lateness = await expiry_lateness(gw, 1)
    assert lateness["count"] == 1


# --- stopping in the middle of a sweep ---------------------------------------------------------------------


class HeldStatement:
    """The first run of one statement (``statement``, its text up to its first parameter) on the gateway's
    SQLite connections, the engine's aiosqlite ones and the writer's, held mid-query on the thread that
    runs it (a ``sqlite3`` trace callback, which SQLite calls as the statement starts) until
    :meth:`release`: whatever comes meanwhile, a stop, lands in the middle of it."""

    def __init__(self, statement: str) -> None:
        self.prefix = statement.split("?", 1)[0]
        self.reached = threading.Event()
        self._released = threading.Event()
        self._lock = threading.Lock()

    def hold_on(self, db: Database) -> None:
        """Watch every statement ``db`` runs from now on."""
        assert db.writer is not None
        db.writer.trace(self._trace)

        def traced(dbapi_connection: Any, *_: Any) -> None:  # each connection the engine hands out
            dbapi_connection.driver_connection._conn.set_trace_callback(self._trace)

        event.listen(db.engine.sync_engine, "checkout", traced)

    def release(self) -> None:
        self._released.set()

    def _trace(self, sql: str) -> None:
        with self._lock:
            first = sql.startswith(self.prefix) and not self.reached.is_set()
            if first:
                self.reached.set()
        if first:
            # Bounded, so that a test that fails never leaves a database thread blocked for ever.
            self._released.wait(60)


def stop_requested(app: Starlette) -> anyio.Event:
    """An event set when the server asks ``app`` to stop (its lifespan's shutdown): the gateway then cancels
    its background work, the sweeper's pass included, before it next waits for anything."""
    stopping = anyio.Event()
    lifespan = app.router.lifespan_context

    @asynccontextmanager
    async def watched(app: Starlette) -> AsyncIterator[Any]:
        async with lifespan(app) as state:
            yield state
            stopping.set()

    app.router.lifespan_context = watched
    return stopping


@pytest.mark.anyio
@pytest.mark.parametrize("statement", [NEXT_DEADLINE, DUE], ids=["reading-what-is-due", "in-an-expiry-batch"])
async def test_stopping_during_a_sweep_leaves_no_driver_task_behind(
    sqlite_url: str, clock: FakeClock, statement: str
) -> None:
    """A stop that lands in a sweep pass must not leave a database-driver task pending: one that never ends
    (aiosqlite's graceful close after SQLAlchemy tore a connection down mid-query) hangs the event loop's
    shutdown for ever, so `gateway serve` on SQLite would never exit on Ctrl-C.

    The pass is held in the middle of one of its statements (its read of what is due, on an aiosqlite
    connection; an expiry batch's claim, on the writer's) until the stop has cancelled the gateway's
    background work: the stop lands there, whatever the machine's speed."""
    ttl_ms = 1_000
    app = create_app(Settings(database_url=sqlite_url, secret=SECRET), clock=clock)
    stopping = stop_requested(app)
    held = HeldStatement(statement)

    async def release_once_stopping() -> None:
        await stopping.wait()
        await anyio.wait_all_tasks_blocked()  # the cancellation delivered wherever it can go
        held.release()

    try:
        async with anyio.create_task_group() as tg, serve(app):
            gw = app.state.gateway
            for i in range(3):
                await gw.book.create(f"due-{i}", ttl_ms, 1)
            held.hold_on(gw.db)
            clock.advance(ttl_ms)  # all due: the sweeper's next pass (within a second) expires them
            await wait_until(held.reached.is_set, "the sweeper in the held statement")
            tg.start_soon(release_once_stopping)
            # Stopped (serve's end waited for the server to exit).
    finally:
        held.release()
    assert await reap_leftover_driver_tasks() == []


# --- durability ---------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_state_and_history_survive_a_restart(database_url: str, clock: FakeClock) -> None:
    async with running_gateway(database_url, clock=clock) as gw:
        a = await create_task(gw, "a", ttl_ms=600_000, max_attempts=2)
        b = await create_task(gw, "b", ttl_ms=600_000, max_attempts=2)
        await post_callback(gw, "a", a["callbackToken"], {"type": "start", "worker": "w1"}, callback_id="a-1")
        clock.advance(5)
        await post_callback(
            gw,
            "a",
            a["callbackToken"],
            {"type": "progress", "progress": 30, "cursor": "r30"},
            callback_id="a-2",
        )
        await post_callback(gw, "b", b["callbackToken"], {"type": "start", "worker": "w2"})
        clock.advance(5)
        await post_callback(
            gw, "b", b["callbackToken"], {"type": "succeed", "resultRef": "s3://b", "resultHash": "hb"}
        )
        receipt = (await gw.client.post("/v1/tasks/b/deliveries", headers={"Idempotency-Key": "kb"})).json()
        before = {t: (await get_task(gw, t), await history(gw, t)) for t in ("a", "b")}

    async with running_gateway(database_url, clock=clock) as gw:
        after = {t: (await get_task(gw, t), await history(gw, t)) for t in ("a", "b")}
        assert after == before
        assert before["a"][0]["version"] == 2 and before["b"][0]["state"] == "succeeded"

        # The callback ids, the outbox and the receipts are durable too.
        repeat = await post_callback(
            gw,
            "a",
            a["callbackToken"],
            {"type": "progress", "progress": 30, "cursor": "r30"},
            callback_id="a-2",
        )
        assert repeat["duplicateCallback"] is True and repeat["changed"] is False
        assert await drain(gw) == [{"taskId": "b", "state": "succeeded", "atMs": clock.now, "version": 2}]
        again = (await gw.client.post("/v1/tasks/b/deliveries", headers={"Idempotency-Key": "kb"})).json()
        assert again["duplicate"] is True and again["receipt"] == receipt["receipt"]

        # And the task carries on from its version.
        step = await post_callback(
            gw,
            "a",
            a["callbackToken"],
            {"type": "progress", "progress": 60, "cursor": "r60"},
            callback_id="a-3",
        )
        assert step["changed"] is True and step["task"]["version"] == 3
        assert [e["version"] for e in await history(gw, "a")] == [1, 2, 3]


# --- one process per SQLite file ----------------------------------------------------------------------------


def gateway_command(database_url: str) -> list[str]:
    return [*GATEWAY_CLI, "serve", "--port", "0", "--database-url", database_url]


def gateway_environ() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env["GATEWAY_SECRET"] = "process-test-secret-0123456789abcdef"
    env["GATEWAY_LOG_LEVEL"] = "info"
    return env


@asynccontextmanager
async def gateway_process(database_url: str, log: Path) -> AsyncIterator[Process]:
    """``gateway serve`` as a process of its own, output in ``log``; terminated (or killed) at the end."""
    with log.open("wb") as out:
        process = await anyio.open_process(
            gateway_command(database_url),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=gateway_environ(),
            cwd=log.parent,
        )
    async with process:
        try:
            yield process
        finally:
            if process.returncode is None:
                process.terminate()
                with anyio.move_on_after(10):
                    await process.wait()
            if process.returncode is None:
                process.kill()
                with anyio.fail_after(10):
                    await process.wait()


async def wait_for_startup(process: Process, log: Path, timeout_s: float = 30) -> None:
    async def output() -> bytes:
        assert process.returncode is None, f"the gateway exited ({process.returncode}); see {log}"
        return await anyio.Path(log).read_bytes()

    await eventually(output, lambda out: b"Application startup complete" in out, f"{log}: started", timeout_s)


@pytest.mark.anyio
async def test_second_process_on_one_sqlite_file_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'g.db'}"
    async with gateway_process(url, tmp_path / "first.log") as first:
        await wait_for_startup(first, tmp_path / "first.log")

        with anyio.fail_after(30):
            second = await anyio.run_process(
                gateway_command(url), check=False, env=gateway_environ(), cwd=tmp_path
            )
        output = (second.stdout + second.stderr).decode(errors="replace")
        assert second.returncode != 0, output
        assert "a SQLite gateway runs as one process" in output, output
        assert first.returncode is None, "the first gateway must keep running"

    # The refusal came from the live process, not from a stale lock: once it is gone, a new one starts.
    async with gateway_process(url, tmp_path / "third.log") as third:
        await wait_for_startup(third, tmp_path / "third.log")
