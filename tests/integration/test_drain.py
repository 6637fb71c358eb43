"""``POST /v1/notifications/drain`` as a backend meets it: a batch at a time (``?limit=``, ``Drain-More``),
the same ``Idempotency-Key`` answering the same bytes, bad limits and keys refused with nothing drained,
and a backend behind a proxy that loses 30% of the answers: with its key it receives every notification
once; without one it loses some (at most once, as docs/protocol.md says).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import asyncpg  # type: ignore[import-untyped]  # no stubs, no py.typed (as in gateway/store/database.py)
import httpx
import orjson
import pytest

from gateway.book.drain import KEEP_MS, MAX_LIMIT
from tests.support import (
    FakeClock,
    Running,
    create_task,
    error,
    post_callback,
    postgres_database,
    running_gateway,
    wait_until,
)
from tests.support.lossy_proxy import LossyProxy

pytestmark = pytest.mark.anyio

DRAIN = "/v1/notifications/drain"
START = {"type": "start", "worker": "w"}
FAIL = {"type": "fail", "error": "e", "retryable": False}


async def finish(gw: Running, *task_ids: str) -> None:
    """Each task created, started and failed, in this order: one notification each."""
    for task_id in task_ids:
        made = await create_task(gw, task_id, max_attempts=1)
        await post_callback(gw, task_id, made.callback_token, START)
        assert (await post_callback(gw, task_id, made.callback_token, FAIL))["notify"]


def ids(answer: httpx.Response) -> list[str]:
    assert answer.status_code == 200, answer.text
    return [n["taskId"] for n in answer.json()]


async def test_a_batch_takes_the_oldest_up_to_its_limit_and_drain_more_says_what_is_left(
    database_url: str, clock: FakeClock
) -> None:
    async with running_gateway(database_url, clock=clock, sweep_interval_ms=0) as gw:
        await finish(gw, "e", "d", "c", "b", "a")
        first = await gw.client.post(DRAIN, params={"limit": 2})
        # The two oldest, listed by task id.
        assert (ids(first), first.headers["Drain-More"]) == (["d", "e"], "true")
        second = await gw.client.post(DRAIN, params={"limit": 2}, headers={"Idempotency-Key": "k"})
        assert (ids(second), second.headers["Drain-More"]) == (["b", "c"], "true")
        # Fewer than the limit: nothing was left.
        last = await gw.client.post(DRAIN)
        assert (ids(last), last.headers["Drain-More"]) == (["a"], "false")
        empty = await gw.client.post(DRAIN, params={"limit": MAX_LIMIT})
        assert (ids(empty), empty.headers["Drain-More"]) == ([], "false")


async def test_bad_limits_and_keys_are_refused_and_drain_nothing(database_url: str, clock: FakeClock) -> None:
    async with running_gateway(database_url, clock=clock, sweep_interval_ms=0) as gw:
        await finish(gw, "t")
        for limit in ("0", "-1", str(MAX_LIMIT + 1), "abc", "1.5", "", "1e3", "9" * 30):
            message = error(await gw.client.post(DRAIN, params={"limit": limit}), 400, "invalid-request")
            assert message.startswith("limit:"), (limit, message)
        message = error(await gw.client.post(f"{DRAIN}?limit=1&limit=2"), 400, "invalid-request")
        assert message == "limit: given more than once"
        message = error(await gw.client.post(DRAIN, params={"limt": "5"}), 400, "invalid-request")
        assert "limt" in message
        overlong = {"Idempotency-Key": "k" * 257}
        message = error(await gw.client.post(DRAIN, headers=overlong), 400, "invalid-request")
        assert "Idempotency-Key" in message
        # Empty, and U+00A0 (a JavaScript blank; HTTP strips spaces and tabs around a value itself).
        for blank in (b"", b"\xa0"):
            answer = await gw.client.post(DRAIN, headers={b"Idempotency-Key": blank})
            assert "idempotency" in error(answer, 400, "invalid-request").lower()
        # Nothing was drained, nor kept under a key.
        longest = {"Idempotency-Key": "k" * 256}
        assert ids(await gw.client.post(DRAIN, headers=longest, params={"limit": MAX_LIMIT})) == ["t"]
        assert ids(await gw.client.post(DRAIN, headers=longest)) == ["t"]


async def test_a_body_the_drain_does_not_know_is_refused_and_drains_nothing(
    sqlite_url: str, clock: FakeClock
) -> None:
    """A drain takes no fields (its limit is in the query): a field is refused as on every route, with or
    without a key, and nothing is drained or kept under the key. No body, or ``{}``, is a drain."""
    async with running_gateway(sqlite_url, clock=clock, sweep_interval_ms=0) as gw:
        await finish(gw, "a", "b")
        for key in (None, "k"):
            headers = {} if key is None else {"Idempotency-Key": key}
            for body, says in [
                ({"x": 1}, "x: unknown field"),
                ({"limit": 1}, "limit: unknown field (the drain's limit goes in the query: ?limit=)"),
                ([], "body: must be a JSON object"),
                ("null", "body: must be a JSON object"),
            ]:
                content = body.encode() if isinstance(body, str) else orjson.dumps(body)
                answer = await gw.client.post(DRAIN, content=content, headers=headers)
                assert error(answer, 400, "invalid-request") == says, (key, body)
            answer = await gw.client.post(DRAIN, content=b'{"x": ', headers=headers)
            assert error(answer, 400, "invalid-request").startswith("malformed JSON"), key
            form = {**headers, "Content-Type": "text/plain"}
            answer = await gw.client.post(DRAIN, content=b"x=1", headers=form)
            error(answer, 415, "unsupported-media-type")
        # Nothing was drained, nor kept under "k": the key takes the batch now, with {} for a body.
        first = await gw.client.post(DRAIN, json={}, headers={"Idempotency-Key": "k"}, params={"limit": 1})
        assert (ids(first), first.headers["Drain-More"]) == (["a"], "true")
        assert ids(await gw.client.post(DRAIN)) == ["b"]


async def test_the_same_key_answers_the_same_bytes_for_a_day_whatever_was_drained_since(
    database_url: str, clock: FakeClock
) -> None:
    async with running_gateway(database_url, clock=clock, sweep_interval_ms=0) as gw:
        await finish(gw, "a", "b")
        k1 = {"Idempotency-Key": "k1"}
        first = await gw.client.post(DRAIN, headers=k1, params={"limit": 1})
        assert (ids(first), first.headers["Drain-More"]) == (["a"], "true")
        await finish(gw, "c")
        assert ids(await gw.client.post(DRAIN)) == ["b", "c"]
        clock.advance(KEEP_MS - 1)
        # Another limit changes nothing: the key's batch was made.
        again = await gw.client.post(DRAIN, headers=k1, params={"limit": 50})
        assert (again.content, again.headers["Drain-More"]) == (first.content, "true")
        assert ids(await gw.client.post(DRAIN, headers={"Idempotency-Key": "k2"})) == []
        # A day after it was made, the key is new again.
        clock.advance(1)
        await finish(gw, "d")
        assert ids(await gw.client.post(DRAIN, headers=k1)) == ["d"]


async def test_drains_at_once_with_one_key_answer_one_batch_and_other_keys_never_the_same(
    database_url: str, clock: FakeClock
) -> None:
    async with running_gateway(database_url, clock=clock, sweep_interval_ms=0) as gw:
        task_ids = [f"n-{i:02d}" for i in range(24)]
        await finish(gw, *task_ids)
        shared: list[bytes] = []
        taken: list[str] = []

        async def drain(key: str, into: list[Any]) -> None:
            answer = await gw.client.post(DRAIN, headers={"Idempotency-Key": key}, params={"limit": 4})
            assert answer.status_code == 200, answer.text
            into.append(answer.content if into is shared else ids(answer))

        async with anyio.create_task_group() as tg:
            for _ in range(6):
                tg.start_soon(drain, "shared", shared)
        assert len(shared) == 6 and len(set(shared)) == 1
        batches: list[list[str]] = []
        async with anyio.create_task_group() as tg:
            for n in range(6):
                tg.start_soon(drain, f"own-{n}", batches)
        taken = [task_id for batch in batches for task_id in batch]
        assert len(taken) == len(set(taken)) == 20
        assert sorted(taken) == sorted(set(task_ids) - {n["taskId"] for n in orjson.loads(shared[0])})


# --- PostgreSQL: rows another transaction holds ----------------------------------------------------------


@pytest.fixture
def postgres_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


async def test_on_postgresql_a_short_batch_says_nothing_is_left_while_another_transaction_holds_the_rest(
    postgres_url: str, clock: FakeClock
) -> None:
    """A drain skips the notifications another transaction holds (another drain taking them; the relay
    recording a send): a batch shorter than the limit, empty included, says ``Drain-More: false``, as
    protocol.md has it, and the held ones are the next drain's once let go. A full batch says ``true`` while
    any is left, held ones included: the next drain may then be empty, and says ``false``."""
    async with running_gateway(postgres_url, clock=clock, sweep_interval_ms=0) as gw:
        await finish(gw, "a", "b", "c")
        holder = await asyncpg.connect(postgres_url, timeout=5)
        try:
            held = holder.transaction()
            await held.start()
            await holder.execute("SELECT id FROM outbox WHERE task_id = ANY($1) FOR UPDATE", ["b", "c"])
            short = await gw.client.post(DRAIN, params={"limit": 10})
            assert (ids(short), short.headers["Drain-More"]) == (["a"], "false")
            empty = await gw.client.post(DRAIN, headers={"Idempotency-Key": "k"})
            assert (ids(empty), empty.headers["Drain-More"]) == ([], "false")
            await held.rollback()  # let go: "b" and "c" are there to drain

            held = holder.transaction()
            await held.start()
            await holder.execute("SELECT id FROM outbox WHERE task_id = 'c' FOR UPDATE")
            full = await gw.client.post(DRAIN, params={"limit": 1})
            assert (ids(full), full.headers["Drain-More"]) == (["b"], "true")
            after = await gw.client.post(DRAIN, params={"limit": 1})
            assert (ids(after), after.headers["Drain-More"]) == ([], "false")
            await held.rollback()
        finally:
            await holder.close()
        last = await gw.client.post(DRAIN)
        assert (ids(last), last.headers["Drain-More"]) == (["c"], "false")


# --- through a proxy that loses answers ---------------------------------------------------------------------

TASKS = 1_000
LIMIT = 64
LOSS = 0.3
SEED = 20_261_201


def expired_by_sweeper(gw: Running) -> int:
    value = gw.gateway.metrics.registry.get_sample_value("gateway_tasks_expired_by_sweeper_total")
    return int(value or 0)


def expired_beyond(gw: Running, count: int) -> Callable[[], bool]:
    return lambda: expired_by_sweeper(gw) > count


async def expiring_tasks(gw: Running, task_ids: list[str]) -> None:
    """Each task created with a 1 ms deadline (the sweeper expires it: one notification each), eight at a
    time, while the backend drains."""

    async def make(chunk: list[str]) -> None:
        for task_id in chunk:
            await create_task(gw, task_id, ttl_ms=1, max_attempts=1)

    async with anyio.create_task_group() as tg:
        for n in range(8):
            tg.start_soon(make, task_ids[n::8])


def lossy_client(url: str) -> httpx.AsyncClient:
    """A backend's client through the proxy: a connection per request, as the proxy carries one each."""
    return httpx.AsyncClient(base_url=url, timeout=30, limits=httpx.Limits(max_keepalive_connections=0))


async def drain_until_answered(backend: httpx.AsyncClient, key: str, limit: int) -> httpx.Response:
    """A drain with ``key``, sent again with the same key for as long as no answer comes back."""
    while True:
        try:
            return await backend.post(DRAIN, params={"limit": limit}, headers={"Idempotency-Key": key})
        except httpx.RemoteProtocolError:  # the connection closed without an answer
            continue


async def test_a_backend_retrying_with_its_key_through_a_lossy_proxy_gets_every_notification_once(
    database_url: str, record_property: Callable[[str, object], None]
) -> None:
    """30% of the drain answers are lost after the gateway wrote them (and committed what they drained).
    The backend retries each drain with its key until it gets an answer, then moves on to a new key: it
    receives all 1,000 notifications, none twice, and every answer the gateway gave a key is the same
    bytes."""
    task_ids = [f"task-{i:04d}" for i in range(TASKS)]
    async with running_gateway(database_url) as gw:
        proxy = LossyProxy(int(gw.url.rsplit(":", 1)[1]), loss=LOSS, seed=SEED)
        received: list[str] = []
        answered: dict[str, bytes] = {}  # what the backend got, by key
        async with proxy.running() as url, lossy_client(url) as backend, anyio.create_task_group() as tg:
            tg.start_soon(expiring_tasks, gw, task_ids)
            while True:
                queued = expired_by_sweeper(gw)  # notifications committed before this drain
                key = f"drain-{len(answered)}"
                answer = await drain_until_answered(backend, key, LIMIT)
                answered[key] = answer.content
                received += ids(answer)
                if len(ids(answer)) == LIMIT:
                    continue
                # A short batch: nothing was left to drain when it was made.
                if queued == TASKS:
                    break
                await wait_until(expired_beyond(gw, queued), "another task expired")
            final = await drain_until_answered(backend, "after", LIMIT)
        assert not proxy.errors
        assert sorted(received) == task_ids  # every one, none twice across keys
        assert (ids(final), final.headers["Drain-More"]) == ([], "false")
        by_key: defaultdict[str | None, set[bytes]] = defaultdict(set)
        for carried in proxy.carried:
            assert carried.status == 200
            by_key[carried.idempotency_key].add(carried.body)
        assert {key: bodies for key, bodies in by_key.items() if key != "after"} == {
            key: {body} for key, body in answered.items()
        }
        lost = sum(not c.delivered for c in proxy.carried)
        assert lost > 0
        record_property("drain_keys", len(answered))
        record_property("answers_lost", lost)
        replays = gw.gateway.metrics.registry.get_sample_value("gateway_drain_replays_total")
        assert replays == lost  # every retry answered the kept batch, none took anew


async def test_a_drain_without_a_key_through_the_same_proxy_loses_notifications(database_url: str) -> None:
    """At most once: a lost answer's notifications were drained and are gone; the next drain gets the
    others, never those."""
    task_ids = [f"task-{i:03d}" for i in range(200)]
    async with running_gateway(database_url) as gw:
        proxy = LossyProxy(int(gw.url.rsplit(":", 1)[1]), loss=LOSS, seed=SEED)
        async with proxy.running() as url, lossy_client(url) as backend:
            await expiring_tasks(gw, task_ids)
            await wait_until(lambda: expired_by_sweeper(gw) == len(task_ids), "every task expired")
            received: list[str] = []
            while True:
                try:
                    answer = await backend.post(DRAIN, params={"limit": 10})
                except httpx.RemoteProtocolError:
                    continue
                received += ids(answer)
                if answer.headers["Drain-More"] == "false":
                    break
        assert not proxy.errors
        lost = [n["taskId"] for c in proxy.carried if not c.delivered for n in orjson.loads(c.body)]
        assert lost, "no answer with notifications was lost: the test proved nothing"
        assert sorted(received + lost) == task_ids
        assert not set(received) & set(lost)
