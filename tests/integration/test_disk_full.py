"""A SQLite gateway whose disk fills up: writes answer ``503`` with ``Retry-After`` and say the disk is
full, ``/readyz`` answers ``503`` while they fail (a balancer stops sending writes there), and everything
recovers once space returns, with nothing acknowledged lost and nothing refused written.

The disk is a real one: a small tmpfs mounted for the test (root only: CI runs as root), filled with a
file until the filesystem refuses more, then freed by removing that file.
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import bearer, eventually, running_gateway
from tests.support.processes import unavailable

pytestmark = pytest.mark.anyio

DISK_BYTES = 16 * 1024 * 1024


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a tmpfs of its own, ``DISK_BYTES`` large."""
    if os.geteuid() != 0:
        unavailable("mounting a small tmpfs needs root (CI runs as root)")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        unavailable(f"cannot mount a tmpfs: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(path: Path) -> None:
    """Write ``path`` until the filesystem holding it is full, to its last byte."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (65536, 512, 1):
            try:
                while os.write(fd, b"\0" * size):
                    pass
            except OSError as exc:
                assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)


async def test_a_full_disk_makes_writes_and_readiness_say_so_until_space_returns(small_disk: Path) -> None:
    async with running_gateway(f"sqlite:///{small_disk / 'gateway.db'}") as gw:
        client = gw.client
        made = (await client.post("/v1/tasks", json={"id": "t", "ttlMs": 600_000, "maxAttempts": 1})).json()
        token = bearer(made["callbackToken"])
        answer = await client.post(
            "/v1/tasks/t/callbacks", json={"event": {"type": "start", "worker": "w"}}, headers=token
        )
        assert answer.status_code == 200, answer.text
        assert (await client.get("/readyz")).status_code == 200

        fill(small_disk / "filler")
        applied = 0
        refused: httpx.Response | None = None
        body: dict[str, object] = {}
        for percent in range(1, 100):  # until a write needs space the disk no longer has
            body = {
                "callbackId": f"p{percent}",
                "attempt": 1,
                "event": {"type": "progress", "progress": percent, "cursor": f"c{percent}"},
            }
            answer = await client.post("/v1/tasks/t/callbacks", json=body, headers=token)
            if answer.status_code != 200:
                refused = answer
                break
            applied = percent
        assert refused is not None, "no write was refused on a full disk"
        assert refused.status_code == 503 and refused.headers.get("retry-after"), refused.text
        message = refused.json()["error"]["message"]
        assert "disk" in message and "full" in message, message
        assert "unreachable" not in message, message

        ready = await client.get("/readyz")
        assert ready.status_code == 503, ready.text
        assert "full" in ready.json()["error"]["message"], ready.text
        task = (await client.get("/v1/tasks/t")).json()
        assert task["progress"] == applied, "the refused write wrote nothing; every answered one is kept"

        (small_disk / "filler").unlink()
        await eventually(lambda: client.get("/readyz"), lambda a: a.status_code == 200, "ready again")
        # The refused callback, retried with its id, applies now, once.
        answer = await client.post("/v1/tasks/t/callbacks", json=body, headers=token)
        assert answer.status_code == 200, answer.text
        assert answer.json()["changed"] is True and answer.json()["duplicateCallback"] is False
        assert answer.json()["task"]["progress"] == applied + 1
