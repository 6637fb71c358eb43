"""Slow consumers (protocol.md, Slow consumers): a subscriber that stops reading costs a bounded backlog,
never delays the others, and loses nothing once it reconnects with its cursor.

Two scenarios, each against a real server with ``subscription_backlog=32``:

- *stalled* (run once for the module, several tests read its outcome): 2,000 entries on four tasks (each
  25 x start, 18 progress steps with ~8 KB cursors, a retryable failure; four concurrent chains of
  callbacks); four subscribers watch all four tasks on one ``/v1/ws`` socket each. One of them opens its
  socket with ``max_queue=1`` and without compression and never reads, so its TCP buffers fill and the
  gateway's writes to it stop making progress; ``write_timeout_ms=10000`` (the default) cuts it. It reads
  what reached it once every callback is answered, however long that took after the cut: the grace it has
  to do so (``slow_close_grace_ms``) is longer than any run.
- *conflated*: a subscriber whose socket is full while more entries than the backlog are committed, with a
  write timeout far away, then reads again: it gets one ``snapshot`` (``reason: conflated``) at the newest
  version and the stream goes on from there.
"""

from __future__ import annotations

import contextlib
import fcntl
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from tests.integration.test_live_support import (
    STEP_S,
    StreamCheck,
    closed_with,
    get_task,
    live_gateway,
    recv_frame,
    socket,
    wait_until,
    ws_url,
)
from tests.support import Running, create_task, eventually, post_callback

TASKS = 4
CYCLES = 25  # per task: 25 x (start + 18 progress + fail) = 500 entries
ENTRIES_PER_TASK = CYCLES * 20
BACKLOG = 32
# The stall begins once the stalled socket's buffers are full, a few dozen entries in; the cut comes this long
# after. Long enough for more than a backlog of entries per task to be committed meanwhile on a loaded
# machine (about 10 callbacks a second per task beside two CPU burners and other tests: at 2 s, some runs
# were cut before any backlog passed its bound).
WRITE_TIMEOUT_MS = 10_000
# Longer than any run: the stalled client reads only once the chains are done, and is then told 4008 (past
# the grace it would be dropped with no close frame, which test_limits.py checks).
SLOW_CLOSE_GRACE_MS = 600_000
CURSOR_PAD = "c" * 8_000


@dataclass
class Stalled:
    """What the stalled scenario saw, for the tests below to judge."""

    finals: dict[str, dict[str, Any]] = field(default_factory=dict)
    readers: list[dict[str, StreamCheck]] = field(default_factory=list)
    pending_samples: list[int] = field(default_factory=list)
    conflations: int = 0
    slow_consumers_metric: str = ""
    connections_after_cut: int = -1
    stalled: dict[str, StreamCheck] = field(default_factory=dict)
    stalled_close_code: int | None = None
    resumed: dict[str, StreamCheck] = field(default_factory=dict)


async def metric_line(gw: Running, name: str) -> str:
    """The line of ``/metrics`` for the metric ``name`` (a counter or gauge without labels)."""
    answer = await gw.client.get("/metrics")
    assert answer.status_code == 200, answer.text
    (line,) = [line for line in answer.text.splitlines() if line.split(" ")[0] == name]
    return line


def cycle_events(cycle: int) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [{"type": "start", "worker": f"w{cycle}"}]
    events += [
        {"type": "progress", "progress": p, "cursor": f"{cycle}-{p}-{CURSOR_PAD}"} for p in range(5, 95, 5)
    ]
    events.append({"type": "fail", "error": f"retry {cycle}", "retryable": True})
    return events


async def subscribe(
    ws: ClientConnection, tasks: Mapping[str, Mapping[str, Any]], cursors: dict[str, int]
) -> None:
    for task_id, made in tasks.items():
        await ws.send(
            f'{{"type":"subscribe","taskId":"{task_id}","cursor":{cursors[task_id]},'
            f'"token":"{made["subscribeToken"]}"}}'
        )


async def read_until(ws: ClientConnection, checks: dict[str, StreamCheck], finals: dict[str, int]) -> None:
    """Read frames into their task's check until every task is at its final version, each frame within a
    step: the stalled scenario's 2,000 entries take a time that grows with the machine's load, a frame
    does not."""
    while any(checks[t].version < v for t, v in finals.items()):
        frame = await recv_frame(ws)
        assert frame["type"] not in ("error", "pong"), frame
        checks[frame["taskId"]].feed(frame)


async def run_stalled(db_url: str) -> Stalled:
    out = Stalled()
    async with live_gateway(
        db_url,
        subscription_backlog=BACKLOG,
        write_timeout_ms=WRITE_TIMEOUT_MS,
        slow_close_grace_ms=SLOW_CLOSE_GRACE_MS,
    ) as gw:
        hub = gw.gateway.hub
        tasks = {f"slow-{i}": await create_task(gw, f"slow-{i}", max_attempts=1_000) for i in range(TASKS)}
        final_versions = {task_id: ENTRIES_PER_TASK + 2 for task_id in tasks}  # then start, succeed

        def sample() -> None:
            out.pending_samples.append(hub.stats()["pending_max"])

        async def chain(task_id: str, token: str) -> None:
            """One task's entries, each callback answered before the next is sent."""
            for cycle in range(CYCLES):
                for event in cycle_events(cycle):
                    answer = await post_callback(gw, task_id, token, event)
                    assert answer["changed"] is True, answer
                    sample()
            await post_callback(gw, task_id, token, {"type": "start", "worker": "last"})
            done = {"type": "succeed", "resultRef": f"s3://{task_id}", "resultHash": "h"}
            answer = await post_callback(gw, task_id, token, done)
            assert answer["task"]["version"] == final_versions[task_id]

        async with (
            # Its own keep-alive pings off: their pongs would wait behind what it does not read, and past
            # 40 s of that (a loaded run) the client itself would drop the connection (1006, not 4008).
            socket(ws_url(gw, "/v1/ws"), max_queue=1, compression=None, ping_interval=None) as stalled,
            socket(ws_url(gw, "/v1/ws"), compression=None) as r1,
            socket(ws_url(gw, "/v1/ws"), compression=None) as r2,
            socket(ws_url(gw, "/v1/ws"), compression=None) as r3,
        ):
            readers = [r1, r2, r3]
            out.readers = [{t: StreamCheck(t, 0) for t in tasks} for _ in readers]
            for ws in (stalled, *readers):
                await subscribe(ws, tasks, dict.fromkeys(tasks, 0))
            out.stalled = {t: StreamCheck(t, 0) for t in tasks}
            for ws, checks in zip((stalled, *readers), (out.stalled, *out.readers), strict=True):
                for _ in tasks:  # the resume frames, before anything is published
                    frame = await recv_frame(ws)
                    checks[frame["taskId"]].feed(frame)

            sampling = anyio.Event()

            async def sampler() -> None:
                while not sampling.is_set():
                    sample()
                    await anyio.sleep(0.002)

            async with anyio.create_task_group() as everyone:
                for ws, checks in zip(readers, out.readers, strict=True):
                    everyone.start_soon(read_until, ws, checks, final_versions)
                everyone.start_soon(sampler)
                async with anyio.create_task_group() as chains:
                    for task_id, made in tasks.items():
                        chains.start_soon(chain, task_id, made["callbackToken"])
                sampling.set()

            out.finals = {task_id: await get_task(gw, task_id) for task_id in tasks}
            # The cut is the write watchdog's, up to the write timeout and a second after the stall began:
            # on a machine that answered the callbacks within that time it comes after them. Wait for it,
            # then for its count on /metrics, instead of reading either as the callbacks end.
            await wait_until(
                lambda: hub.stats()["connections"] == 3,
                lambda: f"the stalled connection cut, the three readers' left: {hub.stats()}",
                within_s=WRITE_TIMEOUT_MS / 1000 + STEP_S,
            )
            out.connections_after_cut = hub.stats()["connections"]
            # Its subscriptions are let go with it: no conflation of its backlog can come after this.
            out.conflations = hub.stats()["conflations"]
            out.slow_consumers_metric = await eventually(
                lambda: metric_line(gw, "gateway_slow_consumers_closed_total"),
                lambda line: line.split()[-1] != "0.0",
                "gateway_slow_consumers_closed_total counting the cut",
            )

            # The stalled client reads, at last, whatever reached it.
            with contextlib.suppress(ConnectionClosed):
                await read_until(stalled, out.stalled, final_versions)
            out.stalled_close_code = stalled.close_code

        # It reconnects with its cursors.
        cursors = {t: c.version for t, c in out.stalled.items()}
        async with socket(ws_url(gw, "/v1/ws"), max_size=None) as again:
            await subscribe(again, tasks, cursors)
            out.resumed = {
                t: StreamCheck(t, cursors[t], base=out.stalled[t].task, retention=8) for t in tasks
            }
            await read_until(again, out.resumed, final_versions)
    return out


@pytest.fixture(scope="module")
def stalled_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Stalled:
    """The stalled scenario, made once for the whole run: the suite's processes (pytest-xdist) each take
    some of this module's tests, and the first to need the run makes it while the others wait, then read
    what it saw (the run's own temporary folder, which they share). A run that fails is not kept: the next
    process makes it again, and fails its own tests."""
    if worker_id == "master":  # one process: nobody to share with
        return made_stalled(tmp_path_factory)
    shared = tmp_path_factory.getbasetemp().parent
    with (shared / "stalled.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        kept = shared / "stalled.pickle"
        if kept.exists():
            seen: Stalled = pickle.loads(kept.read_bytes())
            return seen
        seen = made_stalled(tmp_path_factory)
        kept.write_bytes(pickle.dumps(seen))
        return seen


def made_stalled(tmp_path_factory: pytest.TempPathFactory) -> Stalled:
    db = Path(tmp_path_factory.mktemp("stalled")) / "gateway.db"
    return anyio.run(run_stalled, f"sqlite:///{db}")


def test_readers_get_every_entry_in_order_while_one_subscriber_is_stalled(stalled_run: Stalled) -> None:
    for checks in stalled_run.readers:
        for task_id, check in checks.items():
            assert check.resume is not None and check.resume["type"] == "caught-up"
            assert check.conflated == 0, "a reader that keeps up is never conflated"
            assert check.event_versions == list(range(1, ENTRIES_PER_TASK + 3))
            check.assert_final(stalled_run.finals[task_id])


def test_the_stalled_subscribers_backlog_stays_bounded(stalled_run: Stalled) -> None:
    assert len(stalled_run.pending_samples) >= TASKS * ENTRIES_PER_TASK
    assert max(stalled_run.pending_samples) <= BACKLOG
    assert max(stalled_run.pending_samples) > 0
    # Its four subscriptions passed their bound and were collapsed instead of growing.
    assert stalled_run.conflations >= 1


def test_the_stalled_connection_is_cut_and_what_reached_it_is_an_exact_prefix(stalled_run: Stalled) -> None:
    assert stalled_run.slow_consumers_metric.split()[-1] == "1.0"
    assert stalled_run.connections_after_cut == 3
    for task_id, check in stalled_run.stalled.items():
        # Checked frame by frame while read: a resume frame, then contiguous, exact entries.
        assert check.resume is not None
        assert 0 < check.version < stalled_run.finals[task_id]["version"]


def test_the_stalled_subscriber_reconnects_with_its_cursor_and_ends_exact(stalled_run: Stalled) -> None:
    for task_id, check in stalled_run.resumed.items():
        assert check.resume is not None
        assert check.resume["type"] == "snapshot" and check.resume["reason"] == "retention"
        check.assert_final(stalled_run.finals[task_id])


def test_the_stalled_subscriber_is_told_4008_or_gets_a_conflated_snapshot(stalled_run: Stalled) -> None:
    conflated = sum(c.conflated for c in stalled_run.stalled.values())
    assert stalled_run.stalled_close_code == 4008 or conflated > 0, (
        stalled_run.stalled_close_code,
        conflated,
    )


@pytest.mark.anyio
async def test_a_subscriber_that_falls_behind_gets_one_conflated_snapshot_then_the_rest(
    sqlite_url: str,
) -> None:
    big = "z" * 48_000  # the socket fills after some dozens of these
    async with live_gateway(sqlite_url, subscription_backlog=BACKLOG, write_timeout_ms=120_000) as gw:
        hub = gw.gateway.hub
        made = await create_task(gw, "behind", max_attempts=1_000)
        token = made["callbackToken"]
        # Each step is bounded (a frame within a step, a callback by its client's timeout), not the whole: how
        # many callbacks fill the socket, each slower on a loaded machine, is the kernel's business (22.7 s
        # beside two CPU burners and other tests, of the 30 s this had).
        async with socket(
            ws_url(gw, "/v1/tasks/behind/ws", token=made["subscribeToken"]),
            max_queue=1,
            compression=None,
            max_size=None,
            ping_interval=None,  # as the stalled one's: no pong to wait for behind what it does not read
        ) as ws:
            check = StreamCheck("behind", 0)
            check.feed(await recv_frame(ws))
            await post_callback(gw, "behind", token, {"type": "start", "worker": "w1"})
            progress, sent = 0, 0
            # Publish until the gateway, unable to write, collapses the backlog (bounded in count).
            while hub.stats()["conflations"] == 0:
                assert sent < 2_000, "the socket never filled"
                if progress == 100:
                    await post_callback(
                        gw, "behind", token, {"type": "fail", "error": "e", "retryable": True}
                    )
                    await post_callback(gw, "behind", token, {"type": "start", "worker": "w"})
                    progress = 0
                progress += 1
                sent += 1
                await post_callback(
                    gw,
                    "behind",
                    token,
                    {"type": "progress", "progress": progress, "cursor": f"{sent}{big}"},
                )
                assert hub.stats()["pending_max"] <= BACKLOG
            # A few more while it is conflated: covered by the snapshot, never queued one by one.
            for _ in range(5):
                if progress == 100:
                    break
                progress += 1
                await post_callback(
                    gw, "behind", token, {"type": "progress", "progress": progress, "cursor": "x"}
                )
                assert hub.stats()["pending_max"] <= BACKLOG
            newest = (await get_task(gw, "behind"))["version"]

            while check.conflated == 0:
                check.feed(await recv_frame(ws))
            assert check.version == newest, "the snapshot is at the newest version"
            assert check.types[-1] == "snapshot"

            done = {"type": "succeed", "resultRef": "s3://behind", "resultHash": "h"}
            assert (await post_callback(gw, "behind", token, done))["task"]["version"] == newest + 1
            frames_after, code = await closed_with(ws)
            for frame in frames_after:
                check.feed(frame)
            assert code == 1000
            assert [f["type"] for f in frames_after] == ["event"]
            check.assert_final(await get_task(gw, "behind"))
            assert check.conflated == 1
