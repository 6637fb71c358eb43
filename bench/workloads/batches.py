"""Batches and live metadata (issue 34, Performance): each figure beside its floor measured in the same run.

- **Children**: a parent with N children (created with ``parent``), one subscriber of the parent on its
  single-task socket; each child started and succeeded (two callbacks, two transitions), the children
  ending at a steady rate: the gateway process's CPU (its CPU-time clock) per child transition, from the
  first callback until the parent's subscriber has the last ``children`` frame, beside the same
  transitions of as many tasks created without a parent (no subscriber). The subscriber must end on the
  exact counts (every child succeeded), as must the parent's JSON.
- **Metadata**: M running tasks, each followed by one subscriber on its single-task socket; merge patches
  (``POST /v1/tasks/{id}/metadata`` with the callback token) at a steady rate, spread over the tasks in
  turn: the gateway's CPU per delivered ``metadata`` frame, beside progress callbacks at the same rate on
  the same tasks, per delivered ``event`` frame. Every patch and every callback must be delivered.

The subscribers are ``websockets`` clients in this process (a frame a second each at most: they cost the
gateway what any reader does); the children's callbacks come from a client process of their own
(bench/programs/paced_callbacks.py: an httpx client in this process reached ~150 children/s of the 500/s
asked); the CPU read is the gateway's alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import websockets

from bench.lib import harness
from bench.lib.report import Report, Row

NUMBER = 17
CHILDREN_TARGET = "<= 1.2x"
METADATA_TARGET = "<= 1.3x"
START = {"type": "start", "worker": "bench"}
CONNECT_AT_ONCE = 100  # subscribers connecting together
SENDERS = 32  # requests in flight at most (keep-alive connections)


@dataclass(frozen=True)
class Sizes:
    children: int
    children_rate: float  # children ending per second
    tasks: int  # subscribed tasks of the metadata run
    patches: int  # metadata patches (and progress callbacks) in all
    patch_rate: float
    timeout_s: float


FULL = Sizes(
    children=10_000, children_rate=500.0, tasks=1_000, patches=1_000, patch_rate=50.0, timeout_s=120.0
)
SMOKE = Sizes(children=50, children_rate=1_000.0, tasks=20, patches=20, patch_rate=200.0, timeout_s=30.0)


@dataclass
class Subscriber:
    """One socket's frames, counted by type; the last ``children`` counts seen."""

    frames: dict[str, int] = field(default_factory=dict)
    children: dict[str, int] | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def follow(self, socket: Any) -> None:
        with contextlib.suppress(websockets.ConnectionClosed):
            async for text in socket:
                frame = json.loads(text)
                kind = frame.get("type", "")
                self.frames[kind] = self.frames.get(kind, 0) + 1
                if kind == "children":
                    self.children = frame["children"]
                elif kind in ("snapshot", "resume") and "children" in frame.get("task", {}):
                    self.children = frame["task"]["children"]
                self.changed.set()


@contextlib.asynccontextmanager
async def subscribed(server: harness.Server, made: list[dict[str, Any]]) -> AsyncIterator[list[Subscriber]]:
    """One subscriber per task of ``made`` (create answers), connected, following until the block ends."""
    async with contextlib.AsyncExitStack() as stack:
        sockets = []
        for first in range(0, len(made), CONNECT_AT_ONCE):
            sockets += await asyncio.gather(
                *(
                    stack.enter_async_context(
                        websockets.connect(
                            f"{server.ws}/v1/tasks/{m['task']['id']}/ws?cursor={m['task']['version']}"
                            f"&token={m['subscribeToken']}",
                            max_size=None,
                        )
                    )
                    for m in made[first : first + CONNECT_AT_ONCE]
                )
            )
        subscribers = [Subscriber() for _ in sockets]
        readers = [
            asyncio.create_task(s.follow(socket)) for s, socket in zip(subscribers, sockets, strict=True)
        ]
        try:
            yield subscribers
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)


async def until(condition: Callable[[], bool], subscribers: list[Subscriber], timeout_s: float) -> bool:
    """Wait until ``condition`` holds (checked as frames come); False past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        for s in subscribers:
            s.changed.clear()
        waits = [asyncio.create_task(s.changed.wait()) for s in subscribers]
        await asyncio.wait(waits, timeout=min(left, 0.5), return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
    return True


async def paced(count: int, rate: float, step: Callable[[int], Awaitable[None]]) -> float:
    """``step(i)`` for i in 0..count-1, each due at ``i / rate`` (or as soon as one of the ``SENDERS``
    is free); the seconds from the first to the last answered."""
    started = time.perf_counter()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)

    async def sender() -> None:
        while not queue.empty():
            i = queue.get_nowait()
            await asyncio.sleep(max(0.0, started + i / rate - time.perf_counter()))
            await step(i)

    await asyncio.gather(*(sender() for _ in range(SENDERS)))
    return time.perf_counter() - started


async def post(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], token: str = ""
) -> tuple[httpx.Response, bool]:
    """POST, sent again after a connection the server closed while idle (each request here may be
    repeated: a create by its id, a callback by its callbackId, a patch is the same merge); the answer, and
    whether it was sent again."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    for tries in range(3):
        try:
            answer = await http.post(url, json=body, headers=headers)
        except httpx.TransportError:
            if tries == 2:
                raise
            continue
        answer.raise_for_status()
        return answer, tries > 0
    raise AssertionError("unreachable")


async def create(http: httpx.AsyncClient, count: int, body: dict[str, Any]) -> list[dict[str, Any]]:
    run = uuid.uuid4().hex[:8]
    made: list[dict[str, Any]] = [{} for _ in range(count)]

    async def one(i: int) -> None:
        answer, _ = await post(http, "/v1/tasks", {"id": f"b-{run}-{i}", "ttlMs": 3_600_000, **body})
        made[i] = answer.json()

    await paced(count, 1e9, one)
    return made


async def callback(http: httpx.AsyncClient, made: dict[str, Any], event: dict[str, Any]) -> None:
    body = {"callbackId": uuid.uuid4().hex, "event": event}
    answer, again = await post(http, f"/v1/tasks/{made['task']['id']}/callbacks", body, made["callbackToken"])
    if not again and not answer.json().get("changed"):
        raise RuntimeError(f"a callback ({event['type']}) changed nothing: {answer.text}")


# --- 1. children -------------------------------------------------------------------------------------


async def drive(port: int, sizes: Sizes, tasks: str) -> dict[str, Any]:
    """Each task of ``tasks`` (JSON lines) started and succeeded at ``children_rate`` a second, by a client
    process of its own (bench/programs/paced_callbacks.py); its summary."""
    client = await harness.spawn(
        harness.program("paced_callbacks", str(port), str(sizes.children_rate), str(SENDERS)),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        out, _ = await asyncio.wait_for(client.communicate(tasks.encode()), sizes.timeout_s + 60)
    finally:
        await harness.stop(client, 5)
    summary: dict[str, Any] = json.loads(out.decode().strip().splitlines()[-1])
    return summary


async def children_side(server: harness.Server, sizes: Sizes, with_parent: bool) -> dict[str, Any]:
    """N tasks started and succeeded at ``children_rate`` (children of one parent followed by one
    subscriber, or tasks of no parent): the gateway's CPU per transition."""
    limits = httpx.Limits(max_connections=SENDERS)
    async with httpx.AsyncClient(base_url=server.http, timeout=60, limits=limits) as http:
        body: dict[str, Any] = {}
        parents = []
        if with_parent:
            parents = await create(http, 1, {"title": "bench batch"})
            body["parent"] = parents[0]["task"]["id"]
        t0 = time.monotonic()
        made = await create(http, sizes.children, body)
        created_s = time.monotonic() - t0
        tasks = "".join(json.dumps({"id": m["task"]["id"], "token": m["callbackToken"]}) + "\n" for m in made)
        async with subscribed(server, parents) as subscribers:
            cpu_before = harness.cpu_seconds(server.pid)
            async with harness.profiled(server.pid, f"batches-children-{with_parent}"):
                driven = await drive(server.port, sizes, tasks)
                elapsed = driven["elapsed"]
                exact = {"total": sizes.children, "queued": 0, "running": 0}
                exact.update(succeeded=sizes.children, failed=0, expired=0)
                done = await until(lambda: all(s.children == exact for s in subscribers), subscribers, 30)
                cpu = harness.cpu_seconds(server.pid) - cpu_before
        result: dict[str, Any] = {"cpu_s": cpu, "elapsed": elapsed, "transitions": 2 * sizes.children}
        errors = driven["errors"]
        result["problems"] = [f"callbacks refused or without a change: {errors}"] if errors else []
        result["created_s"] = created_s
        result["cpu_us"] = cpu * 1e6 / result["transitions"]
        if with_parent:
            task = (await http.get(f"/v1/tasks/{parents[0]['task']['id']}")).json()
            result["problems"] += [
                f"the parent's {where} counts are {got}, not {exact}"
                for where, got in (("subscriber's", subscribers[0].children), ("JSON", task.get("children")))
                if got != exact
            ]
            result["frames"] = subscribers[0].frames.get("children", 0)
            result["done"] = done
    return result


# --- 2. metadata -------------------------------------------------------------------------------------


async def metadata_run(server: harness.Server, sizes: Sizes) -> tuple[dict[str, Any], dict[str, Any]]:
    """M running tasks, one subscriber each: metadata patches, then progress callbacks, at the same rate."""
    async with httpx.AsyncClient(
        base_url=server.http, timeout=60, limits=httpx.Limits(max_connections=SENDERS)
    ) as http:
        made = await create(http, sizes.tasks, {"title": "bench metadata"})
        await paced(sizes.tasks, 1e9, lambda i: callback(http, made[i], START))
        for m in made:
            m["task"]["version"] += 1  # the start: the subscribers follow from after it
        async with subscribed(server, made) as subscribers:
            if not await until(lambda: all(s.frames for s in subscribers), subscribers, sizes.timeout_s):
                raise RuntimeError("not every subscriber had its resume frame")
            results = {}
            for kind in ("metadata", "event"):

                async def patch(i: int) -> None:
                    m = made[i % sizes.tasks]
                    body = {"attempt": 1, "patch": {"message": f"step {i}"}}
                    await post(http, f"/v1/tasks/{m['task']['id']}/metadata", body, m["callbackToken"])

                async def progress(i: int) -> None:
                    event = {"type": "progress", "progress": i // sizes.tasks + 1, "cursor": f"step {i}"}
                    await callback(http, made[i % sizes.tasks], event)

                before = sum(s.frames.get(kind, 0) for s in subscribers)
                cpu_before = harness.cpu_seconds(server.pid)
                async with harness.profiled(server.pid, f"batches-{kind}"):
                    step = patch if kind == "metadata" else progress
                    elapsed = await paced(sizes.patches, sizes.patch_rate, step)

                    def delivered(kind: str = kind, before: int = before) -> int:
                        return sum(s.frames.get(kind, 0) for s in subscribers) - before

                    await until(lambda: delivered() >= sizes.patches, subscribers, sizes.timeout_s)
                    cpu = harness.cpu_seconds(server.pid) - cpu_before
                frames = delivered()
                results[kind] = {
                    "cpu_s": cpu,
                    "elapsed": elapsed,
                    "frames": frames,
                    "cpu_us": cpu * 1e6 / frames if frames else float("nan"),
                }
    return results["metadata"], results["event"]


# --- the workload --------------------------------------------------------------------------------------


async def workload(cfg: Any, servers: Any, report: Report) -> None:
    sizes: Sizes = cfg.batches
    harness.raise_nofile(sizes.tasks + 1024)
    sides = {}
    for with_parent in (False, True):  # the floor first
        async with servers.use("gateway") as server:
            sides[with_parent] = await children_side(server, sizes, with_parent)
    gw, fl = sides[True], sides[False]
    n = sizes.children
    report.rows.append(
        Row(
            NUMBER,
            f"batch of {n:,} children ending at {sizes.children_rate:g}/s, one subscriber of the parent: "
            "server CPU per child transition (floor: the same transitions of tasks without a parent)",
            gw["cpu_us"],
            fl["cpu_us"],
            "us",
            CHILDREN_TARGET,
            1,
        )
    )
    report.figure("batches children CPU per transition gateway", gw["cpu_us"])
    report.figure("batches children CPU per transition floor", fl["cpu_us"])
    report.problems.extend(f"batches: {problem}" for problem in gw["problems"])
    async with servers.use("gateway") as server:
        meta, progress = await metadata_run(server, sizes)
    report.rows.append(
        Row(
            NUMBER,
            f"metadata patches at {sizes.patch_rate:g}/s over {sizes.tasks:,} subscribed tasks: server CPU "
            "per delivered metadata frame (floor: progress callbacks, per event frame)",
            meta["cpu_us"],
            progress["cpu_us"],
            "us",
            METADATA_TARGET,
            1,
        )
    )
    report.figure("batches metadata CPU per frame gateway", meta["cpu_us"])
    report.figure("batches metadata CPU per frame floor", progress["cpu_us"])
    for kind, result in (("metadata", meta), ("event", progress)):
        if result["frames"] != sizes.patches:
            report.problems.append(
                f"batches: {result['frames']} {kind} frames delivered of {sizes.patches} sent (one each)"
            )
    report.details.append(
        f"batches: {n:,} children created in {gw['created_s']:.1f} s (floor {fl['created_s']:.1f} s), "
        f"ended in {gw['elapsed']:.1f} s, {n / gw['elapsed']:,.0f}/s of the {sizes.children_rate:g}/s asked "
        f"(floor {fl['elapsed']:.1f} s, {n / fl['elapsed']:,.0f}/s; "
        f"{2 * n:,} callbacks, {SENDERS} in flight at most), the parent's subscriber got {gw['frames']:,} "
        f"children frames (merged when behind) and ended on the exact counts: {not gw['problems']} | "
        f"metadata: {sizes.patches:,} patches in {meta['elapsed']:.1f} s, {meta['frames']:,} frames "
        f"delivered; progress: {progress['elapsed']:.1f} s, {progress['frames']:,} frames"
    )
