"""``gateway serve --workers N`` as an operator meets it when workers die: each worker slot is restarted
on a backoff of its own, and a worker that starts while PostgreSQL is down says so in one line.

Real processes: the parent and its workers (tests/processes.py), on this machine's PostgreSQL or on a
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

from tests.processes import STARTUP_COMPLETE, GatewayProcess, alive, free_port, print_tails, spawn_gateway
from tests.support import postgres_database

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TEST_S = 120.0
# The parent's line for a worker that exited: which slot, which pid, the restart delay it chose.
EXITED = re.compile(rb"worker (\d+) \(pid (\d+)\) exited with (-?\d+); starting it again in (\d+) s")


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
    first time is started again after 1 s, not after the first one's backoff; every slot comes back."""
    parent = await spawn_gateway(
        "workers", pg_url, tmp_path / "workers.log", port=free_port(), args=["--workers", "3"]
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
