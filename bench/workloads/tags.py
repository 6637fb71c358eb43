"""Tag subscriptions, beside the same tasks followed one task subscription at a time on ``/v1/ws``.

    python -m bench tags [--tags 1000] [--per-tag 20] [--callbacks 500] [--rate 50] [--procs 4]
                         [--subscribe-tasks 200] [--repeats 20] [--smoke]

Three measurements on one gateway process (``gateway serve`` through bench/programs/counted.py, which counts
its store's queries; on a SQLite file of its own, its sweeper off: no task here reaches its deadline, and a
sweep's queries would be counted with a subscribe's; a socket's first message allowed 64 KiB, see
``GATEWAY_ENV``):

1. fan-out: ``--tags`` tags of ``--per-tag`` tasks each, one socket per tag holding one tag subscription;
   callbacks at ``--rate`` on tasks picked at random (one frame each): the server's CPU per delivered frame,
   beside the same tasks followed by one socket per tag holding a task subscription per task (the floor);
   the same callbacks with no subscriber are run before and after, and what a frame costs above them is
   told too (a callback costs far more than the one frame it makes);
2. subscribe: one tag of ``--subscribe-tasks`` tasks, each a version behind the client's cursor (its
   resume frame a one-entry ``delta``): the store's queries per subscribe and the time from the subscribe
   message to the last resume frame, beside as many task subscriptions sent together on one ``/v1/ws``
   (the median of ``--repeats``, each on a socket of its own); a subscribe with no cursors too (a
   ``snapshot`` each);
3. reconnect storm: the ``--tags`` subscribers of (1) connecting at once with their cursors maps (half the
   tasks a version behind): the time until every one has the resume frames of all its tasks, beside the
   same subscribers resuming task by task.

Every subscription's frames are checked by its client process (bench/programs/tag_subscribers.py): the
listing, one resume frame per task, then ``event`` frames at last + 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jwt
import orjson

from bench.lib import harness
from bench.lib.harness import Clients, cpu_seconds
from bench.lib.report import Report, Row, frames_summary
from bench.workloads.fanout import metric

RESUMES = ("caught-up", "delta", "snapshot")
# The sweeper off (see the module's docstring). And a socket's first message may be as long as any later one
# (64 KiB): a tag subscribe carries the client's whole cursors map, 200 tasks here (about 4.5 KB), and the
# default limit before a subscription is authorized, 4 KiB, closes it with 1009 (protocol.md, Reconnecting:
# the clients send the newest cursors that fit). Every other setting as a user runs it.
GATEWAY_ENV = {"GATEWAY_SWEEP_INTERVAL_MS": "0", "GATEWAY_WS_MAX_MESSAGE_BYTES_BEFORE_AUTH": "65536"}
CREATE_CONCURRENCY = 32


@dataclass(frozen=True)
class Sizes:
    tags: int  # tag subscriptions (one socket each) in the fan-out and the storm
    per_tag: int  # tasks per tag
    callbacks: int  # per fan-out run
    rate: float  # callbacks/s
    subscribe_tasks: int  # the tag of the subscribe measurement
    repeats: int  # subscribes of each kind


FULL = Sizes(tags=1000, per_tag=20, callbacks=500, rate=50.0, subscribe_tasks=200, repeats=20)
SMOKE = Sizes(tags=20, per_tag=5, callbacks=20, rate=50.0, subscribe_tasks=20, repeats=3)


@contextlib.asynccontextmanager
async def gateway() -> AsyncIterator[harness.Server]:
    """The gateway these measurements run on (the module's docstring says how)."""
    async with harness.gateway(env=GATEWAY_ENV, counted=True) as server:
        yield server


# --- tasks --------------------------------------------------------------------------------------------


@dataclass
class Tasks:
    """Tasks made for a run: by tag, with their callback tokens and the versions they are at."""

    tags: dict[str, list[str]] = field(default_factory=dict)
    callback_tokens: dict[str, str] = field(default_factory=dict)
    versions: dict[str, int] = field(default_factory=dict)

    def ids(self) -> list[str]:
        return [t for ids in self.tags.values() for t in ids]


async def make_tasks(http: Any, run: str, tags: int, per_tag: int, name: str = "t") -> Tasks:
    """``tags`` tags of ``per_tag`` tasks each (``POST /v1/tasks`` with ``"tags"``), created
    ``CREATE_CONCURRENCY`` at a time."""
    made = Tasks()
    gate = asyncio.Semaphore(CREATE_CONCURRENCY)

    async def create(tag: str, task_id: str) -> None:
        async with gate:
            answer = await http.post(
                "/v1/tasks", json={"id": task_id, "ttlMs": 3_600_000, "maxAttempts": 1, "tags": [tag]}
            )
        if answer.status_code != 201:
            raise RuntimeError(f"creating {task_id}: {answer.status_code} {answer.text}")
        body = answer.json()
        made.callback_tokens[task_id] = body["callbackToken"]
        made.versions[task_id] = body["task"]["version"]

    for i in range(tags):
        tag = f"bench:{run}-{name}{i}"
        made.tags[tag] = [f"{run}-{name}{i}-{j}" for j in range(per_tag)]
    await asyncio.gather(*(create(tag, t) for tag, ids in made.tags.items() for t in ids))
    return made


def next_event(version: int) -> dict[str, object]:
    """The callback that takes a task at ``version`` one further: start, then rising progress."""
    if version == 0:
        return {"type": "start", "worker": "bench"}
    return {"type": "progress", "progress": version, "cursor": f"row-{version}"}


async def post(http: Any, tasks: Tasks, task_id: str, callback_id: str) -> None:
    version = tasks.versions[task_id]
    answer = await http.post(
        f"/v1/tasks/{task_id}/callbacks",
        json={"callbackId": callback_id, "event": next_event(version)},
        headers={"Authorization": f"Bearer {tasks.callback_tokens[task_id]}"},
    )
    answer.raise_for_status()
    if not answer.json().get("changed"):
        raise RuntimeError(f"a callback to {task_id} changed nothing: {answer.text}")
    tasks.versions[task_id] = version + 1


async def drive(http: Any, tasks: Tasks, count: int, rate: float, rng: random.Random) -> dict[str, int]:
    """``count`` callbacks, each due at ``i / rate`` (sent when due, or once the previous one is answered),
    each on a task picked at random; returns the tasks that changed, with their versions now."""
    ids, run, changed = tasks.ids(), uuid.uuid4().hex[:8], {}
    started = time.perf_counter()
    for i in range(count):
        await asyncio.sleep(max(0.0, started + i / rate - time.perf_counter()))
        task_id = rng.choice(ids)
        await post(http, tasks, task_id, f"{run}-{i}")
        changed[task_id] = tasks.versions[task_id]
    return changed


# --- client processes ---------------------------------------------------------------------------------


async def start_clients(
    url: str,
    mode: str,
    sockets: Sequence[tuple[str, dict[str, int]]],
    *,
    procs: int,
    stream: bool,
    concurrency: int,
    timeout_s: float,
) -> Clients:
    """bench/programs/tag_subscribers.py processes holding ``sockets`` (``(tag, {task id: cursor})`` each)
    between them, driven as :class:`harness.Clients` drives bench/programs/subscribers.py."""
    procs = max(1, min(procs, len(sockets)))
    processes = []
    try:
        for i in range(procs):
            spec = {
                "url": url,
                "mode": mode,
                "secret": harness.SECRET,
                "sockets": list(sockets[i::procs]),
                "stream": stream,
                "concurrency": concurrency,
                "timeout_s": timeout_s,
                "cores": None,
            }
            process = await harness.spawn(
                harness.program("tag_subscribers"),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                limit=2**20,
            )
            processes.append(process)
            assert process.stdin is not None
            process.stdin.write(orjson.dumps(spec) + b"\n")
            await process.stdin.drain()
        clients = Clients(processes, time.monotonic())
        await clients.expect("loaded", 60)
        return clients
    except BaseException:
        for process in processes:
            await harness.stop(process, 2)
        raise


# --- 1. fan-out ---------------------------------------------------------------------------------------


async def fanout_run(
    server: harness.Server,
    http: Any,
    tasks: Tasks,
    mode: str | None,
    sizes: Sizes,
    procs: int,
    timeout_s: float,
) -> dict[str, Any]:
    """One run: every tag followed by a socket (``mode`` ``tag`` or ``tasks``; ``None``: no subscriber),
    then ``sizes.callbacks`` callbacks; the server's CPU from before the first callback until every
    subscriber has its last entry."""
    clients = None
    async with contextlib.AsyncExitStack() as stack:
        if mode is not None:
            sockets = [(tag, {t: tasks.versions[t] for t in ids}) for tag, ids in tasks.tags.items()]
            clients = await start_clients(
                f"{server.ws}/v1/ws",
                mode,
                sockets,
                procs=procs,
                stream=True,
                concurrency=200,
                timeout_s=timeout_s,
            )
            stack.push_async_callback(clients.close)
            await clients.connect(timeout_s)
        rng = random.Random(f"tags-{mode}")
        cpu_before = cpu_seconds(server.pid)
        changed = await drive(http, tasks, sizes.callbacks, sizes.rate, rng)
        stats: dict[str, Any] = {}
        if clients is not None:
            await clients.tell(f"final {json.dumps(changed)}")
            stats = await clients.done(timeout_s)
        cpu = cpu_seconds(server.pid) - cpu_before
    frames = stats.get("deliveries", 0)
    return {
        **stats,
        "frames": frames,
        "cpu_s": cpu,
        "cpu_us_per_frame": cpu * 1e6 / frames if frames else math.nan,
        "cpu_us_per_callback": cpu * 1e6 / sizes.callbacks,
    }


def fanout_rows(report: Report, sizes: Sizes, runs: dict[str, dict[str, Any]], procs: int) -> None:
    tag, tasks, bases = runs["tag"], runs["tasks"], (runs["base"], runs["base again"])
    base_cpu_s = statistics.mean(b["cpu_s"] for b in bases)
    what = f"{sizes.tags:,} tag subscriptions x {sizes.per_tag} tasks"
    above = {
        name: (run["cpu_s"] - base_cpu_s) * 1e6 / run["frames"] if run["frames"] else math.nan
        for name, run in (("tag", tag), ("tasks", tasks))
    }
    # One frame per callback: what a frame costs above its callback is a small difference of two large
    # readings, within the noise of a shared machine. It is told, not held to a target.
    report.rows += [
        Row(
            7,
            f"{what}: server CPU per frame (floor: task subscriptions)",
            tag["cpu_us_per_frame"],
            tasks["cpu_us_per_frame"],
            "us",
            "<= 1.3x",
        ),
        Row(
            7,
            f"{what}: frames lost + out of order",
            tag["lost"] + tag["out_of_order"],
            tasks["lost"] + tasks["out_of_order"],
            "",
            "0",
            0,
            ratio=math.nan,
        ),
    ]
    report.figure("tag fan-out CPU/frame", tag["cpu_us_per_frame"])
    report.figure("task-subscription fan-out CPU/frame", tasks["cpu_us_per_frame"])
    report.frames("tag fan-out", tag)
    report.frames("task-subscription fan-out", tasks)
    report.details.append(
        f"tag fan-out, {what} ({sizes.tags * sizes.per_tag:,} tasks), {sizes.callbacks} callbacks at "
        f"{sizes.rate:g}/s on tasks picked at random, {procs} client processes: tags {frames_summary(tag)}, "
        f"{tag['cpu_s'] * 1e3:,.1f} ms of CPU | task subscriptions {frames_summary(tasks)}, "
        f"{tasks['cpu_s'] * 1e3:,.1f} ms | no subscriber, before and after: "
        f"{bases[0]['cpu_s'] * 1e3:,.1f} ms and {bases[1]['cpu_s'] * 1e3:,.1f} ms "
        f"({bases[0]['cpu_us_per_callback']:,.0f} and {bases[1]['cpu_us_per_callback']:,.0f} us per "
        f"callback); above their mean, per frame: tags {above['tag']:,.0f} us, task subscriptions "
        f"{above['tasks']:,.0f} us (a frame costs far less than the callback that makes it: a difference "
        "within the noise of a shared machine)"
    )


# --- 2. subscribe -------------------------------------------------------------------------------------


def tag_token(tag: str) -> str:
    claims = {"tag": tag, "scope": "subscribe", "exp": int(time.time()) + 3600}
    return jwt.encode(claims, harness.SECRET, algorithm="HS256")


def task_token(task_id: str) -> str:
    claims = {"sub": task_id, "scope": "subscribe", "exp": int(time.time()) + 3600}
    return jwt.encode(claims, harness.SECRET, algorithm="HS256")


async def store_queries(http: Any) -> float:
    return metric((await http.get("/metrics")).text, "gateway_bench_store_queries")


async def subscribe_once(
    server: harness.Server, http: Any, messages: list[str], task_ids: set[str], timeout_s: float
) -> dict[str, float]:
    """Send ``messages`` on a new ``/v1/ws`` socket; the time until each of ``task_ids`` has its resume
    frame, the server's CPU and the store's queries meanwhile."""
    from websockets.asyncio.client import connect

    async with connect(
        f"{server.ws}/v1/ws", compression=None, ping_interval=None, max_size=2**24, open_timeout=timeout_s
    ) as ws:
        queries = await store_queries(http)
        cpu = cpu_seconds(server.pid)
        started = time.perf_counter()
        for message in messages:
            await ws.send(message)
        waiting = set(task_ids)
        async with asyncio.timeout(timeout_s):
            while waiting:
                frame = orjson.loads(await ws.recv())
                if frame.get("type") == "error":
                    raise RuntimeError(f"an error frame: {frame}")
                if frame.get("type") in RESUMES:
                    waiting.discard(frame.get("taskId"))
        seconds = time.perf_counter() - started
        cpu = cpu_seconds(server.pid) - cpu
        queries = await store_queries(http) - queries
    return {"seconds": seconds, "cpu_s": cpu, "queries": queries}


async def subscribe_measure(
    server: harness.Server, http: Any, run: str, sizes: Sizes, timeout_s: float
) -> dict[str, dict[str, float]]:
    """Subscribe to one tag of ``sizes.subscribe_tasks`` tasks (each at version 2, the cursors at 1),
    beside as many task subscriptions sent together; medians of ``sizes.repeats`` of each (interleaved)."""
    tasks = await make_tasks(http, run, 1, sizes.subscribe_tasks, name="s")
    for task_id in tasks.ids():
        for n in range(2):
            await post(http, tasks, task_id, f"{task_id}-{n}")
    ((tag, ids),) = tasks.tags.items()
    cursors = {t: tasks.versions[t] - 1 for t in ids}
    message = {"type": "subscribe", "tag": tag, "token": tag_token(tag)}
    kinds = {
        "tag": [orjson.dumps({**message, "cursors": cursors}).decode()],
        "tasks": [
            orjson.dumps({"type": "subscribe", "taskId": t, "cursor": c, "token": task_token(t)}).decode()
            for t, c in cursors.items()
        ],
        "fresh tag": [orjson.dumps(message).decode()],
    }
    seen: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
    for _ in range(sizes.repeats):
        for kind, messages in kinds.items():
            seen[kind].append(await subscribe_once(server, http, messages, set(ids), timeout_s))
    return {
        kind: {
            **{key: statistics.median(r[key] for r in runs) for key in ("seconds", "cpu_s", "queries")},
            "queries_min": min(r["queries"] for r in runs),
            "queries_max": max(r["queries"] for r in runs),
        }
        for kind, runs in seen.items()
    }


def subscribe_rows(report: Report, sizes: Sizes, result: dict[str, dict[str, float]]) -> None:
    n = sizes.subscribe_tasks
    tag, tasks, fresh = result["tag"], result["tasks"], result["fresh tag"]
    report.rows += [
        Row(
            7,
            f"subscribe to a tag of {n} tasks: store queries (floor: {n} task subscriptions on one /v1/ws)",
            tag["queries"],
            tasks["queries"],
            "",
            "<= 2 (the tag)",
            0,
        ),
        Row(
            7,
            f"subscribe to a tag of {n} tasks: until the last resume frame (floor: {n} task subscriptions)",
            tag["seconds"] * 1e3,
            tasks["seconds"] * 1e3,
            "ms",
            "",
        ),
    ]
    report.figure("tag subscribe time", tag["seconds"])
    report.figure("task subscriptions time", tasks["seconds"])
    report.details.append(
        f"subscribe to a tag of {n} tasks (each a version behind the cursor sent), median of {sizes.repeats} "
        f"each on a socket of its own: tag {tag['seconds'] * 1e3:.1f} ms, {tag['cpu_s'] * 1e3:.1f} ms of "
        f"server CPU, {tag['queries']:.0f} store queries "
        f"({tag['queries_min']:.0f}..{tag['queries_max']:.0f}) | {n} task subscriptions: "
        f"{tasks['seconds'] * 1e3:.1f} ms, {tasks['cpu_s'] * 1e3:.1f} ms of CPU, "
        f"{tasks['queries']:.0f} queries | the tag with no cursors (a snapshot each): "
        f"{fresh['seconds'] * 1e3:.1f} ms, {fresh['cpu_s'] * 1e3:.1f} ms of CPU, "
        f"{fresh['queries']:.0f} queries"
    )


# --- 3. reconnect storm -------------------------------------------------------------------------------


async def storm(
    server: harness.Server, tasks: Tasks, mode: str, procs: int, timeout_s: float
) -> dict[str, Any]:
    """Every tag's subscriber connecting at once with its cursors (every other task a version behind):
    the time until the last has the resume frames of all its tasks."""
    sockets = [
        (tag, {t: max(0, tasks.versions[t] - (j % 2)) for j, t in enumerate(ids)})
        for tag, ids in tasks.tags.items()
    ]
    clients = await start_clients(
        f"{server.ws}/v1/ws", mode, sockets, procs=procs, stream=False, concurrency=0, timeout_s=timeout_s
    )
    try:
        go = time.monotonic()
        lines = await clients.connect(timeout_s)
        seconds = max(line["t"] for line in lines) - go
        stats = await clients.done(timeout_s)
    finally:
        await clients.close()
    return {**stats, "seconds": seconds}


def storm_rows(report: Report, sizes: Sizes, tag: dict[str, Any], tasks: dict[str, Any], procs: int) -> None:
    what = f"tag reconnect storm, {sizes.tags:,} subscribers x {sizes.per_tag} tasks"
    report.rows.append(
        Row(
            7,
            f"{what}: until every resume frame (floor: resuming task by task)",
            tag["seconds"],
            tasks["seconds"],
            "s",
            "<= 2x",
            2,
        )
    )
    report.figure("tag reconnect storm", tag["seconds"])
    report.figure("task-by-task reconnect storm", tasks["seconds"])
    report.frames("tag reconnect storm", tag)
    report.frames("task-by-task reconnect storm", tasks)
    report.details.append(
        f"{what}, all at once from {procs} client processes, each with its cursors map (every other task a "
        f"version behind): tags: resume frames {tag['resume']}, {tag['retries']} retried, {tag['failed']} "
        f"failed | task by task ({sizes.per_tag} subscribe messages and task tokens per socket): "
        f"{tasks['resume']}, {tasks['retries']} retried, {tasks['failed']} failed"
        + "".join(
            f"; {label}: {'; '.join(r['errors'])}"
            for label, r in (("tags", tag), ("tasks", tasks))
            if r["errors"]
        )
    )


# --- all three ----------------------------------------------------------------------------------------


async def workload(
    server: harness.Server, sizes: Sizes, procs: int, timeout_s: float, report: Report
) -> None:
    """The three measurements on ``server`` (a gateway from :func:`gateway`), as rows of ``report``."""
    import httpx

    run = uuid.uuid4().hex[:8]
    harness.raise_nofile(sizes.tags + 1024)
    async with httpx.AsyncClient(
        base_url=server.http, timeout=60, limits=httpx.Limits(max_connections=CREATE_CONCURRENCY)
    ) as http:
        t0 = time.monotonic()
        tasks = await make_tasks(http, run, sizes.tags, sizes.per_tag)
        made_s = time.monotonic() - t0
        runs = {}
        # The base (no subscriber) before and after, so that the drift of a shared machine shows.
        for name, mode in (("base", None), ("tag", "tag"), ("tasks", "tasks"), ("base again", None)):
            runs[name] = await fanout_run(server, http, tasks, mode, sizes, procs, timeout_s)
        fanout_rows(report, sizes, runs, procs)
        subscribe_rows(report, sizes, await subscribe_measure(server, http, run, sizes, timeout_s))
        tag = await storm(server, tasks, "tag", procs, timeout_s)
        by_task = await storm(server, tasks, "tasks", procs, timeout_s)
        storm_rows(report, sizes, tag, by_task, procs)
        report.details.append(
            f"tags: {sizes.tags * sizes.per_tag:,} tasks created in {made_s:.1f} s "
            f"({CREATE_CONCURRENCY} at a time) on a SQLite file"
        )


async def main(args: argparse.Namespace) -> int:
    from bench.lib.report import table

    base = SMOKE if args.smoke else FULL
    sizes = Sizes(
        tags=args.tags or base.tags,
        per_tag=args.per_tag or base.per_tag,
        callbacks=args.callbacks or base.callbacks,
        rate=args.rate or base.rate,
        subscribe_tasks=args.subscribe_tasks or base.subscribe_tasks,
        repeats=args.repeats or base.repeats,
    )
    harness.raise_nofile(sizes.tags + 1024)
    report = Report()
    async with gateway() as server:
        await workload(server, sizes, args.procs, args.timeout, report)
    print(f"tags: {os.cpu_count()} cores, {args.procs} client processes")
    print(table(report.rows, markdown=False))
    for detail in report.details:
        print(f"- {detail}")
    for problem in report.problems:
        print(f"CHECK {problem}")
    return 1 if report.problems else 0


def command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench tags", description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tags", type=int, default=0, help="tag subscriptions (default 1000, smoke 20)")
    parser.add_argument("--per-tag", type=int, default=0, help="tasks per tag (default 20, smoke 5)")
    parser.add_argument("--callbacks", type=int, default=0, help="callbacks per fan-out run (default 500)")
    parser.add_argument("--rate", type=float, default=0.0, help="callbacks/s (default 50)")
    parser.add_argument("--subscribe-tasks", type=int, default=0, help="the subscribed tag's tasks (200)")
    parser.add_argument("--repeats", type=int, default=0, help="subscribes of each kind (default 20)")
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=180.0, help="each step's bound, in seconds")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes")
    return harness.run_to_the_end(main(parser.parse_args(argv)))
