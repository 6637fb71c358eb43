"""Retention (``GATEWAY_RETAIN_FINISHED_S``) as the gateway's users meet it, on a real server over SQLite
and PostgreSQL: a finished task whose notification was taken is deleted a retention after it finished,
by the lifespan's retention loop, and is then unknown on every route and socket (a late callback too);
a subscriber had every frame before; one whose notification nobody took is kept, and counted, until a
drain takes it. That the database stays the same size under steady churn (within 1.2x after three rounds)
is no test, a loaded machine can miss it: it is the bench check ``retention-growth``
(bench/checks/retention.py, ``python -m bench checks``).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import anyio
import orjson
import pytest

from gateway.book.book import Book
from gateway.jobs.relay import webhook_id
from gateway.jobs.retention import Retention
from gateway.machine import Start, Succeed
from gateway.store import Database
from gateway.store.base import Notification, Receipt, WriteTx
from gateway.store.sql import SqlStore
from gateway.web.render import notifications_body
from tests.integration.test_live_support import (
    StreamCheck,
    closed_with,
    live_gateway,
    read_to_close,
    recv_frame,
    socket,
    ws_url,
)
from tests.support import (
    FakeClock,
    Running,
    bearer,
    create_task,
    error,
    eventually,
    opened,
    post_callback,
    postgres_database,
)
from tests.support.receiver import Receiver, serving_receiver

pytestmark = pytest.mark.anyio

RETAIN_S = 10
RELAY_SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found is not None, name
    return float(found.group(1))


async def metrics(gw: Running) -> str:
    answer = await gw.client.get("/metrics")
    assert answer.status_code == 200
    return answer.text


async def finish(gw: Running, task_id: str) -> dict[str, Any]:
    """A task created, started and succeeded (callback ids ``<id>-start`` and ``<id>-done``)."""
    made = await create_task(gw, task_id)
    token = made.callback_token
    await post_callback(gw, task_id, token, {"type": "start", "worker": "w1"}, callback_id=f"{task_id}-start")
    done = {"type": "succeed", "resultRef": "s3://r", "resultHash": "sha256:1"}
    await post_callback(gw, task_id, token, done, callback_id=f"{task_id}-done", attempt=1)
    return dict(made)


async def test_a_task_past_retention_is_unknown_everywhere_once_its_notification_was_drained(
    database_url: str,
) -> None:
    clock = FakeClock()
    async with live_gateway(database_url, clock=clock, retain_finished_s=RETAIN_S) as gw:
        gone = await create_task(gw, "gone")
        # A subscriber from the start gets every frame, the terminal one included, before any deletion.
        check = StreamCheck("gone", 0)
        async with socket(ws_url(gw, "/v1/tasks/gone/ws", cursor=0, token=gone.subscribe_token)) as ws:
            check.feed(await recv_frame(ws))
            token = gone.callback_token
            await post_callback(
                gw, "gone", token, {"type": "start", "worker": "w1"}, callback_id="gone-start"
            )
            done = {"type": "succeed", "resultRef": "s3://r", "resultHash": "sha256:1"}
            await post_callback(gw, "gone", token, done, callback_id="gone-done", attempt=1)
            with anyio.fail_after(10):
                assert await read_to_close(ws, check) == 1000
        assert check.types == ["caught-up", "event", "event"]
        answer = await gw.client.post("/v1/tasks/gone/deliveries", headers={"Idempotency-Key": "k-gone"})
        assert answer.status_code == 200, answer.text
        await drain_and_expect(gw, ["gone"])
        clock.advance(RETAIN_S * 1000 - 1)
        await finish(gw, "recent")  # finished within the retention, and drained: kept for now
        await drain_and_expect(gw, ["recent"])
        clock.advance(1)

        # The lifespan's retention loop takes it from here.
        await eventually(
            lambda: gw.client.get("/v1/tasks/gone"), lambda a: a.status_code == 404, "gone deleted"
        )
        sub, cb = bearer(gone.subscribe_token), bearer(gone.callback_token)
        error(await gw.client.get("/v1/tasks/gone", headers=sub), 404, "unknown-task")
        for cursor in (0, 2):
            answer = await gw.client.get("/v1/tasks/gone/events", params={"cursor": cursor}, headers=sub)
            error(answer, 404, "unknown-task")
        # A late callback: the worker's retry of its last one (same id, same body), and a new one.
        late = {"callbackId": "gone-done", "attempt": 1, "event": done}
        error(await gw.client.post("/v1/tasks/gone/callbacks", json=late, headers=cb), 404, "unknown-task")
        progress = {"type": "progress", "progress": 5, "cursor": "c"}
        fresh = {"callbackId": "gone-late", "attempt": 1, "event": progress}
        error(await gw.client.post("/v1/tasks/gone/callbacks", json=fresh, headers=cb), 404, "unknown-task")
        for key in ("k-gone", "k-other"):  # its receipt went with it
            answer = await gw.client.post("/v1/tasks/gone/deliveries", headers={"Idempotency-Key": key})
            error(answer, 404, "unknown-task")
        listed = (await gw.client.get("/v1/tasks")).json()
        assert [t["id"] for t in listed["tasks"]] == ["recent"]
        error(await gw.client.get("/v1/tasks/gone/stream", headers=sub), 404, "unknown-task")
        with anyio.fail_after(10):
            async with socket(ws_url(gw, "/v1/tasks/gone/ws", cursor=2, token=gone.subscribe_token)) as ws:
                frames, closed = await closed_with(ws)
            assert [(f["type"], f["code"]) for f in frames] == [("error", "unknown-task")]
            assert closed == 4404
            async with socket(ws_url(gw, "/v1/ws")) as ws:
                subscribe = {
                    "type": "subscribe",
                    "taskId": "gone",
                    "cursor": 2,
                    "token": gone.subscribe_token,
                }
                await ws.send(orjson.dumps(subscribe).decode())
                frame = await recv_frame(ws)
                assert (frame["type"], frame["code"], frame["taskId"]) == ("error", "unknown-task", "gone")
        await drain_and_expect(gw, [])  # its notification went with it, and was not drained twice
        text = await metrics(gw)
        assert metric(text, "gateway_finished_tasks_deleted_total") == 1
        assert metric(text, "gateway_finished_tasks_held") == 0
        # The id is free again: a new task of that name is a new task, with a history of its own.
        again = await create_task(gw, "gone")
        assert again.task["state"] == "queued" and again.task["version"] == 0


async def test_a_task_whose_notification_nobody_took_is_kept_and_counted_until_drained(
    database_url: str,
) -> None:
    clock = FakeClock()
    async with live_gateway(database_url, clock=clock, retain_finished_s=RETAIN_S) as gw:
        await finish(gw, "drained")
        await drain_and_expect(gw, ["drained"])
        await finish(gw, "held")  # after the drain: nobody has taken its notification
        clock.advance(RETAIN_S * 1000 + 1)

        async def held() -> float:
            return metric(await metrics(gw), "gateway_finished_tasks_held")

        await eventually(held, lambda n: n == 1, "the held task counted")
        error(await gw.client.get("/v1/tasks/drained"), 404, "unknown-task")
        task = (await gw.client.get("/v1/tasks/held")).json()
        assert (task["state"], task["version"]) == ("succeeded", 2)
        # What the drain still needed is there: the held task's notification, once.
        await drain_and_expect(gw, ["held"])
        await eventually(held, lambda n: n == 0, "the held task deleted once drained")
        error(await gw.client.get("/v1/tasks/held"), 404, "unknown-task")


async def test_with_the_relay_a_relayed_notification_counts_as_taken(sqlite_url: str) -> None:
    """With ``GATEWAY_NOTIFY_URL`` set, a task whose notification the receiver took (2xx) is deleted
    without a drain; one the receiver keeps refusing is kept, and counted."""
    refused = webhook_id(Notification("refused", "succeeded", 0, 2))

    async def refuse_one(msg_id: str, attempt: int) -> int:
        return 500 if msg_id == refused else 200

    receiver = Receiver(RELAY_SECRET, refuse_one)
    clock = FakeClock()
    relay: dict[str, Any] = {
        "notify_secret": RELAY_SECRET,
        "notify_retry_min_ms": 20,
        "notify_retry_max_ms": 100,
    }
    async with (
        serving_receiver(receiver) as hook_url,
        live_gateway(sqlite_url, clock=clock, retain_finished_s=RETAIN_S, notify_url=hook_url, **relay) as gw,
    ):
        await finish(gw, "relayed")
        await finish(gw, "refused")
        await receiver.until(lambda: len(receiver.delivered) == 1 and receiver.counts[refused] >= 2)
        clock.advance(RETAIN_S * 1000 + 1)

        async def held() -> float:
            return metric(await metrics(gw), "gateway_finished_tasks_held")

        await eventually(held, lambda n: n == 1, "the refused task counted")
        error(await gw.client.get("/v1/tasks/relayed"), 404, "unknown-task")
        assert (await gw.client.get("/v1/tasks/refused")).status_code == 200


async def test_retention_zero_keeps_every_task(sqlite_url: str) -> None:
    clock = FakeClock()
    async with live_gateway(sqlite_url, clock=clock, retain_finished_s=0) as gw:
        assert gw.gateway.retention is None
        await finish(gw, "old")
        await drain_and_expect(gw, ["old"])
        clock.advance(10 * 365 * 24 * 3600 * 1000)
        assert (await gw.client.get("/v1/tasks/old")).status_code == 200


async def drain_and_expect(gw: Running, task_ids: list[str]) -> None:
    answer = await gw.client.post("/v1/notifications/drain")
    assert answer.status_code == 200, answer.text
    assert [n["taskId"] for n in answer.json()] == task_ids, answer.text


# --- retention racing the writes of a task it deletes ------------------------------------------------


class _PausingTx:
    """A write transaction whose receipt insert waits for ``release`` (after saying so on ``entered``)."""

    def __init__(self, tx: WriteTx, entered: anyio.Event, release: anyio.Event) -> None:
        self._tx = tx
        self._entered = entered
        self._release = release

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tx, name)

    async def insert_receipt(self, receipt: Receipt) -> None:
        self._entered.set()
        await self._release.wait()
        await self._tx.insert_receipt(receipt)


async def test_a_retention_pass_gives_each_database_round_the_configured_deadline(sqlite_url: str) -> None:
    """``GATEWAY_DB_DEADLINE_MS`` bounds retention's rounds as it bounds every other (a stop waits for a
    batch under way, so a longer one would hold a stop up past what the operator set)."""
    async with live_gateway(sqlite_url, retain_finished_s=RETAIN_S, db_deadline_ms=300) as gw:
        retention = gw.gateway.retention
        assert retention is not None
        store = gw.gateway.store
        budgets: list[float] = []  # the time each round of a pass was given, as it began

        async def measured(work: Callable[[WriteTx], Awaitable[Any]], *, urgent: bool = False) -> Any:
            budgets.append(anyio.current_effective_deadline() - anyio.current_time())
            return await transact(work, urgent=urgent)

        transact = store.transact
        store.transact = measured  # type: ignore[method-assign]
        try:
            await retention.sweep()
        finally:
            del store.transact
        assert budgets and all(0 < budget <= 0.3 for budget in budgets), budgets


@pytest.fixture
def postgres_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


@pytest.mark.postgres
async def test_a_delivery_racing_retention_leaves_no_receipt_of_a_deleted_task(postgres_url: str) -> None:
    """PostgreSQL runs a delivery and a retention pass at once: the delivery locks the task it read, so
    that the pass skips it rather than deleting it under the delivery, whose receipt would then outlive
    its task forever (nothing deletes a receipt of no task)."""
    clock = FakeClock()
    async with opened(SqlStore(Database(postgres_url))) as store:
        book = Book(store, clock)
        await book.create("t", 60_000, 1)
        await book.callback("t", lambda now: Start(now, "w"))
        await book.callback("t", lambda now: Succeed(now, "s3://r", "sha256:1"), attempt=1)
        assert [n.task_id for n in (await book.drain(notifications_body)).taken] == ["t"]
        clock.advance(RETAIN_S * 1000)
        retention = Retention(store, clock, RETAIN_S, relay=False)
        entered, release = anyio.Event(), anyio.Event()
        transact = store.transact

        async def paused(work: Callable[[WriteTx], Awaitable[Any]], *, urgent: bool = False) -> Any:
            return await transact(lambda tx: work(_PausingTx(tx, entered, release)), urgent=urgent)

        async with anyio.create_task_group() as tg:
            store.transact = paused  # type: ignore[method-assign]
            tg.start_soon(book.deliver, "t", "k-1")
            with anyio.fail_after(10):
                await entered.wait()
            del store.transact  # the class's own again: retention's pass is not paused
            try:
                deleted = await retention.sweep()
            finally:
                release.set()
        assert deleted == 0  # the task was locked by the delivery: skipped
        assert await retention.sweep() == 1
        async with store.write() as tx:
            assert await tx.receipt("k-1") is None
            assert await tx.task("t") is None
