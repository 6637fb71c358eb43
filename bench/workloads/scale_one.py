"""Workload 9 of ``bench/suite.py``: 20,000 on one process. One ``gateway serve`` (on a SQLite file of its
own) holding N idle subscribers (memory per subscriber after the resume frame and a first event frame), then a
reconnect storm of N subscribers with cursors all at once (the time until every resume frame), each beside
the raw ``websockets`` server holding / opening the same N sockets (bench/workloads/held.py measures them
all).

N stays under the gateway's descriptor ceiling: its soft ``RLIMIT_NOFILE`` (raised by the bench towards the
hard limit, which the gateway inherits) less ``GATEWAY_FD_RESERVE`` (256); the WebSockets it refused
``503 too-many-sockets`` are counted (they must be 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from bench.lib import harness
from bench.lib.report import Report, Row, frames_summary
from bench.workloads import held

FD_RESERVE = 256  # the gateway's default GATEWAY_FD_RESERVE


@dataclass(frozen=True)
class Sizes:
    subscribers: int  # held idle, then reconnecting at once
    tasks: int  # the storm's tasks (the idle subscribers are on one task)


FULL = Sizes(subscribers=19_000, tasks=10)
SMOKE = Sizes(subscribers=200, tasks=2)


async def workload(cfg: Any, servers: held.Lender, report: Report) -> None:
    n = cfg.scale_one.subscribers
    limit = harness.raise_nofile(n + 1024)  # the gateway and the floor inherit it
    if limit - FD_RESERVE < n + 64:
        raise RuntimeError(
            f"RLIMIT_NOFILE is {limit}: a gateway holds at most {limit - FD_RESERVE - 64:,} WebSockets under "
            f"it (GATEWAY_FD_RESERVE {FD_RESERVE}), fewer than {n:,}: raise the hard limit (ulimit -Hn)"
        )
    sizes = {"procs": cfg.procs, "timeout_s": cfg.step_timeout_s}
    idle = await held.idle_gateway(n, servers, **sizes)
    idle_floor = await held.idle_floor(n, servers, **sizes)
    # At most held.IN_FLIGHT handshakes at a time per client process, on both sides (see there).
    storm = await held.storm_gateway(n, cfg.scale_one.tasks, servers, in_flight=held.IN_FLIGHT, **sizes)
    storm_floor = await held.storm_floor(n, servers, in_flight=held.IN_FLIGHT, **sizes)
    report.rows.append(
        Row(
            9,
            f"one process, N={n:,} idle: memory per subscriber",
            idle["bytes_per_subscriber"] / 1024,
            idle_floor["bytes_per_subscriber"] / 1024,
            "KiB",
            "<= 1.3x",
        )
    )
    report.rows.append(
        Row(
            9,
            f"one process, N={n:,}: reconnect storm until every resume frame",
            storm["seconds"],
            storm_floor["seconds"],
            "s",
            "<= 2x",
            2,
        )
    )
    lost = {side: r["lost"] + r["out_of_order"] for side, r in (("gateway", idle), ("floor", idle_floor))}
    lost = {
        side: lost[side] + r["lost"] + r["out_of_order"]
        for side, r in (("gateway", storm), ("floor", storm_floor))
    }
    report.rows.append(
        Row(
            9,
            f"one process, N={n:,}: frames lost + out of order",
            lost["gateway"],
            lost["floor"],
            "",
            "0",
            0,
            ratio=math.nan,
        )
    )
    for label, result in (
        ("one process idle gateway", idle),
        ("one process idle floor", idle_floor),
        ("one process storm gateway", storm),
        ("one process storm floor", storm_floor),
    ):
        report.frames(label, result)
    # A smoke run lends its idle servers to workload 3 too, whose freed sockets the next may reuse: the
    # growth must exist, not be positive.
    report.figure("one process idle memory gateway", idle["bytes_per_subscriber"], positive=False)
    report.figure("one process idle memory floor", idle_floor["bytes_per_subscriber"], positive=False)
    report.figure("one process storm gateway", storm["seconds"])
    report.figure("one process storm floor", storm_floor["seconds"])
    for label, result in (("idle", idle), ("storm", storm)):
        if result["refused"]:
            report.problems.append(f"one process {label}: the gateway refused {result['refused']} WebSockets")
    report.details.append(
        f"one process, N={n:,} (descriptor limit {limit:,}, reserve {FD_RESERVE}), "
        f"{storm['procs']} client processes from as many loopback addresses: idle: gateway "
        f"{frames_summary(idle)}; after the resume frames alone "
        f"{idle['resumed_bytes_per_subscriber'] / 1024:.1f} KiB per subscriber, floor "
        f"{idle_floor['resumed_bytes_per_subscriber'] / 1024:.1f} KiB | storm over {cfg.scale_one.tasks} "
        f"tasks of {held.STORM_HISTORY} versions, at most {held.IN_FLIGHT} handshakes in flight per client "
        f"process: gateway resume frames {storm['resume']}, "
        f"{storm['retries']} attempts retried, {storm['failed']} failed; floor {storm_floor['resume']}, "
        f"{storm_floor['retries']} retried, {storm_floor['failed']} failed; accept-queue drops "
        f"(ListenOverflows): gateway {storm['listen_overflows']}, floor {storm_floor['listen_overflows']} | "
        f"WebSockets the gateway refused 503 too-many-sockets: {idle['refused']} idle, {storm['refused']} "
        f"in the storm"
    )
