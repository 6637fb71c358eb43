"""A tag subscriber over ``/v1/ws`` that outlives the process it is connected to, for the tests that run the
gateway as it is deployed (tests/support/processes.py).

:class:`TagSubscriber` keeps what a client of a tag keeps: the tasks it knows, each at the version it holds
(its cursors map). It subscribes with ``{"type": "subscribe", "tag", "token", "cursors"}``; when its socket
drops it connects to another process and subscribes again with the whole map. Every frame of every
connection is checked as it arrives (the tag subscription's contract, docs/protocol.md):

- the first frame is the ``tag`` listing (this tag, ``more: false``, no task twice, every task the client
  named in its cursors listed);
- then one resume frame per listed task, in the listing's order, each fitting the cursor sent for it
  (:class:`~tests.integration.test_live_support.StreamCheck`: ``caught-up`` at it, a ``delta`` from
  cursor + 1 replayed on the task held, ...), or, for a task the client did not know, a ``snapshot`` with
  ``reason: "new"``; once every resume frame is in, the listing is newest first by ``createdAtMs``, then id;
- no ``event`` and no ``added`` before the last of those resume frames;
- ``added`` names a task neither listed nor added before on this connection (nor known to the client), and
  is followed by that task's ``snapshot`` (``new``); each frame names a task listed or added;
- then each task's ``event`` frames at exactly last + 1, each replayed on the state machine.

Every frame also goes to a :class:`~tests.support.history.History` (``history``), which checks the streams
across connections (no gap, no repeat, nothing after a terminal state). A violation fails at once, saying
which subscriber, which connection and which frame.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import anyio
import orjson
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from tests.integration.test_live_support import RESUME_TYPES, STEP_S, StreamCheck, loads
from tests.support.history import History
from tests.support.processes import RECONNECT_CODES, GatewayProcess

# A reconnect's backoff: the subscriber waits this long before connecting again after a drop.
RECONNECT_DELAY_S = 0.1


class TagSubscriber:
    """One client of one tag, reconnecting by itself (to the next process that runs) with its cursors.

    ``gateways``: the processes it may connect to; it starts on ``gateways[start]``. ``target`` (set by the
    test once it knows every task's final version) makes :attr:`complete` fire once the client holds
    exactly those tasks at exactly those versions."""

    def __init__(
        self,
        name: str,
        tag: str,
        token: str,
        gateways: Sequence[GatewayProcess],
        *,
        start: int = 0,
        history: History,
        retention: int | None = None,
    ) -> None:
        self.name = name
        self.tag = tag
        self.token = token
        self.gateways = gateways
        self.history = history
        self.retention = retention
        self.index = start % len(gateways)
        self.tasks: dict[str, dict[str, Any]] = {}  # task id -> the task as held
        self.connections = 0  # connections that opened
        self.failed_opens = 0
        self.urls: list[str] = []  # the process (URL) of each connection, in order
        self.closes: list[int | None] = []
        self.listed: list[list[str]] = []  # each connection's listing
        self.added: Counter[str] = Counter()  # added frames received, by the process (URL) that sent them
        self.resumes: Counter[str] = Counter()  # resume frames by type (snapshot: snapshot/REASON)
        self.ready = anyio.Event()  # the first connection has every listed task's resume frame
        self.complete = anyio.Event()
        self.target: dict[str, int] | None = None
        self.connected_to: GatewayProcess | None = None  # the process of the socket open now

    @property
    def cursors(self) -> dict[str, int]:
        """Task id -> the version held, for every task the client knows."""
        return {task_id: task["version"] for task_id, task in self.tasks.items()}

    def expect(self, target: dict[str, int]) -> None:
        """The tasks (id -> final version) the client must end holding."""
        self.target = target
        self._check_complete()

    def _check_complete(self) -> None:
        if self.target is not None and self.cursors == self.target:
            self.complete.set()

    async def run(self) -> None:
        """Follow the tag until cancelled, reconnecting after each drop."""
        while True:
            gw = self.gateways[self.index]
            code: int | None = None
            if gw.running:
                try:
                    code = await self._connection(gw)
                except (OSError, TimeoutError, InvalidHandshake):
                    self.failed_opens += 1
                finally:
                    self.connected_to = None
                self.closes.append(code)
                assert code in RECONNECT_CODES, (self.name, f"closed with {code}", self.closes)
            # To another process: the one it was on is gone, or going.
            self.index = (self.index + 1) % len(self.gateways)
            await anyio.sleep(RECONNECT_DELAY_S)  # a reconnect's backoff

    async def _connection(self, gw: GatewayProcess) -> int | None:
        sent = self.cursors
        message: dict[str, Any] = {"type": "subscribe", "tag": self.tag, "token": self.token}
        if sent:
            message["cursors"] = sent
        async with connect(f"{gw.ws_url}/v1/ws", open_timeout=STEP_S, close_timeout=2) as ws:
            self.connections += 1
            self.connected_to = gw
            self.urls.append(gw.url)
            connection = _Connection(self, gw.url, len(self.urls), sent)
            await ws.send(orjson.dumps(message).decode())
            try:
                async for raw in ws:
                    frame = loads(raw)
                    self.history.frame(self.name, frame)
                    connection.feed(frame)
                    self._check_complete()
            except ConnectionClosed:
                pass
            return ws.close_code


class _Connection:
    """What one connection of a :class:`TagSubscriber` has received, checked frame by frame."""

    def __init__(self, owner: TagSubscriber, url: str, number: int, sent: dict[str, int]) -> None:
        self.owner = owner
        self.url = url
        self.sent = sent
        self.where = f"{owner.name} ({owner.tag}), connection {number} to {url}"
        self.listed: list[str] | None = None
        self.resumed = 0  # listed tasks whose resume frame has come
        self.added: set[str] = set()
        self.checks: dict[str, StreamCheck] = {}
        self.frames = 0

    def _fail(self, what: str, frame: dict[str, Any]) -> AssertionError:
        return AssertionError(f"{self.where}, frame {self.frames}: {what}: {frame}")

    def feed(self, frame: dict[str, Any]) -> None:
        self.frames += 1
        kind = frame.get("type")
        if kind == "error":
            raise self._fail("an error frame", frame)
        if self.listed is None:
            self._listing(frame)
            return
        if kind == "tag":
            raise self._fail("a second tag listing", frame)
        if kind == "added":
            self._added(frame)
            return
        if kind not in (*RESUME_TYPES, "event"):
            raise self._fail("a frame of no kind a tag subscription sends", frame)
        task_id = frame.get("taskId")
        if not isinstance(task_id, str) or (task_id not in self.listed and task_id not in self.added):
            raise self._fail("a frame for a task neither listed nor added", frame)
        check = self.checks.get(task_id)
        if check is None:
            self._first(task_id, frame)
            return
        if not self._all_resumed():
            raise self._fail("a task's frame after its resume frame before every listed task's", frame)
        try:
            check.feed(frame)
        except AssertionError as exc:
            raise self._fail(f"out of order ({exc})", frame) from None
        assert check.task is not None
        self.owner.tasks[task_id] = check.task

    def _listing(self, frame: dict[str, Any]) -> None:
        if frame.get("type") != "tag" or frame.get("tag") != self.owner.tag:
            raise self._fail("the first frame is not this tag's listing", frame)
        if frame.get("more") is not False:
            raise self._fail("more is not false (every task of the tag fits)", frame)
        listed = frame.get("taskIds")
        if not isinstance(listed, list) or not all(isinstance(t, str) for t in listed):
            raise self._fail("taskIds is not a list of ids", frame)
        if len(set(listed)) != len(listed):
            raise self._fail("a task listed twice", frame)
        left_out = sorted(set(self.sent) - set(listed))
        if left_out:
            raise self._fail(f"tasks the client knows (sent in cursors) not listed: {left_out}", frame)
        self.listed = listed
        self.owner.listed.append(listed)
        if not listed:
            self.owner.ready.set()

    def _all_resumed(self) -> bool:
        return self.listed is not None and self.resumed == len(self.listed)

    def _added(self, frame: dict[str, Any]) -> None:
        assert self.listed is not None
        task_id = frame.get("taskId")
        if frame.get("tag") != self.owner.tag or not isinstance(task_id, str):
            raise self._fail("an added frame for another tag, or without a task id", frame)
        if not self._all_resumed():
            raise self._fail("added before every listed task's resume frame", frame)
        if task_id in self.listed:
            raise self._fail("a listed task added", frame)
        if task_id in self.added:
            raise self._fail("a task added twice on one subscription", frame)
        if task_id in self.sent:
            raise self._fail("a task the client named in its cursors added", frame)
        self.added.add(task_id)
        self.owner.added[self.url] += 1

    def _first(self, task_id: str, frame: dict[str, Any]) -> None:
        """The first frame of a task on this connection: its resume frame."""
        assert self.listed is not None
        kind = frame["type"]
        if kind not in RESUME_TYPES:
            raise self._fail("a task's first frame is not a resume frame", frame)
        if task_id in self.listed:
            expected = self.listed[self.resumed] if not self._all_resumed() else None
            if task_id != expected:
                raise self._fail(f"a resume frame out of the listing's order (expected {expected})", frame)
            self.resumed += 1
        elif not self._all_resumed():
            raise self._fail("an added task's frame before every listed task's resume frame", frame)
        if task_id in self.sent:
            check = StreamCheck(
                task_id, self.sent[task_id], base=self.owner.tasks[task_id], retention=self.owner.retention
            )
            try:
                check.feed(frame)
            except AssertionError as exc:
                raise self._fail(f"a resume frame that does not fit the cursor sent ({exc})", frame) from None
        else:
            if kind != "snapshot" or frame.get("reason") != "new":
                raise self._fail("a task the client did not know does not start with snapshot (new)", frame)
            # A task new to the client: its stream starts at the snapshot, as if resumed there.
            check = StreamCheck(task_id, frame["version"], base=frame["task"], retention=self.owner.retention)
            check.feed(
                {"type": "caught-up", "taskId": task_id, "version": frame["version"], "task": frame["task"]}
            )
        reason = frame.get("reason")
        self.owner.resumes[f"{kind}/{reason}" if reason else kind] += 1
        self.checks[task_id] = check
        assert check.task is not None
        self.owner.tasks[task_id] = check.task
        if task_id in self.listed and self._all_resumed():
            self._newest_first()
            self.owner.ready.set()

    def _newest_first(self) -> None:
        """The listing is newest first: createdAtMs descending, then id descending."""
        assert self.listed is not None
        keys = [(self.owner.tasks[t]["createdAtMs"], t) for t in self.listed]
        if keys != sorted(keys, reverse=True):
            raise AssertionError(f"{self.where}: the listing is not newest first: {keys}")
