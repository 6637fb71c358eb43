"""``gateway serve --workers N`` spreads connections over its workers and leaves none behind it.

On Linux each worker listens on a socket of its own in the port's ``SO_REUSEPORT`` group, so the kernel
hands each worker a fair share of the connections (on one shared socket, whichever woke first took them:
at 47,000 sockets over 6 workers one held 17,889, another 3,084); the parent still holds the port, so
``--port 0`` works and a second gateway on the port is refused. A worker whose parent is SIGKILLed stops,
saying ``1001`` to its subscribers.

Real processes on this machine's PostgreSQL (tests/support/processes.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import anyio
import pytest
from websockets.asyncio.client import ClientConnection, connect

from tests.support import GATEWAY_CLI, STEP_S, eventually, http_client, postgres_database
from tests.support.processes import STARTUP_COMPLETE, alive, print_tails, spawn_gateway

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.postgres,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT spreads on Linux"),
]

TEST_S = 120.0
WORKERS = 3
SOCKETS = 300
# How soon the workers of a killed parent must be gone (each closes its sockets first).
ORPHAN_S = 20.0


@pytest.fixture
def pg_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


def sockets_held(port: int, pids: Iterable[int], state: str = "01") -> Counter[int]:
    """How many TCP sockets on local ``port`` (IPv4) in ``state`` (``01`` established, ``0A`` listening)
    each of ``pids`` holds (from /proc)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == state:
            inodes.add(f"socket:[{fields[9]}]")
    held: Counter[int] = Counter()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        held[pid] += 1
    return held


def listening_inodes(port: int) -> set[str]:
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return {f[9] for f in map(str.split, lines) if f[1].endswith(f":{port:04X}") and f[3] == "0A"}


async def subscribe(
    url: str, ws_url: str, count: int, stack: contextlib.AsyncExitStack
) -> list[ClientConnection]:
    """``count`` WebSockets on one new task, each with its first frame read (served, not merely queued)."""
    async with http_client(timeout=STEP_S) as client:
        made = await client.post(f"{url}/v1/tasks", json={"id": "spread", "ttlMs": 600_000, "maxAttempts": 1})
    assert made.status_code == 201, made.text
    sub_url = f"{ws_url}/v1/tasks/spread/ws?cursor=0&token={made.json()['subscribeToken']}"
    sockets = []
    for _ in range(count):
        ws = await stack.enter_async_context(connect(sub_url, open_timeout=STEP_S, close_timeout=2))
        with anyio.fail_after(STEP_S):
            await ws.recv()
        sockets.append(ws)
    return sockets


async def test_workers_hold_fair_shares_on_port_0_and_a_second_gateway_is_refused(
    pg_url: str, tmp_path: Path
) -> None:
    """300 WebSockets over ``--workers 3`` started on ``--port 0``: every worker holds at least half of the
    mean; the parent holds none; another ``gateway serve`` on that port fails at start."""
    parent = await spawn_gateway(
        "workers",
        pg_url,
        tmp_path / "workers.log",
        port=0,
        args=["--workers", str(WORKERS)],
        env={"GATEWAY_MAX_CONNECTIONS_PER_ADDRESS": "0"},
    )
    failed = False
    try:
        with anyio.fail_after(TEST_S):
            await parent.serving()  # the port the parent was given
            await parent.wait_for(STARTUP_COMPLETE, count=WORKERS)
            pids = parent.started_pids()
            assert len(set(pids)) == WORKERS and parent.pid not in pids, pids
            # A listening socket of its own for each worker (one shared socket would be counted in each).
            listening = sockets_held(parent.port, [*pids, parent.pid], state="0A")
            assert listening == Counter(pids) and len(listening_inodes(parent.port)) == WORKERS, listening
            async with contextlib.AsyncExitStack() as stack:
                await subscribe(parent.url, parent.ws_url, SOCKETS, stack)
                held = sockets_held(parent.port, [*pids, parent.pid])
                print(f"\nsockets held by each worker: {dict(held)}")
                assert held[parent.pid] == 0, held
                assert sum(held.values()) == SOCKETS, held
                assert all(held[pid] >= SOCKETS / WORKERS / 2 for pid in pids), held

            second = await anyio.run_process(
                [
                    *GATEWAY_CLI,
                    "serve",
                    "--workers",
                    "2",
                    "--port",
                    str(parent.port),
                    "--database-url",
                    pg_url,
                ],
                check=False,
                cwd=tmp_path,
            )
            said = (second.stdout + second.stderr).decode(errors="replace")
            assert second.returncode != 0 and "address already in use" in said, said
            assert parent.running and all(alive(pid) for pid in pids), parent.tail()
    except BaseException:
        failed = True
        raise
    finally:
        await parent.stop()
        if failed:
            print_tails([parent])


async def test_workers_of_a_killed_parent_stop_saying_1001(pg_url: str, tmp_path: Path) -> None:
    """SIGKILL the parent of ``--workers 2``: its subscribers are told ``1001`` and both workers are gone
    within ``ORPHAN_S``, the port free again."""
    parent = await spawn_gateway("workers", pg_url, tmp_path / "workers.log", port=0, args=["--workers", "2"])
    failed = False
    try:
        with anyio.fail_after(TEST_S):
            await parent.serving()
            await parent.wait_for(STARTUP_COMPLETE, count=2)
            pids = parent.started_pids()
            async with contextlib.AsyncExitStack() as stack:
                sockets = await subscribe(parent.url, parent.ws_url, 10, stack)
                await parent.kill()
                with anyio.fail_after(ORPHAN_S):
                    for ws in sockets:
                        await ws.wait_closed()
                assert {ws.close_code for ws in sockets} == {1001}, [ws.close_code for ws in sockets]

            async def living() -> list[int]:
                return [pid for pid in pids if alive(pid)]

            await eventually(
                living, lambda left: left == [], "the workers of the killed parent gone", ORPHAN_S
            )
            assert "its parent (pid" in parent.output(), parent.tail()
    except BaseException:
        failed = True
        raise
    finally:
        await parent.stop()
        if failed:
            print_tails([parent])


def spawned_children(pid: int) -> list[int]:
    """The worker processes ``pid`` has spawned so far (not multiprocessing's resource tracker)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [int(c) for c in children if b"spawn_main" in _cmdline(int(c))]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


async def test_workers_of_a_parent_killed_while_they_start_are_gone_too(pg_url: str, tmp_path: Path) -> None:
    """SIGKILL the parent as soon as its workers are spawned, before they have set anything up: they are
    gone within ``ORPHAN_S`` all the same (a death signal a worker asks for once it runs would be missed)."""
    parent = await spawn_gateway("workers", pg_url, tmp_path / "workers.log", port=0, args=["--workers", "2"])
    pids: list[int] = []
    failed = False
    try:

        async def spawned() -> list[int]:
            return spawned_children(parent.pid)

        pids = await eventually(
            spawned, lambda found: len(found) == 2, "two workers spawned", TEST_S, poll_s=0.002
        )
        await parent.kill()

        async def living() -> list[int]:
            return [pid for pid in pids if alive(pid)]

        await eventually(living, lambda left: left == [], "the workers of the killed parent gone", ORPHAN_S)
    except BaseException:
        failed = True
        raise
    finally:
        await parent.stop()
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if failed:
            print_tails([parent])
