"""``gateway serve --workers N`` as an operator meets it when workers die: each worker slot is restarted
on a backoff of its own, and a worker that starts while PostgreSQL is down says so in one line.

Real processes: the parent and its workers (tests/support/processes.py), on this machine's PostgreSQL or on a
throwaway cluster of the test's own that it stops and starts.
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest

from tests.support import STEP_S, bearer, http_client, postgres_database
from tests.support.processes import (
    STARTUP_COMPLETE,
    GatewayProcess,
    alive,
    free_port,
    print_tails,
    spawn_gateway,
    throwaway_postgres,
)

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TEST_S = 120.0
# A worker's life after which its slot's backoff starts over, longer than any test.
STABLE_FOR_EVER_S = 24 * 3600
# The parent's line for a worker that exited: which slot, which pid, the restart delay it chose.
EXITED = re.compile(rb"worker (\d+) \(pid (\d+)\) exited with (-?\d+); starting it again in (\d+) s")
# A line of a gateway process's log: every one starts with its level (nothing spans several lines).
LOG_LINE = re.compile(r"^(TRACE|DEBUG|INFO|WARNING|ERROR|CRITICAL):\s")


@pytest.fixture
def pg_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


def live_pids(parent: GatewayProcess) -> list[int]:
    """The worker processes the parent's output announced that are alive now, oldest first."""
    return [pid for pid in parent.started_pids() if pid != parent.pid and alive(pid)]


async def kill_worker(parent: GatewayProcess, pid: int) -> tuple[int, int]:
    """SIGKILL one worker (as the OOM killer would); the slot the parent says it held and the restart delay
    it announced."""
    exits = len(EXITED.findall(parent.log.read_bytes()))
    os.kill(pid, signal.SIGKILL)
    *_, said = await parent.wait_for(EXITED, count=exits + 1)
    assert int(said.group(2)) == pid, said.group(0)
    return int(said.group(1)), int(said.group(4))


async def test_each_worker_slot_backs_off_on_its_own(pg_url: str, tmp_path: Path) -> None:
    """One worker that keeps dying backs off (1 s, then 2 s); a worker of another slot that dies for the
    first time is started again after 1 s, not after the first one's backoff; every slot comes back.

    A worker that lived ``GATEWAY_WORKER_STABLE_S`` resets its slot's backoff: set here far longer than the
    test, so that however slowly a restarted worker starts on this machine, its death still counts as its
    slot's second in a row."""
    parent = await spawn_gateway(
        "workers",
        pg_url,
        tmp_path / "workers.log",
        env={"GATEWAY_WORKER_STABLE_S": str(STABLE_FOR_EVER_S)},
        port=free_port(),
        args=["--workers", "3"],
    )
    failed = False
    try:
        with anyio.fail_after(TEST_S):
            await parent.wait_for(STARTUP_COMPLETE, count=3)
            started = 3
            slot, delay = await kill_worker(parent, live_pids(parent)[0])
            assert delay == 1, parent.tail()
            started += 1
            await parent.wait_for(STARTUP_COMPLETE, count=started)
            # The slot's new process is the one started last.
            again, delay = await kill_worker(parent, live_pids(parent)[-1])
            assert (again, delay) == (slot, 2), parent.tail()
            started += 1
            await parent.wait_for(STARTUP_COMPLETE, count=started)
            delays: dict[int, int] = {}
            for pid in live_pids(parent)[:2]:  # the workers of the two other slots, started at launch
                other, delay = await kill_worker(parent, pid)
                delays[other] = delay
            assert delays == {other: 1 for other in {0, 1, 2} - {slot}}, parent.tail()
            started += 2
            await parent.wait_for(STARTUP_COMPLETE, count=started)
            assert len(live_pids(parent)) == 3, parent.tail()
    except BaseException:
        failed = True
        raise
    finally:
        await parent.stop()
        if failed:
            print_tails([parent])


async def test_a_worker_that_starts_while_postgres_is_down_says_so_in_one_line(tmp_path: Path) -> None:
    """PostgreSQL stops under ``--workers 2``; a worker killed meanwhile cannot start again: it says why in
    one line (no traceback, no "Application startup failed"), the warnings of the worker still serving are
    one line each with a reason, and once PostgreSQL is back the slot serves again."""
    async with throwaway_postgres() as cluster:
        port = free_port()
        parent = await spawn_gateway(
            "workers", cluster.url, tmp_path / "workers.log", port=port, args=["--workers", "2"]
        )
        failed = False
        try:
            with anyio.fail_after(TEST_S):
                await parent.wait_for(STARTUP_COMPLETE, count=2)
                async with http_client(base_url=f"http://127.0.0.1:{port}", timeout=STEP_S) as client:
                    made = await client.post(
                        "/v1/tasks", json={"id": "t", "ttlMs": 600_000, "maxAttempts": 1}
                    )
                    assert made.status_code == 201, made.text
                    token = made.json()["callbackToken"]
                    down_from = len(parent.output().splitlines())
                    await cluster.stop()
                    await kill_worker(parent, live_pids(parent)[0])
                    # The restarted worker cannot start; the parent says so and backs off.
                    await parent.wait_for(EXITED, count=2)
                    # The worker left answers 503, with a reason in its log.
                    for _ in range(3):
                        answer = await client.get("/v1/tasks/t")
                        assert answer.status_code == 503, answer.text
                        event = {"type": "start", "worker": "w"}
                        answer = await client.post(
                            "/v1/tasks/t/callbacks", json={"event": event}, headers=bearer(token)
                        )
                        assert answer.status_code == 503, answer.text
                    await cluster.start()
                    await parent.wait_for(STARTUP_COMPLETE, count=3, timeout_s=60)
                lines = parent.output().splitlines()[down_from:]
                text = "\n".join(lines)
                assert "Traceback" not in text and "Application startup failed" not in text, text
                assert [line for line in lines if not LOG_LINE.match(line)] == [], text
                assert any("could not start" in line and "database" in line for line in lines), text
                warnings = [line for line in lines if "database unavailable:" in line]
                assert warnings, text
                assert all(line.split("database unavailable:", 1)[1].strip() for line in warnings), text
        except BaseException:
            failed = True
            raise
        finally:
            await parent.stop()
            if failed:
                print_tails([parent])
