"""Scale-out: several gateway processes on one PostgreSQL database.

Each gateway here is a real ``gateway serve`` process (tests/support/processes.py). News of each committed
entry travels between them on the bus (LISTEN/NOTIFY on the database, or Redis pub/sub), and each process's
hub
fills from the store whatever the bus missed. What is asserted:

- fan-out is exact across processes: a subscriber on any process sees every entry of its task once, in
  order, whichever process committed it, and ends at the task's final state with a 1000 close;
- a process killed mid-run (SIGKILL) loses nothing: subscribers that were on it resume elsewhere with their
  cursor, and every callback answered 2xx is in its task's history exactly once;
- expiry runs in every process and expires each task once, with one notification;
- ``gateway serve --workers N`` runs N processes on one port, which stop together on SIGTERM;
- on SQLite a second process is refused in one line.
"""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from websockets.asyncio.client import connect

from tests.integration.test_live_support import STEP_S, StreamCheck, loads, read_to_close
from tests.support import GATEWAY_CLI, eventually, http_client, postgres_database
from tests.support.history import History
from tests.support.processes import (
    STARTUP_COMPLETE,
    CallbackPoster,
    GatewayProcess,
    ResumingSubscriber,
    alive,
    assert_history_is,
    free_port,
    gateway_environ,
    gateway_processes,
    print_tails,
    redis_or_skip,
    round_robin_balancer,
    socket_owner,
    spawn_gateway,
    start_all,
    task_callbacks,
)

pytestmark = pytest.mark.anyio

REDIS_URL = "redis://127.0.0.1:6379/0"
# GATEWAY_BUS_URL for each bus: unset is LISTEN/NOTIFY on the gateway's PostgreSQL database.
BUSES = [pytest.param(None, id="postgres"), pytest.param(REDIS_URL, id="redis")]
# Bounds a whole test (process start-up included); each aims at well under it.
TEST_S = 90.0
# A worker's progress steps in the fan-out test: start, these 11, succeed.
FAN_OUT_PROGRESS = range(9, 100, 9)


@pytest.fixture
def pg_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


def random_gateway(gws: list[GatewayProcess], rng: random.Random) -> Callable[[], str]:
    return lambda: rng.choice(gws).url


async def bus_environ(bus: str | None) -> dict[str, str]:
    if bus is None:
        return {}
    await redis_or_skip(bus)
    return {"GATEWAY_BUS_URL": bus}


def unique(prefix: str) -> str:
    """Task ids are unique per run: a Redis channel is shared by every gateway that uses that Redis."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def create(client: httpx.AsyncClient, url: str, task_id: str, ttl_ms: int = 600_000) -> dict[str, Any]:
    answer = await client.post(f"{url}/v1/tasks", json={"id": task_id, "ttlMs": ttl_ms, "maxAttempts": 2})
    assert answer.status_code == 201, answer.text
    return dict(answer.json())


async def get_task(client: httpx.AsyncClient, url: str, task_id: str) -> dict[str, Any]:
    answer = await client.get(f"{url}/v1/tasks/{task_id}")
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


async def history(client: httpx.AsyncClient, url: str, task_id: str) -> dict[str, Any]:
    answer = await client.get(f"{url}/v1/tasks/{task_id}/events", params={"cursor": 0})
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


async def drain(client: httpx.AsyncClient, url: str) -> list[dict[str, Any]]:
    answer = await client.post(f"{url}/v1/notifications/drain")
    assert answer.status_code == 200, answer.text
    return list(answer.json())


# --- fan-out across processes -------------------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize("bus", BUSES)
async def test_three_processes_fan_out_exactly(bus: str | None, pg_url: str, tmp_path: Path) -> None:
    env = await bus_environ(bus)
    run = unique("fan")
    started = time.monotonic()
    with anyio.fail_after(TEST_S):
        async with (
            gateway_processes(3, pg_url, tmp_path, env=env) as gws,
            http_client(timeout=STEP_S) as client,
        ):
            made = [await create(client, gws[i % 3].url, f"{run}-{i}") for i in range(10)]
            # Subscriber i watches task i % 10 on process i % 3: every task is watched on every process.
            subscribers = [
                ResumingSubscriber(gws[i % 3].ws_url, m["task"]["id"], m["subscribeToken"], m["task"])
                for i in range(30)
                for m in [made[i % 10]]
            ]
            # Each callback goes to a process picked at random (seeded per task: the same picks each run).
            pickers = [random_gateway(gws, random.Random(f"fan-{i}")) for i in range(len(made))]
            posters = [
                CallbackPoster(client, m["task"]["id"], m["callbackToken"], pick)
                for m, pick in zip(made, pickers, strict=True)
            ]
            async with anyio.create_task_group() as tg:
                await start_all(tg, subscribers)
                async with anyio.create_task_group() as workers:
                    for poster in posters:
                        workers.start_soon(poster.run, task_callbacks(poster.task_id, FAN_OUT_PROGRESS))
            finals = {m["task"]["id"]: await get_task(client, gws[0].url, m["task"]["id"]) for m in made}

    for poster in posters:
        assert poster.answers == {"200": 2 + len(FAN_OUT_PROGRESS)}, poster.answers
        assert finals[poster.task_id]["state"] == "succeeded"
    assert {url for p in posters for url in p.posted_to} == {gw.url for gw in gws}
    for subscriber in subscribers:
        final = finals[subscriber.task_id]
        subscriber.assert_final(final)
        # One connection: the resume frame at version 0, then every entry as an event, closed with 1000.
        assert subscriber.connections == 1 and subscriber.closes == [1000], subscriber.closes
        assert subscriber.resumes == ["caught-up"], subscriber.resumes
        assert subscriber.events == list(range(1, final["version"] + 1)), subscriber.events
    print(f"\nfan-out over 3 processes ({bus or 'postgres'}): {time.monotonic() - started:.1f}s")


# --- a process killed mid-run -------------------------------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.parametrize("bus", BUSES)
async def test_a_process_killed_mid_run_loses_nothing(bus: str | None, pg_url: str, tmp_path: Path) -> None:
    # Retention over the longest history: a resume is a delta, and the whole history reads as one.
    env = {**await bus_environ(bus), "GATEWAY_RETENTION_VERSIONS": "1000"}
    run = unique("kill")
    seen = History()
    tasks, per_task = 4, 3
    kill_after = 6  # callbacks answered per task (of 21) before the kill
    started = time.monotonic()
    with anyio.fail_after(TEST_S):
        async with (
            gateway_processes(3, pg_url, tmp_path, env=env) as gws,
            round_robin_balancer([gw.port for gw in gws]) as lb,
            http_client(timeout=STEP_S) as client,
        ):
            made = [await create(client, gws[0].url, f"{run}-{i}") for i in range(tasks)]
            for m in made:
                seen.created(m["task"])
            subscribers = [
                ResumingSubscriber(
                    lb.ws_url,
                    m["task"]["id"],
                    m["subscribeToken"],
                    m["task"],
                    retention=1000,
                    history=seen,
                    name=f"sub-{i}-{j}",
                )
                for i, m in enumerate(made)
                for j in range(per_task)
            ]
            # A client per worker, so that their keep-alive connections spread over the processes too.
            worker_clients = [http_client() for _ in made]
            posters = [
                CallbackPoster(
                    c, m["task"]["id"], m["callbackToken"], lambda: lb.url, timeout_s=5.0, history=seen
                )
                for c, m in zip(worker_clients, made, strict=True)
            ]
            halfway = anyio.Event()

            def check_halfway() -> None:
                if all(len(p.applied) >= kill_after for p in posters):
                    halfway.set()

            victim: GatewayProcess | None = None
            victim_sockets = victim_connections = applied_at_kill = 0
            try:
                async with anyio.create_task_group() as tg:
                    await start_all(tg, subscribers)
                    for poster in posters:
                        calls = task_callbacks(poster.task_id, range(5, 100, 5))
                        tg.start_soon(partial(poster.run, calls, pace_s=0.02, after_each=check_halfway))
                    with anyio.fail_after(STEP_S * 2):
                        await halfway.wait()
                    # The process serving the most subscribers, as the balancer counts them.
                    port = lb.busiest()
                    victim_sockets, victim_connections = lb.websockets()[port], lb.connections()[port]
                    victim = next(gw for gw in gws if gw.port == port)
                    applied_at_kill = sum(len(p.applied) for p in posters)
                    await victim.kill()
                    killed_at = time.monotonic()
            finally:
                for c in worker_clients:
                    await c.aclose()
            recovered_s = time.monotonic() - killed_at
            assert victim is not None
            survivor = next(gw for gw in gws if gw is not victim)
            assert all(gw.running for gw in gws if gw is not victim), "only the victim may be gone"
            finals = {m["task"]["id"]: await get_task(client, survivor.url, m["task"]["id"]) for m in made}
            histories = {m["task"]["id"]: await history(client, survivor.url, m["task"]["id"]) for m in made}
            for item in await drain(client, survivor.url):
                seen.notification(item)

    for task_id, entries in histories.items():
        seen.final(task_id, entries)
    seen.check()  # tests/support/history.py: the invariants over every frame and answer the clients saw
    assert victim_sockets >= 1
    assert applied_at_kill < sum(len(p.applied) for p in posters), "the kill came after the run"
    for poster in posters:
        assert finals[poster.task_id]["state"] == "succeeded", finals[poster.task_id]
        assert poster.server_errors == [], poster.server_errors
        assert_history_is(histories[poster.task_id], poster.applied)
    for subscriber in subscribers:
        subscriber.assert_final(finals[subscriber.task_id])
    moved = sum(s.connections > 1 for s in subscribers)
    assert moved >= victim_sockets, (moved, victim_sockets, [s.closes for s in subscribers])
    answers = sum((p.answers for p in posters), start=Counter[str]())
    print(
        f"\nkilled {victim.name} serving {victim_sockets} subscribers of {victim_connections} connections "
        f"({bus or 'postgres'}): {moved} "
        f"resumed elsewhere; all done {recovered_s:.1f}s after the kill; callback answers {dict(answers)}, "
        f"{sum(p.duplicates for p in posters)} duplicateCallback; balancer skipped the victim "
        f"{lb.refused[victim.port]} times; resumes "
        f"{sorted({r for s in subscribers for r in s.resumes[1:]})}; {time.monotonic() - started:.1f}s in all"
    )


# --- expiry in every process --------------------------------------------------------------------------------


@pytest.mark.postgres
async def test_short_ttls_expire_once_across_three_processes(pg_url: str, tmp_path: Path) -> None:
    run = unique("ttl")
    started = time.monotonic()
    with anyio.fail_after(TEST_S):
        async with (
            gateway_processes(3, pg_url, tmp_path) as gws,
            http_client(timeout=STEP_S) as client,
        ):
            made = [
                await create(client, gws[i % 3].url, f"{run}-{i}", ttl_ms=1000 + 50 * i) for i in range(10)
            ]
            ids = [m["task"]["id"] for m in made]
            # A client holding no subscription has no event to wait on for an expiry: poll each task (GET)
            # until it is expired, within the deadline (1.5 s of TTL, then a sweep interval, with room).
            deadline = anyio.current_time() + 15

            async def expired(url: str, task_id: str) -> None:
                await eventually(
                    lambda: get_task(client, url, task_id),
                    lambda task: task["state"] == "expired",
                    f"{task_id} expired, seen on {url}",
                    within_s=max(0.0, deadline - anyio.current_time()),
                    poll_s=0.05,
                )

            for i, task_id in enumerate(ids):
                await expired(gws[(i + 1) % 3].url, task_id)
            for i, m in enumerate(made):
                entries = await history(client, gws[(i + 2) % 3].url, ids[i])
                assert entries["mode"] == "delta", entries
                assert entries["events"] == [
                    {"version": 1, "event": {"type": "expire", "atMs": m["task"]["expiresAtMs"]}}
                ], entries
            first = await drain(client, gws[0].url)
            second = await drain(client, gws[1].url)
            third = await drain(client, gws[2].url)

            async def sweeper_counts() -> list[int]:
                return [await sweeper_count(client, gw.url) for gw in gws]

            # A sweeper counts what it expired after the commit (on its own thread): a GET on another
            # process can see a task expired a moment before. Wait for the counts, then judge them.
            swept = await eventually(
                sweeper_counts,
                lambda counts: sum(counts) >= len(ids),
                f"the {len(ids)} expiries counted by the sweepers (gateway_tasks_expired_by_sweeper_total)",
            )
            seen = History()
            for i, m in enumerate(made):
                seen.created(m["task"])
                seen.final(ids[i], await history(client, gws[i % 3].url, ids[i]))
            for item in first + second + third:
                seen.notification(item)
            seen.check()

    deadlines = {m["task"]["id"]: m["task"]["expiresAtMs"] for m in made}
    assert sorted(n["taskId"] for n in first) == sorted(ids), first
    for n in first:
        assert n == {"taskId": n["taskId"], "state": "expired", "atMs": deadlines[n["taskId"]], "version": 1}
    assert second == [] and third == []
    assert sum(swept) == len(ids), swept  # each task expired by exactly one process's sweeper
    print(f"\nexpired by process: {swept}; {time.monotonic() - started:.1f}s")


async def sweeper_count(client: httpx.AsyncClient, url: str) -> int:
    answer = await client.get(f"{url}/metrics")
    assert answer.status_code == 200, answer.text
    for line in answer.text.splitlines():
        if line.startswith("gateway_tasks_expired_by_sweeper_total "):
            return int(float(line.split()[1]))
    raise AssertionError(f"no sweeper counter in {url}/metrics")


# --- gateway serve --workers --------------------------------------------------------------------------------


@pytest.mark.postgres
async def test_workers_flag_runs_several_processes(pg_url: str, tmp_path: Path) -> None:
    # A free port picked here (--port 0 works too: tests/integration/test_workers_spread.py).
    port = free_port()
    url, ws_base = f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}"
    task_id = unique("workers")
    # No GATEWAY_SECRET: the workers must still share one (made by the parent), or a token issued by one
    # worker would be refused by the other.
    parent = await spawn_gateway(
        "workers",
        pg_url,
        tmp_path / "workers.log",
        port=port,
        args=["--workers", "2"],
        env={"GATEWAY_SECRET": ""},
    )
    failed = False
    try:
        with anyio.fail_after(TEST_S):
            await parent.wait_for(STARTUP_COMPLETE, count=2)
            pids = parent.started_pids()
            assert len(set(pids)) == 2 and parent.pid not in pids, pids
            # What it runs on is said once, by the parent, not once per worker.
            said = [line for line in parent.output().splitlines() if "gateway: dashboard at" in line]
            assert said == [f"INFO:     gateway: dashboard at {url}/"], parent.output()
            assert parent.output().count("gateway: database PostgreSQL") == 1, parent.output()

            async with http_client(timeout=STEP_S) as client:
                made = await create(client, url, task_id)
            sub_url = f"{ws_base}/v1/tasks/{task_id}/ws?cursor=0&token={made['subscribeToken']}"
            async with connect(sub_url, open_timeout=STEP_S, close_timeout=2) as ws:
                check = StreamCheck(task_id, 0, base=made["task"])
                with anyio.fail_after(STEP_S):
                    check.feed(loads(await ws.recv()))
                subscriber_pid = socket_owner(port, ws.local_address[1], pids)
                assert subscriber_pid in pids, (subscriber_pid, pids)

                # New connections until one is served by the other worker (the kernel hands each accept to
                # one of the processes waiting on the shared socket); its callbacks are all posted on it.
                clients: list[httpx.AsyncClient] = []
                other: httpx.AsyncClient | None = None
                client_port = 0
                try:
                    for _ in range(100):
                        candidate = http_client(base_url=url, timeout=STEP_S)
                        clients.append(candidate)
                        answer = await candidate.get("/healthz")
                        client_port = answer.extensions["network_stream"].get_extra_info("client_addr")[1]
                        if socket_owner(port, client_port, pids) not in (None, subscriber_pid):
                            other = candidate
                            break
                    assert other is not None, "no connection was served by the second worker"
                    # "": the URL is the path alone, resolved against that client's base_url.
                    poster = CallbackPoster(other, task_id, made["callbackToken"], lambda: "")
                    await poster.run(task_callbacks(task_id, range(10, 100, 10)))
                    # Every callback went over that one keep-alive connection, to the other worker.
                    answer = await other.get("/healthz")
                    assert answer.extensions["network_stream"].get_extra_info("client_addr")[1] == client_port
                    final = (await other.get(f"/v1/tasks/{task_id}")).json()
                finally:
                    for c in clients:
                        await c.aclose()
                with anyio.fail_after(STEP_S):
                    code = await read_to_close(ws, check)
            assert poster.answers == {"200": 11}, poster.answers
            assert code == 1000
            check.assert_final(final)
            assert check.event_versions == list(range(1, final["version"] + 1))

            parent.process.send_signal(signal.SIGTERM)
            stop_started = time.monotonic()
            with anyio.fail_after(20):
                await parent.process.wait()
            stopped_in = time.monotonic() - stop_started
            assert parent.process.returncode == 0, parent.tail()
            assert not [pid for pid in pids if alive(pid)], "a worker outlived its parent"
            print(
                f"\nworkers {pids}: subscriber on {subscriber_pid}, callbacks on the other; "
                f"stopped in {stopped_in:.1f}s"
            )
    except BaseException:
        failed = True
        raise
    finally:
        await parent.stop()
        if failed:
            print_tails([parent])


async def test_workers_that_cannot_start_stop_the_gateway_instead_of_looping(tmp_path: Path) -> None:
    """A database nobody serves (a typo in the URL): the workers fail at start, and so would every restart,
    so the gateway stops with uvicorn's start-up failure code rather than restart them for ever."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        nobody = s.getsockname()[1]  # closed again: nothing listens there
    url = f"postgresql://postgres@127.0.0.1:{nobody}/gateway"
    with anyio.fail_after(TEST_S):
        result = await anyio.run_process(
            [*GATEWAY_CLI, "serve", "--workers", "2", "--port", str(free_port()), "--database-url", url],
            check=False,
            env=gateway_environ(),
            cwd=tmp_path,
        )
    output = (result.stdout + result.stderr).decode(errors="replace")
    assert result.returncode == 3, output
    assert "could not start" in output, output
    assert output.count("starting it again") == 0, output


# --- SQLite: one process ------------------------------------------------------------------------------------


async def test_two_processes_on_one_sqlite_file_the_second_is_refused_in_one_line(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'gateway.db'}"
    env = gateway_environ()
    with anyio.fail_after(TEST_S):
        async with gateway_processes(1, url, tmp_path) as (first,):
            second = await anyio.run_process(
                [*GATEWAY_CLI, "serve", "--port", "0", "--database-url", url],
                check=False,
                env=env,
                cwd=tmp_path,
            )
            assert_refused_in_one_line(second)
            assert first.running, "the first gateway must keep running"

        other = f"sqlite:///{tmp_path / 'other.db'}"
        workers = await anyio.run_process(
            [*GATEWAY_CLI, "serve", "--workers", "2", "--port", "0", "--database-url", other],
            check=False,
            env=env,
            cwd=tmp_path,
        )
        assert_refused_in_one_line(workers)


def assert_refused_in_one_line(result: subprocess.CompletedProcess[bytes]) -> None:
    output = (result.stdout + result.stderr).decode(errors="replace")
    assert result.returncode != 0, output
    lines = output.strip("\n").split("\n")
    assert len(lines) == 1 and lines[0].strip(), output
    assert "PostgreSQL" in lines[0] and "Traceback" not in output, output
