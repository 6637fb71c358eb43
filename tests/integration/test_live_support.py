"""Helpers shared by the live-push tests (``test_live_*.py``); this module holds no test of its own.

(It is named like a test module only because the live suite's files all share that prefix.)

The heart of it is :class:`StreamCheck`: it takes one subscription's frames, in the order received, and
checks protocol.md's ordering guarantee frame by frame: a resume frame first (``caught-up``, ``delta`` or
``snapshot`` with a reason that fits the cursor), then ``event`` frames at ``version == last + 1`` (or a
``snapshot`` with ``reason: conflated`` at a newer version). Each ``event`` and each ``delta`` entry is
replayed on the pure state machine from the state the client holds, so a frame whose ``task`` is not the
state after its entry fails the check too.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any
from urllib.parse import urlencode

import anyio
import httpx
import orjson
import pytest
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from gateway.machine import Resume, apply_event, event_from_json, task_from_json, task_to_json
from tests.support import STEP_S as STEP_S
from tests.support import Running, bearer, post_callback, running_gateway
from tests.support import create_task as create_task
from tests.support import wait_until as wait_until

# Creating a task, posting a callback and waiting for an outcome are tests.support's (create_task,
# post_callback, wait_until: the hub offers no event for "a connection was let go", only :meth:`Hub.idle`
# for none left, so its state is polled); the names stay importable from here for test files written
# against this module. STEP_S too.
post_event = post_callback

RESUME_TYPES = ("caught-up", "delta", "snapshot")
# A task's frames beside its history (issue 34): its metadata and its children's counts, with its revision.
LIVE_TYPES = ("metadata", "children")
LIVE_FIELDS = (*LIVE_TYPES, "revision")


def live_gateway(database_url: str, **overrides: Any) -> AbstractAsyncContextManager[Running]:
    """``running_gateway`` with the background sweeper off unless a test asks for it: these tests drive
    expiry by hand (``sweep_once``) where they need it, so that no entry arrives unasked. The per-task
    callback rate limit is off too: these tests drive tasks as fast as the gateway answers (the limit has
    tests of its own, in test_limits), and how fast that is depends on the machine."""
    overrides.setdefault("sweep_interval_ms", 0)
    overrides.setdefault("callback_rate_per_s", 0)
    return running_gateway(database_url, **overrides)


def ws_url(gw: Running, path: str, **query: Any) -> str:
    url = gw.url.replace("http://", "ws://", 1) + path
    params = {k: v for k, v in query.items() if v is not None}
    return f"{url}?{urlencode(params)}" if params else url


async def get_task(gw: Running, task_id: str, token: str | None = None) -> dict[str, Any]:
    answer = await gw.client.get(f"/v1/tasks/{task_id}", headers=bearer(token) if token else None)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def replay(task: dict[str, Any], event: dict[str, Any]) -> dict[str, Any]:
    """The task (JSON) after one history entry's event, by the pure state machine."""
    return task_to_json(apply_event(task_from_json(task), event_from_json(event)).task)


# What a task carries beside its history (protocol.md, Shapes): no entry sets it, so a replay of the
# history does not make it (metadata and children change between entries; the runs' worker and times are
# the gateway's record).
BESIDE = ("metadata", "revision", "children", "worker", "startedAtMs", "endedAtMs")


def history_part(task: dict[str, Any]) -> dict[str, Any]:
    """A task's JSON without what it carries beside its history: what a replay of its history makes."""
    return {name: value for name, value in task.items() if name not in BESIDE}


class StreamCheck:
    """Checks one subscription's frames against the ordering guarantee, as they arrive.

    ``cursor`` is the cursor the subscription was opened with; ``base`` the task the client held at that
    cursor, when it holds one (then a ``delta`` is replayed on it); ``retention`` the gateway's
    ``retention_versions``, to check the resume frame's choice.
    """

    def __init__(
        self,
        task_id: str,
        cursor: int,
        *,
        base: dict[str, Any] | None = None,
        retention: int | None = None,
    ) -> None:
        self.task_id = task_id
        self.cursor = cursor
        self.retention = retention
        self.task: dict[str, Any] | None = base
        self.version = cursor
        self.resume: dict[str, Any] | None = None
        self.types: list[str] = []
        self.event_versions: list[int] = []
        self.conflated = 0

    def feed(self, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        where = f"{self.task_id} after {self.types[-3:]} at version {self.version}"
        assert frame.get("taskId") == self.task_id, (where, frame)
        if kind in LIVE_TYPES:
            self._live(frame)
            return
        assert kind in (*RESUME_TYPES, "event"), (where, frame)
        version = frame["version"]
        assert isinstance(version, int), (where, frame)
        assert frame["task"]["version"] == version, (where, frame)
        assert frame["task"]["id"] == self.task_id, (where, frame)
        if self.resume is None:
            self._resume(frame)
        elif kind == "event":
            assert version == self.version + 1, f"gap, repeat or reorder: {where}, got event {version}"
            assert self.task is not None
            assert history_part(replay(self.task, frame["event"])) == history_part(frame["task"]), (
                where,
                frame,
            )
            self.event_versions.append(version)
        else:
            assert kind == "snapshot" and frame.get("reason") == "conflated", (where, frame)
            assert version > self.version, (where, frame)
            self.conflated += 1
        self.types.append(kind)
        self.version = version
        self.task = self._newest(frame["task"])

    def _live(self, frame: dict[str, Any]) -> None:
        """A ``metadata`` or ``children`` frame: applied when its revision is not older than the one held."""
        revision = frame.get("revision")
        assert isinstance(revision, int), frame
        if self.task is not None and revision >= self.task.get("revision", 0):
            self.task = {**self.task, frame["type"]: frame[frame["type"]], "revision": revision}

    def _newest(self, task: dict[str, Any]) -> dict[str, Any]:
        """``task`` (a frame's), with the live fields held when they are newer than its own."""
        held = self.task
        if held is None or held.get("revision", 0) <= task.get("revision", 0):
            return task
        return {**task, **{key: held[key] for key in LIVE_FIELDS if key in held}}

    def _resume(self, frame: dict[str, Any]) -> None:
        kind, version, cursor = frame["type"], frame["version"], self.cursor
        assert kind in RESUME_TYPES, f"{self.task_id}: the first frame must be a resume frame, got {frame}"
        self.resume = frame
        if kind == "caught-up":
            assert version == cursor, frame
        elif kind == "delta":
            assert cursor < version, frame
            if self.retention is not None:
                assert version - cursor <= self.retention, frame
            events = frame["events"]
            assert [e["version"] for e in events] == list(range(cursor + 1, version + 1)), frame
            if self.task is not None:
                task = self.task
                for e in events:
                    task = replay(task, e["event"])
                assert history_part(task) == history_part(frame["task"]), (task, frame)
        else:
            reason = frame.get("reason")
            if reason == "cursor-ahead":
                assert cursor > version, frame
            else:
                assert reason == "retention", frame
                assert cursor < version, frame
                if self.retention is not None:
                    assert version - cursor > self.retention, frame

    def assert_final(self, task: dict[str, Any]) -> None:
        """The client ends holding exactly ``task``, at its version."""
        assert self.task == task, (self.task_id, self.task, task)
        assert self.version == task["version"]


class TagWatch:
    """Checks one socket's frames of one tag subscription (protocol.md, Live: tags), as they arrive: the
    ``tag`` frame first, then each listed task's resume frame in the listing's order (from the cursor sent
    for it, ``snapshot`` ``new`` for a task not in the map), an ``added`` frame (at most once a task, but
    for a task made again under its id: another epoch) then the task's ``snapshot`` ``new``; from then on,
    each task's frames as :class:`StreamCheck` checks them. ``cursors`` is the map the client sent, ``tasks``
    the task (JSON) it held at each cursor."""

    def __init__(
        self, tag: str, cursors: dict[str, int] | None = None, tasks: dict[str, dict[str, Any]] | None = None
    ) -> None:
        self.tag = tag
        self.sent = dict(cursors or {})
        self.held = dict(tasks or {})
        self.listed: list[str] | None = None
        self.more: bool | None = None
        self.added: list[str] = []
        self.checks: dict[str, StreamCheck] = {}
        self.awaited: list[str] = []  # listed tasks whose resume frame has not come yet, in order
        self.new: set[str] = set()  # added tasks whose snapshot has not come yet
        self.recreated: list[str] = []  # tasks announced again: their ids were made again

    def feed(self, frame: dict[str, Any]) -> None:
        kind = frame["type"]
        if kind == "tag":
            assert self.listed is None, f"a second tag frame: {frame}"
            assert set(frame) == {"type", "tag", "taskIds", "more"} and frame["tag"] == self.tag, frame
            self.listed, self.more = frame["taskIds"], frame["more"]
            self.awaited = list(frame["taskIds"])
            return
        assert self.listed is not None, f"before the tag frame: {frame}"
        if kind == "added":
            assert set(frame) == {"type", "tag", "taskId"} and frame["tag"] == self.tag, frame
            task_id = frame["taskId"]
            if task_id in self.added or task_id in self.listed:
                self.recreated.append(task_id)  # its snapshot must be of another task (checked below)
            self.added.append(task_id)
            self.new.add(task_id)
            return
        task_id = frame["taskId"]
        if kind in LIVE_TYPES:  # beside the history: applied to the task held, if any, by its revision
            if task_id in self.checks:
                self.checks[task_id].feed(frame)
            return
        if task_id in self.awaited:
            assert self.awaited[0] == task_id, f"resume frames out of the listing's order: {frame}"
            self.awaited.pop(0)
            if task_id in self.sent:
                check = StreamCheck(task_id, self.sent[task_id], base=self.held.get(task_id), retention=8)
                check.feed(frame)
                self.checks[task_id] = check
                return
        elif task_id in self.new:
            self.new.discard(task_id)
            if task_id in self.recreated:
                held = self.checks[task_id].task
                assert held is not None and frame["task"]["epoch"] != held["epoch"], (
                    f"announced twice: {frame}"
                )
        else:
            self.checks[task_id].feed(frame)
            return
        assert (kind, frame.get("reason")) == ("snapshot", "new"), frame
        check = StreamCheck(task_id, frame["version"])
        check.resume, check.task, check.types = frame, frame["task"], ["snapshot"]
        self.checks[task_id] = check

    @property
    def cursors(self) -> dict[str, int]:
        """The map to send on a reconnect: the last version seen of every task."""
        return {task_id: check.version for task_id, check in self.checks.items()}

    @property
    def tasks(self) -> dict[str, dict[str, Any]]:
        return {task_id: check.task for task_id, check in self.checks.items() if check.task is not None}


def tag_subscribe(tag: str, token: str | None = None, cursors: Mapping[str, int | str] | None = None) -> str:
    """A ``/v1/ws`` subscribe message for a tag."""
    message: dict[str, Any] = {"type": "subscribe", "tag": tag}
    if token is not None:
        message["token"] = token
    if cursors is not None:
        message["cursors"] = dict(cursors)
    return orjson.dumps(message).decode()


def loads(raw: str | bytes) -> dict[str, Any]:
    frame = orjson.loads(raw)
    assert isinstance(frame, dict), frame
    return frame


async def recv_frame(ws: ClientConnection, within_s: float = STEP_S) -> dict[str, Any]:
    with anyio.fail_after(within_s):
        return loads(await ws.recv())


async def read_to_close(ws: ClientConnection, check: StreamCheck | None = None) -> int | None:
    """Read (and check) frames until the server closes; returns the close code (1006: no close frame).

    Bounded by the caller's deadline."""
    try:
        async for raw in ws:
            if check is not None:
                check.feed(loads(raw))
    except ConnectionClosed:
        pass
    return ws.close_code


async def closed_with(
    ws: ClientConnection, within_s: float = STEP_S
) -> tuple[list[dict[str, Any]], int | None]:
    """Every frame until the close, and the close code."""
    frames: list[dict[str, Any]] = []
    with anyio.fail_after(within_s):
        try:
            async for raw in ws:
                frames.append(loads(raw))
        except ConnectionClosed:
            pass
    return frames, ws.close_code


@asynccontextmanager
async def socket(url: str, **kwargs: Any) -> AsyncIterator[ClientConnection]:
    """A client socket with bounded opening and closing, for tests."""
    kwargs.setdefault("open_timeout", STEP_S)
    kwargs.setdefault("close_timeout", 2)
    async with connect(url, **kwargs) as ws:
        yield ws


async def sse_frames(
    response: httpx.Response,
) -> AsyncGenerator[tuple[str, str | None, dict[str, Any]], None]:
    """``(event name, id, data)`` of each SSE event of a streaming response; comments are skipped."""
    name: str | None = None
    ident: str | None = None
    data: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                assert name is not None, "every frame is an SSE event named by its type"
                yield name, ident, loads("\n".join(data))
            name, ident, data = None, None, []
        elif line.startswith(":"):
            continue
        else:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "id":
                ident = value
            elif field == "data":
                data.append(value)


async def hold_resume_until_committed(gw: Running, commit: Callable[[], Awaitable[Any]]) -> anyio.Event:
    """Make the next subscription's resume read wait until ``commit`` has run, then let it go.

    The subscription is registered with the hub before its resume state is read (the ordering guarantee's
    first step), so the committed entry lands in its live backlog *and* in the resume state: the race of a
    subscriber that connects just as the task's last callback is committed.
    """
    book = gw.gateway.book
    original = book.resume
    held = anyio.Event()
    patch = pytest.MonkeyPatch()

    async def resume(task_id: str, cursor: int, epoch: str | None = None) -> Resume:
        patch.undo()  # only this one read is held
        held.set()
        await commit()
        return await original(task_id, cursor, epoch)

    patch.setattr(book, "resume", resume)
    return held
