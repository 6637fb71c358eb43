"""A client process of the tag benchmarks (started by ``bench/workloads/tags.py``; not run by hand).

    python -m bench.programs.tag_subscribers   (its spec as the first line of stdin)

SPEC: ``url`` (the gateway's ``/v1/ws``), ``mode`` (``tag``: each socket sends one tag subscription, with
its cursors; ``tasks``: each socket sends one task subscription per task, with its cursor and a task
token), ``secret`` (to mint the tokens, as a backend holding ``GATEWAY_SECRET`` does), ``sockets``
(``[tag, {task id: cursor}]`` each), ``stream`` (after the resume frames, read until every task has its
final version, given later by "final"), ``concurrency`` (handshakes in flight; 0: all at once),
``timeout_s``, ``cores``.

It talks as bench/programs/subscribers.py does, one line each way: prints ``{"state": "loaded"}`` once its
tokens are minted; on "go" connects every socket and subscribes, and prints ``{"state": "ready", "t": ...}``
once every socket has the resume frame of each of its tasks (``t``: the monotonic time of the last); takes
"final {task id: version, ...}" (the tasks that changed; the others end at their resume frame's version);
prints ``{"state": "done", "stats": {...}}`` once every task of every socket is at its final version (or on
"stop"); closes every socket on "stop" and exits.

A connection that failed is retried after a backoff, as a client would, and so is a subscription refused
with "try again" (an ``unavailable`` error frame), up to ``RETRIES`` times; the retries are counted.

Per task it checks what bench/programs/subscribers.py checks per subscriber: the resume frame first, then
``event`` frames at last + 1 (a ``conflated`` snapshot may jump ahead); gaps, reorders and what is missing at
the end are counted. In ``tag`` mode the socket's first frame must be the ``tag`` listing naming exactly its
tasks (else ``resume_mismatch``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import resource
import sys
import time
from typing import Any

import jwt
import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from bench.lib.harness import COUNTS
from bench.programs.subscribers import RETRIES, cancel_incomplete, step_aside, until, write

RESUMES = ("caught-up", "delta", "snapshot")


class Socket:
    """One socket's subscriptions and what came of them."""

    __slots__ = (
        "again",
        "close_code",
        "complete",
        "conflated",
        "cursors",
        "deliveries",
        "error",
        "gaps",
        "last",
        "missing",
        "ready",
        "reorders",
        "resume",
        "resume_mismatch",
        "retries",
        "tag",
        "unexpected",
    )

    def __init__(self, tag: str, cursors: dict[str, int]) -> None:
        self.tag = tag
        self.cursors = cursors
        self.last: dict[str, int] = {}  # task id -> version held (from its resume frame on)
        self.resume: dict[str, int] = {}
        self.deliveries = self.gaps = self.missing = self.reorders = self.conflated = self.unexpected = 0
        self.resume_mismatch = 0
        self.retries = 0
        self.again: list[str] = []  # subscriptions refused with "try again" (unavailable), to send again
        self.error: str | None = None
        self.close_code: int | None = None
        self.ready = False
        self.complete = False

    def feed(self, frame: dict[str, Any]) -> None:
        kind, task_id, version = frame.get("type"), frame.get("taskId"), frame.get("version", -1)
        if kind == "tag":
            if sorted(frame.get("taskIds", ())) != sorted(self.cursors) or frame.get("more"):
                self.resume_mismatch += 1
            return
        if kind == "error":
            if frame.get("code") == "unavailable" and (
                task_id in self.cursors or frame.get("tag") == self.tag
            ):
                self.again.append(task_id if task_id in self.cursors else self.tag)
                return
            self.error = f"error frame: {frame.get('code')}: {frame.get('message')}"[:200]
            return
        if task_id not in self.cursors:
            self.unexpected += 1
            return
        held = self.last.get(task_id)
        if held is None:
            if kind not in RESUMES:
                self.unexpected += 1
                return
            reason = frame.get("reason")
            key = f"{kind}/{reason}" if reason else str(kind)
            self.resume[key] = self.resume.get(key, 0) + 1
            self.last[task_id] = version
            return
        if kind == "event" or (kind == "snapshot" and frame.get("reason") == "conflated"):
            self.deliveries += 1
            if version == held + 1:
                self.last[task_id] = version
            elif version > held + 1:
                if kind == "snapshot":
                    self.conflated += 1
                else:
                    self.gaps += 1
                    self.missing += version - held - 1
                self.last[task_id] = version
            else:
                self.reorders += 1
        else:
            self.unexpected += 1


def tokens_for(spec: dict[str, Any], sockets: list[Socket]) -> dict[str, str]:
    """The subscribe tokens each socket sends: one per tag, or one per task."""
    secret, exp = spec["secret"], int(time.time()) + 3600
    if spec["mode"] == "tag":
        claims = {s.tag: {"tag": s.tag, "scope": "subscribe", "exp": exp} for s in sockets}
    else:
        claims = {t: {"sub": t, "scope": "subscribe", "exp": exp} for s in sockets for t in s.cursors}
    return {key: jwt.encode(value, secret, algorithm="HS256") for key, value in claims.items()}


def messages(mode: str, sock: Socket, tokens: dict[str, str], only: list[str] | None = None) -> list[str]:
    """The socket's subscribe messages (``only``: for these tasks alone, in ``tasks`` mode)."""
    if mode == "tag":
        message = {"type": "subscribe", "tag": sock.tag, "token": tokens[sock.tag], "cursors": sock.cursors}
        return [orjson.dumps(message).decode()]
    return [
        orjson.dumps({"type": "subscribe", "taskId": t, "cursor": c, "token": tokens[t]}).decode()
        for t, c in sock.cursors.items()
        if only is None or t in only
    ]


async def main(spec: dict[str, Any], commands: asyncio.StreamReader) -> None:
    sockets = [Socket(tag, {t: int(c) for t, c in cursors.items()}) for tag, cursors in spec["sockets"]]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < len(sockets) + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, len(sockets) + 64), hard))
    tokens = tokens_for(spec, sockets)
    mode, url, stream = spec["mode"], spec["url"], spec["stream"]
    gate = asyncio.Semaphore(spec["concurrency"]) if spec["concurrency"] else None
    final: dict[str, int] | None = None
    final_known = asyncio.Event()
    go, stop = asyncio.Event(), asyncio.Event()
    all_ready, all_done = asyncio.Event(), asyncio.Event()
    pending = {"ready": len(sockets), "done": len(sockets)}
    last_ready = 0.0

    def count(what: str, event: asyncio.Event) -> None:
        nonlocal last_ready
        pending[what] -= 1
        if what == "ready":
            last_ready = time.monotonic()
        if pending[what] == 0:
            event.set()

    def finished(sock: Socket) -> bool:
        if final is None or len(sock.last) < len(sock.cursors):
            return False
        return all(sock.last[t] >= final.get(t, sock.last[t]) for t in sock.cursors)

    async def subscribe(sock: Socket) -> ClientConnection:
        """Connect and subscribe; a failed connection is retried after a backoff, as a client would."""
        for attempt in range(RETRIES + 1):
            try:
                async with gate if gate is not None else contextlib.nullcontext():
                    ws = await connect(
                        url, open_timeout=120, ping_interval=None, compression=None, max_size=2**24
                    )
                for message in messages(mode, sock, tokens):
                    await ws.send(message)
                return ws
            except (OSError, TimeoutError, WebSocketException) as exc:
                if attempt == RETRIES:
                    raise
                sock.error = f"retried after {type(exc).__name__}: {exc}"[:200]
            sock.retries += 1
            await asyncio.sleep(min(2.0, 0.1 * 2**attempt) * random.uniform(0.5, 1.0))
        raise AssertionError("unreachable")

    async def frames(sock: Socket, ws: ClientConnection) -> None:
        """Read until every task has its resume frame (then "ready") and, streaming, its final version."""
        while len(sock.last) < len(sock.cursors):
            sock.feed(orjson.loads(await ws.recv()))
            if sock.error is not None and sock.error.startswith("error frame"):
                return
            if sock.again:  # refused with "try again": again after a backoff, as a client would
                if sock.retries == RETRIES:
                    sock.error = f"still unavailable after {RETRIES} retries"
                    return
                await asyncio.sleep(min(2.0, 0.1 * 2**sock.retries) * random.uniform(0.5, 1.0))
                sock.retries += 1
                if mode == "tag":
                    sock.last.clear()  # the tag is listed and resumed again, whole
                for message in messages(mode, sock, tokens, sock.again):
                    await ws.send(message)
                sock.again.clear()
        sock.ready = True
        count("ready", all_ready)
        if not stream:
            sock.complete = True
            return
        told = asyncio.ensure_future(final_known.wait())
        reading: asyncio.Future[Any] | None = None
        try:
            while final is None or not finished(sock):
                if reading is None:
                    reading = asyncio.ensure_future(ws.recv())
                if final is None:
                    await asyncio.wait([reading, told], return_when=asyncio.FIRST_COMPLETED)
                    if not reading.done():
                        continue
                raw, reading = await reading, None
                sock.feed(orjson.loads(raw))
            sock.complete = True
        finally:
            for future in (told, reading):
                if future is not None and not future.done():
                    future.cancel()

    async def one(sock: Socket) -> None:
        ws: ClientConnection | None = None
        cancelled = False
        try:
            ws = await subscribe(sock)
            await frames(sock, ws)
        except ConnectionClosed as exc:
            sock.close_code = ws.close_code if ws is not None else None
            if not sock.complete:
                sock.error = f"closed before the end: {exc}"[:200]
        except asyncio.CancelledError:
            cancelled = True  # timed out or stopped: what has not come is missing
        except Exception as exc:
            sock.error = f"{type(exc).__name__}: {exc}"[:200]
        if not sock.ready:
            count("ready", all_ready)
        count("done", all_done)
        if ws is not None:
            if not cancelled:
                await stop.wait()  # held until the bench says stop
            await ws.close()

    async def listen() -> None:
        nonlocal final
        while line := await commands.readline():
            command = line.decode().strip()
            if command == "go":
                go.set()
            elif command.startswith("final "):
                final = {str(k): int(v) for k, v in json.loads(command[6:]).items()}
                final_known.set()
            elif command == "stop":
                stop.set()
                go.set()
        stop.set()  # stdin closed: the bench is gone
        go.set()

    listener = asyncio.create_task(listen())
    write({"state": "loaded"})
    deadline = time.monotonic() + spec["timeout_s"]
    await go.wait()
    started = time.monotonic()
    tasks = [asyncio.create_task(one(sock)) for sock in sockets]
    watch = asyncio.create_task(stop.wait())
    await until(all_ready, watch, deadline)
    write({"state": "ready", "t": last_ready or time.monotonic(), "t_go": started})
    await until(all_done, watch, deadline)
    if not all_done.is_set():  # stopped or timed out: what has not arrived by now is missing
        await cancel_incomplete(tasks, sockets)
    write({"state": "done", "stats": report(sockets, final)})
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), max(0.0, deadline - time.monotonic()) + 5)
    stop.set()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)
    listener.cancel()


def report(sockets: list[Socket], final: dict[str, int] | None) -> dict[str, Any]:
    """bench/lib/harness.py's counts (``merge_stats``), over sockets; ``resume`` counts resume frames by
    type."""
    stats: dict[str, Any] = dict.fromkeys(COUNTS, 0)
    stats.update(subscribers=len(sockets), resume={}, closes={}, errors=[])
    for sock in sockets:
        stats["retries"] += sock.retries
        if sock.error and len(stats["errors"]) < 5 and sock.error not in stats["errors"]:
            stats["errors"].append(sock.error)
        if not sock.ready:
            stats["failed"] += 1
            continue
        stats["connected"] += 1
        for kind, n in sock.resume.items():
            stats["resume"][kind] = stats["resume"].get(kind, 0) + n
        for key in (
            "deliveries",
            "gaps",
            "missing",
            "reorders",
            "conflated",
            "unexpected",
            "resume_mismatch",
        ):
            stats[key] += getattr(sock, key)
        if sock.close_code is not None:
            stats["closes"][str(sock.close_code)] = stats["closes"].get(str(sock.close_code), 0) + 1
        if not sock.complete:
            stats["incomplete"] += 1
            if final is not None:
                stats["tail_missing"] += sum(
                    max(0, final.get(t, sock.last.get(t, 0)) - sock.last.get(t, 0)) for t in sock.cursors
                )
    return stats


async def run() -> None:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**26)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    spec = json.loads(await reader.readline())
    step_aside(spec.get("cores"))
    await main(spec, reader)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())
