"""The Python clients against a real server: ``watch`` through dropped connections, the ``Worker``'s
retries, and the ``gateway watch`` terminal client's exit codes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import contextmanager

import anyio
import pytest
from anyio.abc import ByteReceiveStream, Process

from bench.checks.dead_link import watch_through_a_dead_link
from gateway.client import Worker, watch
from gateway.client.backoff import Backoff
from gateway.client.watch import LinkStatus, WatchError
from tests.support import STEP_S, Running, TcpProxy, create_task, http_client, running_gateway, wait_until

TERMINAL = {"succeeded", "failed", "expired"}


@contextmanager
def _killed_on_failure(process: Process) -> Iterator[None]:
    """A test that fails must not wait for its subprocess to end by itself."""
    try:
        yield
    except BaseException:
        if process.returncode is None:
            process.kill()
        raise


def port_of(gw: Running) -> int:
    return int(gw.url.rsplit(":", 1)[1])


async def run_two_hundred_entries(
    worker: Worker, before: Callable[[int], Awaitable[None]] | None = None
) -> None:
    """start, progress 1..99, retryable fail (101 entries); start, progress 1..97, succeed (99 entries).
    ``before(version)`` is awaited before the callback that makes that version."""
    version = 0

    async def next_version() -> None:
        nonlocal version
        version += 1
        if before is not None:
            await before(version)

    await next_version()
    await worker.start("w1")
    for p in range(1, 100):
        await next_version()
        await worker.progress(p, f"row-{p}")
    await next_version()
    await worker.fail("lost the lease", retryable=True)
    await next_version()
    await worker.start("w2")
    for p in range(1, 98):
        await next_version()
        await worker.progress(p, f"row-{p}")
    await next_version()
    await worker.succeed("s3://results/1", "sha256:1")


@pytest.mark.anyio
async def test_watch_survives_five_drops_gapless_and_without_duplicates(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, retention_versions=10_000) as gw, TcpProxy(port_of(gw)) as proxy:
        made = await create_task(gw, "long-1", ttl_ms=120_000, max_attempts=2)
        versions: list[int] = []
        last_frame: dict[str, object] = {}
        cut_at = [30, 60, 90, 120, 150]
        cut = anyio.Event()  # set by each cut; the producer waits for it past each place of a cut

        async def until_cut(version: int) -> None:
            # The watcher cuts once it has seen a place of cut_at; the producer goes past that place only
            # then, so that every cut happens whatever the pace of the watcher (a delta after a reconnect
            # can carry many entries at once).
            nonlocal cut
            if version - 1 in (30, 60, 90, 120, 150):
                await cut.wait()
                cut = anyio.Event()

        async def produce() -> None:
            async with Worker(gw.url, "long-1", made["callbackToken"]) as worker:
                await run_two_hundred_entries(worker, until_cut)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                frames = watch(
                    proxy.url, {"long-1": made["subscribeToken"]}, backoff=Backoff(base_s=0.01, cap_s=0.1)
                )
                async for frame in frames:
                    if frame["type"] == "event":
                        versions.append(frame["version"])
                    else:
                        assert frame["type"] in ("caught-up", "delta"), frame
                        versions.extend(e["version"] for e in frame.get("events", []))
                    last_frame = frame
                    if cut_at and len(versions) >= cut_at[0]:
                        cut_at.pop(0)
                        proxy.cut()
                        cut.set()

        assert proxy.cuts == 5
        assert versions == list(range(1, 201))
        final = (await gw.client.get("/v1/tasks/long-1")).json()
        assert last_frame["task"] == final
        assert final["state"] == "succeeded" and final["version"] == 200


@pytest.mark.anyio
async def test_worker_retries_after_lost_answers_change_the_task_once(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw, TcpProxy(port_of(gw)) as proxy:
        made = await create_task(gw, "job-1", ttl_ms=120_000, max_attempts=2)
        async with http_client(timeout=5) as client:
            worker = Worker(proxy.url, "job-1", made["callbackToken"], client=client)
            await worker.start("w1")
            # The gateway commits the next two callbacks, but their answers never reach the worker.
            proxy.drop_responses = 1
            answer = await worker.progress(50, "half")
            assert answer["duplicateCallback"] is True and answer["changed"] is False
            proxy.drop_responses = 1
            answer = await worker.succeed("s3://r", "sha256:r")
            assert answer["duplicateCallback"] is True
            assert answer["task"]["state"] == "succeeded"
        events = (await gw.client.get("/v1/tasks/job-1/events", params={"cursor": 0})).json()
        assert [e["event"]["type"] for e in events["events"]] == ["start", "progress", "succeed"]
        assert events["version"] == 3


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("ending", "code"),
    [("succeed", 0), ("fail", 1), ("expire", 3), ("cancel", 1)],
)
async def test_gateway_watch_shows_the_task_and_exits_by_its_fate(
    sqlite_url: str, ending: str, code: int
) -> None:
    async with running_gateway(sqlite_url) as gw:
        made = await create_task(
            gw, f"cli-{ending}", ttl_ms=3_000 if ending == "expire" else 120_000, max_attempts=1
        )
        env = {**os.environ, "COLUMNS": "100"}
        process = await anyio.open_process(
            [
                sys.executable,
                "-m",
                "gateway.cli",
                "watch",
                f"cli-{ending}",
                "--url",
                gw.url,
                "--token",
                made["subscribeToken"],
            ],
            env=env,
        )
        async with process, Worker(gw.url, f"cli-{ending}", made["callbackToken"]) as worker:
            await worker.start("w")
            await worker.progress(40, "c")
            if ending == "succeed":
                await worker.succeed("s3://r", "sha256:r")
            elif ending == "fail":
                await worker.fail("bad input", retryable=False)
            elif ending == "cancel":  # a cancelled task is failed: exit 1, and the entry says why
                answer = await gw.client.post("/v1/tasks/cli-cancel/cancel", json={"reason": "wrong export"})
                assert answer.status_code == 200, answer.text
            assert process.stdout is not None
            with anyio.fail_after(20):
                output = b"".join([chunk async for chunk in process.stdout]).decode()
                returncode = await process.wait()
        assert returncode == code
        state = {"succeed": "succeeded", "fail": "failed", "expire": "expired", "cancel": "failed"}[ending]
        assert state in output
        if ending == "cancel":
            assert "cancelled: wrong export" in output, output


@pytest.mark.anyio
async def test_watch_replaces_a_silently_dead_link(sqlite_url: str) -> None:
    """The link dies without a FIN (the relay stops forwarding both ways and closes nothing): ``watch``
    notices by its pings, opens a new connection, resumes from its cursor and ends with the task exactly as
    the gateway has it; the change is reported once each way. How soon (within 10 s) is no test, a loaded
    machine can miss it: it is the bench check ``watch-dead-link`` (bench/checks/dead_link.py), whose
    scenario this is."""
    async with running_gateway(sqlite_url) as gw, TcpProxy(port_of(gw)) as proxy:
        watched = await watch_through_a_dead_link(gw.client, proxy, STEP_S)
    assert proxy.accepted == 2  # the dead socket was replaced by a new connection
    assert sorted(set(watched.versions)) == watched.versions == [1, 2, 3, 4, 5], watched.versions
    assert watched.last["task"] == watched.final and watched.final["state"] == "succeeded"
    statuses = watched.statuses
    assert [s.connected for s in statuses] == [False, True], statuses
    assert statuses[0].message.startswith(f"lost the connection to {proxy.url}"), statuses
    assert statuses[1].message == f"reconnected to {proxy.url}"


@pytest.mark.anyio
async def test_watch_says_once_that_it_cannot_reach_the_gateway_and_once_that_it_is_back(
    sqlite_url: str,
) -> None:
    async with running_gateway(sqlite_url) as gw, TcpProxy(port_of(gw)) as proxy:
        made = await create_task(gw, "unreachable", ttl_ms=120_000, max_attempts=1)
        proxy.refuse = True
        statuses: list[LinkStatus] = []
        frames = watch(
            proxy.url,
            {"unreachable": made["subscribeToken"]},
            backoff=Backoff(base_s=0.01, cap_s=0.02),
            on_status=statuses.append,
        )
        assert isinstance(frames, AsyncGenerator)  # watch() is one: closed below, once the frame came
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:

                async def let_through_after_attempts() -> None:
                    await wait_until(lambda: proxy.refused >= 5, "five attempts refused by the relay")
                    proxy.refuse = False

                tg.start_soon(let_through_after_attempts)
                async for frame in frames:
                    assert frame["type"] == "caught-up"
                    break
                await frames.aclose()
        assert proxy.refused >= 5
        assert [s.connected for s in statuses] == [False, True], statuses  # not once per attempt
        # The first waits are under 0.05 s (backoff from 0.01 s): "at once", never "in 0.0 s".
        assert re.fullmatch(rf"cannot reach {proxy.url}, retrying at once \(.+\)", statuses[0].message)
        assert statuses[0].retry_in_s is not None
        assert statuses[1].message == f"reconnected to {proxy.url}"


@pytest.mark.anyio
async def test_gateway_watch_says_when_the_link_goes_and_comes_back_and_survives_a_dead_link(
    sqlite_url: str,
) -> None:
    """``gateway watch`` through a relay that first refuses every connection, then lets them through, then
    dies silently (no FIN) mid-task: one line on stderr when it cannot reach the gateway (not one per
    attempt), one when the link is lost, one "reconnected" after each, and it still ends with the task's
    fate (the task's lines on stdout)."""
    async with running_gateway(sqlite_url) as gw, TcpProxy(port_of(gw)) as relay:
        made = await create_task(gw, "cli-link", ttl_ms=120_000, max_attempts=1)
        relay.refuse = True
        command = [sys.executable, "-m", "gateway.cli", "watch", "cli-link", "--url", relay.url]
        env = {**os.environ, "COLUMNS": "200", "GATEWAY_TOKEN": made["subscribeToken"]}
        process = await anyio.open_process(command, env=env)
        async with process, Worker(gw.url, "cli-link", made["callbackToken"]) as worker:
            assert process.stdout is not None and process.stderr is not None
            out: list[str] = []
            err: list[str] = []

            async def read_lines(stream: ByteReceiveStream, lines: list[str]) -> None:
                buffered = b""
                async for chunk in stream:
                    buffered += chunk
                    *done, buffered = buffered.split(b"\n")
                    lines.extend(line.decode() for line in done)
                lines.append(buffered.decode())

            async def output_has(lines: list[str], text: str) -> None:
                await wait_until(
                    lambda: any(text in line for line in lines),
                    lambda: f"{text!r} said by gateway watch (stdout {out}, stderr {err})",
                    within_s=30,  # a process's start on a loaded machine; the test's own bound is 40 s
                )

            with anyio.fail_after(40), _killed_on_failure(process):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(read_lines, process.stdout, out)
                    tg.start_soon(read_lines, process.stderr, err)
                    await output_has(err, "cannot reach")
                    await wait_until(
                        lambda: relay.refused >= 3, "three attempts refused by the relay", within_s=30
                    )
                    relay.refuse = False
                    await worker.start("w")
                    await output_has(out, "v1  started by w")
                    relay.stall()
                    await worker.progress(40, "c")
                    await output_has(out, "v2  progress 40%")
                    await worker.succeed("s3://r", "sha256:r")
                    returncode = await process.wait()
        assert returncode == 0, (out, err)
        assert len([line for line in err if "cannot reach" in line]) == 1, err
        assert len([line for line in err if "lost the connection" in line]) == 1, err
        assert len([line for line in err if f"reconnected to {relay.url}" in line]) == 2, err
        assert not any("cannot reach" in line or "reconnected" in line for line in out), out
        assert any("cli-link: succeeded" in line for line in out), out


class AnswerServer:
    """A loopback TCP server that answers each connection with the next of ``answers`` (in turn, round
    and round): bytes sent before it closes, or ``None`` to reset the connection at once."""

    def __init__(self, answers: list[bytes | None]) -> None:
        self.answers = answers
        self.served = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> AnswerServer:
        self._server = await asyncio.start_server(self._answer, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        answer = self.answers[self.served % len(self.answers)]
        self.served += 1
        if answer is None:
            writer.transport.abort()
            return
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            await reader.readuntil(b"\r\n\r\n")  # the handshake request
            writer.write(answer)
            await writer.drain()
        writer.close()


UNAVAILABLE = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


@pytest.mark.anyio
async def test_watch_says_each_distinct_failure_once_not_once_per_attempt() -> None:
    """Two failures taking turns (a proxy answering 503, a connection reset): each is said once, with its
    reason, however many attempts fail."""
    async with AnswerServer([UNAVAILABLE, None]) as server:
        statuses: list[LinkStatus] = []
        frames = watch(
            server.url,
            {"t": None},
            backoff=Backoff(base_s=0.001, cap_s=0.005),
            max_reconnects=12,
            on_status=statuses.append,
        )
        with anyio.fail_after(20), pytest.raises(WatchError) as raised:
            async for _ in frames:
                pass
    assert raised.value.code == "disconnected"
    assert server.served == 13
    messages = [s.message for s in statuses]
    assert len(messages) == 2, messages
    assert all(m.startswith(f"cannot reach {server.url}, retrying at once ") for m in messages), messages
    assert "HTTP 503" in messages[0] and "HTTP 503" not in messages[1], messages


async def close_with(code: int, reason: str) -> tuple[str, Callable[[], Awaitable[None]]]:
    """A WebSocket server that closes every connection with ``code``: its URL and a function to stop it."""
    from websockets.asyncio.server import ServerConnection, serve

    async def handler(ws: ServerConnection) -> None:
        await ws.close(code, reason)

    server = await serve(handler, "127.0.0.1", 0)
    port = next(iter(server.sockets)).getsockname()[1]

    async def stop() -> None:
        server.close()
        await server.wait_closed()

    return f"http://127.0.0.1:{port}", stop


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("answer", "words"),
    [
        (
            b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n",
            "/v1/ws answered HTTP 404 to the WebSocket handshake: not a task-gateway",
        ),
        (b"HTTP/1.0 200 OK\r\n\r\n<html>", "did not answer the WebSocket handshake in HTTP/1.1"),
        (4401, "unauthorized: closed by the gateway with 4401: token has expired"),
        (4404, "unknown-task: closed by the gateway with 4404: token has expired"),
    ],
)
async def test_gateway_watch_gives_up_on_what_retrying_cannot_fix(answer: bytes | int, words: str) -> None:
    """Not a gateway (an HTTP 404 to the handshake, an HTTP/1.0 server), or a close code the gateway will
    not change its mind about: one line on stderr saying why, and exit 4, rather than retrying forever."""
    async with contextlib.AsyncExitStack() as stack:
        if isinstance(answer, int):
            url, stop = await close_with(answer, "token has expired")
            stack.push_async_callback(stop)
        else:
            url = (await stack.enter_async_context(AnswerServer([answer]))).url
        command = [sys.executable, "-m", "gateway.cli", "watch", "t", "--url", url]
        with anyio.fail_after(30):
            done = await anyio.run_process(command, check=False, env={**os.environ, "COLUMNS": "300"})
    err = done.stderr.decode().splitlines()
    assert done.returncode == 4, err
    assert len(err) == 1 and err[0].startswith("gateway watch: giving up: "), err
    assert words in err[0], err
    assert done.stdout == b"", done.stdout  # no bar, no 0%: nothing of a task it never saw


@pytest.mark.anyio
@pytest.mark.parametrize("what", ["task", "tag"])
async def test_gateway_watch_stops_quietly_when_its_reader_goes_away(sqlite_url: str, what: str) -> None:
    """``gateway watch ... | head -1``: the first line read, the reader gone, the next line it writes ends it
    with no traceback and exit 141, as a tool that SIGPIPE ended (not 1, which says the task failed)."""
    async with running_gateway(sqlite_url) as gw:
        made = await create_task(gw, "piped", max_attempts=1, tags=["owner:pipe"])
        target = ["--tag", "owner:pipe"] if what == "tag" else ["piped"]
        read_end, write_end = os.pipe()
        command = [sys.executable, "-m", "gateway.cli", "watch", *target, "--url", gw.url]
        try:
            process = await anyio.open_process(command, stdout=write_end)
        finally:
            os.close(write_end)
        async with process:
            with anyio.fail_after(30), _killed_on_failure(process):
                try:
                    await anyio.to_thread.run_sync(os.read, read_end, 1)  # its first output
                finally:
                    os.close(read_end)
                async with Worker(gw.url, "piped", made["callbackToken"]) as worker:
                    await worker.start("w1")  # each change is a line it writes to the pipe with no reader
                    await worker.progress(50)
                    await worker.succeed("s3://piped", "sha256:p")
                returncode = await process.wait()
            assert process.stderr is not None
            err = b"".join([chunk async for chunk in process.stderr]).decode()
        assert returncode == 141, err
        assert "Traceback" not in err and "Exception" not in err, err
