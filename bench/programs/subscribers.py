"""A subscriber client process of the benchmarks (started by ``harness.Clients``; not run by hand).

    python -m bench.programs.subscribers SPEC_JSON

SPEC: ``groups`` (``[url, count, expected resume frame type or null]``; a url ending in ``#final=V`` gives
its subscribers a final version of their own), ``final`` (the version at which a subscriber is complete),
``stream`` (read frames after the resume frame: until ``final``, or, while
``final`` is not known yet, until the server closes the socket; without it a subscriber is complete once
it has its resume frame), ``hold`` (a complete subscriber keeps its socket until "stop"), ``concurrency``
(handshakes in flight; 0: all at once), ``expect_close`` (the close code the server must end a complete
socket with; null: the client closes), ``timeout_s``, ``source`` (the loopback address its sockets connect
from, or null: the kernel's choice), ``timed_every`` (0 or absent: none; K: every K-th subscriber of this
process, the first included, notes the ``time.monotonic_ns()`` at which each of its ``event`` frames, or
``conflated`` snapshots, was read, reported by version as ``received``).

Its sockets are cheap: no compression, no keepalive pings, a receive queue of a few frames; from ``source``
with ``IP_BIND_ADDRESS_NO_PORT`` (Linux), so that the kernel picks each one's port per destination at
connect time (about 28,000 per source and destination, TIME_WAIT ports reused on loopback), not per source
at bind time.

It talks over stdin and stdout, one line each: prints ``{"state": "loaded"}``; on "go" connects every
subscriber and prints ``{"state": "ready", "t": ...}`` once each has its first frame (or failed), ``t``
being the monotonic time of the last one; takes "final V" (the last version, once the bench knows it);
prints ``{"state": "done", "stats": {...}}`` once each is complete (or on "stop"); then, holding, closes
every socket on "stop" and exits. Between "go" and "done" it prints ``{"state": "progress", "ready": R,
"frames": F, "done": D}`` every ``PROGRESS_S``.

A subscription refused with "try again" (an ``unavailable`` error frame, close 1013) or a connection that
failed is retried after a backoff, as a client would, up to ``RETRIES`` times, and counted.

Per subscriber it checks that the versions of ``event`` frames go 1 by 1 from the resume frame's version
(a ``snapshot`` with reason ``conflated`` may jump ahead) and counts deliveries, gaps (and the versions
they miss), reorders (a version at or below one already seen), and the versions missing at the end: on a
socket the server closed with a code saying why (4008 slow consumer, 1001 going away, 1011, 1013, 44xx:
the client knows it must resume), as ``cut``; otherwise (closed with 1000 before the end, or dropped), as
lost.

With ``chunks``, the same counts are of the stream's chunks by offset (protocol.md, Live: chunks and end;
read from offset 0, one attempt): each ``chunks`` frame must start at the offset after the last chunk held;
``final`` is the last chunk's offset, ``received`` the time of each chunk's frame by offset, ``deliveries``
the frames; the task's ``event`` frames and the ``end`` frame are passed over.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import random
import resource
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

import orjson
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, WebSocketException

from bench.lib.harness import COUNTS

# Attempts after the first, for a subscription refused with "try again" or a connection that failed.
RETRIES = 8

# Close codes by which the server says why it ends a stream early: the client knows to resume.
CUT = frozenset({1001, 1011, 1013, 4008, 4400, 4401, 4403, 4404})

# Linux's IP_BIND_ADDRESS_NO_PORT (the socket module has no name for it): bind the address, not a port.
IP_BIND_ADDRESS_NO_PORT = 24
OPEN_TIMEOUT_S = 120
# While connecting and reading, a process says this often how many of its subscribers have their resume
# frame, the frames they read and how many are complete (a "progress" line): the bench tells a slow step
# from a stuck one.
PROGRESS_S = 5.0


async def open_socket(url: str, source: str) -> socket.socket:
    """A TCP socket connected to ``url``'s host and port from the address ``source``."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
        sock.bind((source, 0))
        await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port or 80))
    except BaseException:
        sock.close()
        raise
    return sock


async def open_connection(url: str, source: str | None) -> ClientConnection:
    """A WebSocket to ``url`` (from ``source`` if given), as cheap in memory as websockets makes one."""
    options: dict[str, Any] = {
        "open_timeout": OPEN_TIMEOUT_S,
        "ping_interval": None,
        "compression": None,
        "max_size": 2**22,
        "max_queue": 4,
        "write_limit": 4096,
    }
    if source is None:
        return await connect(url, **options)
    async with asyncio.timeout(OPEN_TIMEOUT_S):
        sock = await open_socket(url, source)
    try:
        return await connect(url, sock=sock, **options)
    except BaseException:
        sock.close()
        raise


class Sub:
    __slots__ = (
        "close_code",
        "complete",
        "conflated",
        "deliveries",
        "error",
        "expect",
        "final",
        "gaps",
        "last",
        "missing",
        "received",
        "reorders",
        "resume",
        "retried",
        "retries",
        "unexpected",
    )

    def __init__(self, expect: str | None, final: int | None = None) -> None:
        self.expect = expect
        self.final = final  # its own, else the run's
        # (version, monotonic ns when read) of each frame, for a subscriber whose frames are timed.
        self.received: list[tuple[int, int]] | None = None
        self.resume: str | None = None
        self.last = -1
        self.deliveries = 0
        self.gaps = 0
        self.missing = 0
        self.reorders = 0
        self.conflated = 0
        self.unexpected = 0
        self.error: str | None = None
        self.close_code: int | None = None
        self.complete = False
        self.retries = 0
        self.retried: str | None = None


def write(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def main(spec: dict[str, Any]) -> None:
    groups = [(url, int(count), expect) for url, count, expect in spec["groups"]]
    total = sum(count for _, count, _ in groups)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < total + 64:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, total + 64), hard))
    final: int | None = spec["final"]
    stream: bool = spec["stream"]
    final_known = asyncio.Event()
    if final is not None:
        final_known.set()
    hold: bool = spec["hold"]
    expect_close: int | None = spec["expect_close"]
    source: str | None = spec.get("source")
    gate = asyncio.Semaphore(spec["concurrency"]) if spec["concurrency"] else None
    every = int(spec.get("timed_every") or 0)
    chunks_of: str | None = spec.get("chunks")
    subs = [Sub(expect, own_final(url)[1]) for url, count, expect in groups for _ in range(count)]
    if every:
        for sub in subs[::every]:
            sub.received = []
    urls = [own_final(url)[0] for url, count, _ in groups for _ in range(count)]
    pending_ready = len(subs)
    pending_done = len(subs)
    all_ready = asyncio.Event()
    all_done = asyncio.Event()
    stop = asyncio.Event()
    last_ready = 0.0

    def goal(sub: Sub) -> int | None:
        return sub.final if sub.final is not None else final

    def readied() -> None:
        nonlocal pending_ready, last_ready
        pending_ready -= 1
        last_ready = time.monotonic()
        if pending_ready == 0:
            all_ready.set()

    def finished() -> None:
        nonlocal pending_done
        pending_done -= 1
        if pending_done == 0:
            all_done.set()

    async def subscribe(url: str, sub: Sub) -> tuple[ClientConnection, dict[str, Any]]:
        """Connect and read the first frame; a refusal saying "try again" (an ``unavailable`` error frame)
        or a failed connection is retried after a backoff, as a client would, and counted."""
        for attempt in range(RETRIES + 1):
            try:
                async with gate if gate is not None else contextlib.nullcontext():
                    ws = await open_connection(url, source)
                    first = orjson.loads(await ws.recv())
            except (OSError, TimeoutError, WebSocketException) as exc:
                if attempt == RETRIES:
                    raise
                sub.retried = f"{type(exc).__name__}: {exc}"[:200]
            else:
                if (
                    not (first.get("type") == "error" and first.get("code") == "unavailable")
                    or attempt == RETRIES
                ):
                    return ws, first
                sub.retried = f"error frame: {first.get('code')}: {first.get('message')}"[:200]
                await ws.close()
            sub.retries += 1
            await asyncio.sleep(min(2.0, 0.1 * 2**attempt) * random.uniform(0.5, 1.0))
        raise AssertionError("unreachable")

    async def one(url: str, sub: Sub) -> None:
        ready = done = False
        try:
            ws, first = await subscribe(url, sub)
            try:
                sub.resume = first.get("type")
                sub.last = -1 if chunks_of is not None else first.get("version", -1)
                if sub.resume == "error":
                    sub.error = f"error frame: {first.get('code')}: {first.get('message')}"[:200]
                ready = True
                readied()
                while stream and (goal(sub) is None or sub.last < (goal(sub) or 0)):
                    try:
                        raw = await ws.recv()
                        at = time.monotonic_ns()
                        message = orjson.loads(raw)
                    except ConnectionClosed:
                        sub.close_code = ws.close_code
                        break
                    kind, version = message.get("type"), message.get("version", -1)
                    if chunks_of is not None:
                        follow_chunks(sub, chunks_of, message, at)
                    elif kind == "event" or (kind == "snapshot" and message.get("reason") == "conflated"):
                        sub.deliveries += 1
                        if sub.received is not None:
                            sub.received.append((version, at))
                        if version == sub.last + 1:
                            sub.last = version
                        elif version > sub.last + 1:
                            if kind == "snapshot":
                                sub.conflated += 1  # it stands for the versions it jumps
                            else:
                                sub.gaps += 1
                                sub.missing += version - sub.last - 1
                            sub.last = version
                        else:
                            sub.reorders += 1
                    else:
                        sub.unexpected += 1
                if stream and sub.final is None:
                    await final_known.wait()
                    assert final is not None
                sub.complete = not stream or sub.last >= (goal(sub) or 0)
                if expect_close is not None and sub.complete:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(30):
                            await ws.wait_closed()
                    sub.close_code = ws.close_code
                done = True
                finished()
                if hold and expect_close is None:
                    await stop.wait()
            finally:
                await ws.close()
        except asyncio.CancelledError:
            pass
        except Exception as exc:
            sub.error = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            if not ready:
                readied()
            if not done:
                finished()

    async def commands() -> None:
        nonlocal final
        reader = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            command = line.decode().strip()
            if command == "go":
                go.set()
            elif command.startswith("final "):
                final = int(command.split()[1])
                final_known.set()
            elif command == "stop":
                stop.set()
                go.set()
        stop.set()  # stdin closed: the bench is gone
        go.set()

    async def report_progress() -> None:
        while True:
            await asyncio.sleep(PROGRESS_S)
            frames = sum(sub.deliveries for sub in subs)
            ready, done = len(subs) - pending_ready, len(subs) - pending_done
            write({"state": "progress", "ready": ready, "frames": frames, "done": done})

    go = asyncio.Event()
    listener = asyncio.create_task(commands())
    write({"state": "loaded"})
    deadline = time.monotonic() + spec["timeout_s"]
    await go.wait()
    started = time.monotonic()
    tasks = [asyncio.create_task(one(url, sub)) for url, sub in zip(urls, subs, strict=True)]
    watch = asyncio.create_task(stop.wait())
    progress = asyncio.create_task(report_progress())
    await until(all_ready, watch, deadline)
    write({"state": "ready", "t": last_ready or time.monotonic(), "t_go": started})
    await until(all_done, watch, deadline)
    if not all_done.is_set():  # stopped or timed out: what has not arrived by now is missing
        await cancel_incomplete(tasks, subs)
    progress.cancel()
    stats = report(subs, final if final_known.is_set() else None, expect_close)
    write({"state": "done", "stats": stats})
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), max(0.0, deadline - time.monotonic()) + 5)
    stop.set()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)
    listener.cancel()


def follow_chunks(sub: Sub, stream: str, message: dict[str, Any], at: int) -> None:
    """A frame read by a subscriber following ``stream``'s chunks (``sub.last``: the last offset held)."""
    kind = message.get("type")
    if kind != "chunks" or message.get("stream") != stream:
        if kind not in ("event", "end"):
            sub.unexpected += 1
        return
    offset, count = message["offset"], len(message["chunks"])
    sub.deliveries += 1
    if sub.received is not None:
        sub.received += [(offset + i, at) for i in range(count)]
    if offset > sub.last + 1:
        sub.gaps += 1
        sub.missing += offset - sub.last - 1
    elif offset <= sub.last:
        sub.reorders += 1  # a chunk sent again
    sub.last = max(sub.last, offset + count - 1)


def own_final(url: str) -> tuple[str, int | None]:
    """``url`` without its ``#final=V``, and V (None if it has none)."""
    base, mark, version = url.partition("#final=")
    return base, int(version) if mark else None


async def until(event: asyncio.Event, watch: asyncio.Task[Any], deadline: float) -> None:
    """Wait for ``event`` until ``deadline`` (``time.monotonic()``), or until ``watch`` (the stop) ends."""
    await asyncio.wait(
        [asyncio.create_task(event.wait()), watch],
        timeout=max(0.0, deadline - time.monotonic()),
        return_when=asyncio.FIRST_COMPLETED,
    )


async def cancel_incomplete(tasks: Sequence[asyncio.Task[Any]], subs: Sequence[Any]) -> None:
    """Stopped or timed out: cancel each subscriber's task whose stream is not complete (what has not arrived
    by now is missing)."""
    for task, sub in zip(tasks, subs, strict=True):
        if not sub.complete:
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def report(subs: list[Sub], final: int | None, expect_close: int | None) -> dict[str, Any]:
    resume: dict[str, int] = {}
    errors: list[str] = []
    stats = dict.fromkeys(COUNTS, 0)
    stats["subscribers"] = len(subs)
    closes: dict[str, int] = {}
    received: dict[str, list[int]] = {}
    for sub in subs:
        for version, at in sub.received or ():
            received.setdefault(str(version), []).append(at)
        stats["retries"] += sub.retries
        for error in (sub.error, sub.retried and f"retried after {sub.retried}"):
            if error and len(errors) < 5 and error not in errors:
                errors.append(error)
        if sub.resume is None:
            stats["failed"] += 1
            continue
        stats["connected"] += 1
        resume[sub.resume] = resume.get(sub.resume, 0) + 1
        if sub.expect is not None and sub.resume != sub.expect:
            stats["resume_mismatch"] += 1
        for key in ("deliveries", "gaps", "missing", "reorders", "conflated", "unexpected"):
            stats[key] += getattr(sub, key)
        if sub.close_code is not None:
            closes[str(sub.close_code)] = closes.get(str(sub.close_code), 0) + 1
        if not sub.complete:
            stats["incomplete"] += 1
            goal = sub.final if sub.final is not None else final
            missing = max(0, goal - sub.last) if goal is not None else 0
            if sub.close_code is not None and sub.close_code in CUT:
                stats["cut"] += 1
                stats["cut_missing"] += missing
            else:
                stats["tail_missing"] += missing
        elif expect_close is not None and sub.close_code != expect_close:
            stats["bad_close"] += 1
    return {**stats, "resume": resume, "closes": closes, "errors": errors, "received": received}


# The client processes share this machine with the server under test, where a deployment's clients are on
# other machines: they run under SCHED_IDLE (Linux), taking only CPU time the server (gateway or floor alike)
# does not want, and never delaying its wake-ups (a nice-10 client busy on the other core still held a
# waking server thread for its whole time slice, a few ms); elsewhere at nice 10.
NICE = 10


def step_aside(cores: list[int] | None = None) -> None:
    """SCHED_IDLE (nice 10 where there is none); on ``cores`` if given (``harness.split_cores``)."""
    if cores:
        os.sched_setaffinity(0, cores)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(NICE)


if __name__ == "__main__":
    argument = sys.argv[1]
    if argument.startswith("@"):  # a spec too long for an argument, in a file (harness.spec_argument)
        with open(argument[1:]) as spec_file:
            argument = spec_file.read()
        os.unlink(spec_file.name)
    spec = json.loads(argument)
    step_aside(spec.get("cores"))
    # No cyclic collection in a client process: it lives for one step and keeps what it makes, and passes of
    # the collector over its live sockets' objects (hundreds of thousands at 17,000 sockets) were 12% of its
    # CPU (py-spy), time a client on a machine of its own would not take from the server's cores.
    gc.disable()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(spec))
