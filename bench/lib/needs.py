"""What a run needs, per workload: its time, the memory of its processes at their peak (the sum of the RSS of
the bench process and every process under it: gateways, floors, clients, workers; PostgreSQL's server is
not under it) beside the machine's used memory at its peak (MemTotal - MemAvailable, every process of the
machine), and the most TCP sockets open at once (machine-wide, /proc/net/sockstat: both ends of each
loopback connection). Sampled every half second by the bench process; a peak shorter than that may be
missed."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")
INTERVAL_S = 0.5


@dataclass
class Need:
    workload: str
    seconds: float = 0.0
    rss: int = 0  # bytes, the bench's process tree at its peak
    used: int = 0  # bytes, the machine's used memory at its peak
    sockets: int = 0  # TCP sockets open on the machine at the peak

    def sample(self) -> None:
        self.rss = max(self.rss, tree_rss(os.getpid()))
        self.used = max(self.used, machine_used())
        self.sockets = max(self.sockets, tcp_sockets())

    def cells(self) -> tuple[str, str, str, str, str]:
        return (
            self.workload,
            f"{self.seconds:,.0f} s",
            f"{self.rss / 2**30:.2f} GiB",
            f"{self.used / 2**30:.2f} GiB",
            f"{self.sockets:,}",
        )


def tree_rss(root: int) -> int:
    """The sum of the RSS of process ``root`` and every process under it, in bytes."""
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
            pid = int(name)
            children.setdefault(int(fields[1]), []).append(pid)  # ppid
            rss[pid] = int(fields[21]) * PAGE
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += rss.get(pid, 0)
        todo += children.get(pid, [])
    return total


def machine_used() -> int:
    values: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
    return values.get("MemTotal", 0) - values.get("MemAvailable", 0)


def tcp_sockets() -> int:
    with contextlib.suppress(OSError):
        for line in Path("/proc/net/sockstat").read_text().splitlines():
            if line.startswith("TCP:"):
                fields = line.split()
                return int(fields[fields.index("inuse") + 1])
    return 0


@contextlib.asynccontextmanager
async def watched(workload: str, into: list[Need]) -> AsyncIterator[Need]:
    """Sample what the block needs into a :class:`Need` appended to ``into`` at its end."""
    need = Need(workload)
    started = time.monotonic()

    async def sample() -> None:
        while True:
            need.sample()
            await asyncio.sleep(INTERVAL_S)

    sampler = asyncio.create_task(sample())
    try:
        yield need
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
        need.sample()
        need.seconds = time.monotonic() - started
        into.append(need)


def table(needs: list[Need]) -> str:
    """The needs as a markdown table, with the run's peaks as its last line."""
    header = ("workload", "time", "its processes' RSS", "machine's used memory", "TCP sockets")
    lines = ["| " + " | ".join(header) + " |", "|---|--:|--:|--:|--:|"]
    lines += ["| " + " | ".join(need.cells()) + " |" for need in needs]
    if needs:
        run = Need(
            "**the run**",
            sum(n.seconds for n in needs),
            max(n.rss for n in needs),
            max(n.used for n in needs),
            max(n.sockets for n in needs),
        )
        lines.append("| " + " | ".join(run.cells()) + " |")
    return "\n".join(lines)
