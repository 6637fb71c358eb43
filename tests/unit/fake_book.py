"""An in-memory twin of the three ``Book`` methods the hub's ``Feed`` calls, for socket-free hub tests.

A :class:`FakeBook` holds tasks and their whole history, built with the pure machine
(``gateway.machine.apply_event``): every state a task has been in (by version) and every entry as the
store keeps it, ``(version, orjson.dumps(event_to_json(event)))``. Its reads answer as ``Book`` does:

- ``get(task_id)``: the current task, ``UnknownTask`` when there is none;
- ``resume(task_id, cursor)``: a :class:`gateway.book.Resume`, mode chosen by ``machine.resume_mode``
  (retention 8 by default), a delta's entries bounded by the version of the task as read;
- ``entries_between(task_id, after, upto)``: the entries ``after < version <= upto``, in order.

Each read is ``async`` and passes through named *points* a test can hook (``hooks[name]`` is awaited
there): ``"resume"`` before the task is read, ``"resume:task-read"`` after the task is read and before its
entries are, ``"get"`` and ``"entries"`` before those reads. Without a hook a point is a checkpoint, or a
seeded random number of them (``rng``), so that concurrent tasks interleave there.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import anyio.lowlevel
import orjson

from gateway.errors import UnknownTask
from gateway.machine import (
    Entry,
    Event,
    Fail,
    Progress,
    Resume,
    Start,
    Succeed,
    Task,
    apply_event,
    create_task,
    event_to_json,
    resume_mode,
)

RETENTION = 8


@dataclass(frozen=True, slots=True)
class Committed:
    """One committed entry, as ``Book`` hands it to ``on_commit``: the task after it, the entry, the bytes."""

    task: Task
    entry: Entry
    encoded: bytes

    @property
    def version(self) -> int:
        return self.entry.version


class FakeBook:
    def __init__(self, retention_versions: int = RETENTION, rng: random.Random | None = None) -> None:
        self.retention_versions = retention_versions
        self.rng = rng
        self.states: dict[str, list[Task]] = {}  # states[id][v] is the task at version v
        self.entries: dict[str, list[tuple[int, bytes]]] = {}  # entries[id][v - 1] is entry v
        self.events: dict[str, list[Event]] = {}
        self.hooks: dict[str, Callable[[], Awaitable[None]]] = {}
        self.calls: list[tuple[str, str, int, int]] = []  # (method, task id, a, b), for assertions
        self.clock = 1_000

    # --- writes (synchronous: a commit) --------------------------------------------------------------

    def create(self, task_id: str, *, ttl_ms: float = 10**12, max_attempts: int = 10**6) -> Task:
        task = create_task(id=task_id, now_ms=self.clock, ttl_ms=ttl_ms, max_attempts=max_attempts)
        self.states[task_id] = [task]
        self.entries[task_id] = []
        self.events[task_id] = []
        return task

    def commit(self, task_id: str, event: Event | None = None) -> Committed:
        """Apply ``event`` (or the next event of :func:`next_event`) and store its entry; it must change
        the task, as every entry does."""
        task = self.current(task_id)
        if event is None:
            self.clock += 1
            event = next_event(task, self.clock, self.rng)
        transition = apply_event(task, event)
        assert transition.entry is not None, f"{event} does not change {task}"
        new = transition.task
        encoded = orjson.dumps(event_to_json(transition.entry.event))
        self.states[task_id].append(new)
        self.entries[task_id].append((new.version, encoded))
        self.events[task_id].append(transition.entry.event)
        assert len(self.states[task_id]) == new.version + 1
        return Committed(new, transition.entry, encoded)

    # --- what the tests compare with ------------------------------------------------------------------

    def current(self, task_id: str) -> Task:
        if task_id not in self.states:
            raise UnknownTask(task_id)
        return self.states[task_id][-1]

    def state_at(self, task_id: str, version: int) -> Task:
        return self.states[task_id][version]

    def entry_at(self, task_id: str, version: int) -> bytes:
        found, raw = self.entries[task_id][version - 1]
        assert found == version
        return raw

    # --- the three reads of Book ------------------------------------------------------------------------

    async def _point(self, name: str) -> None:
        hook = self.hooks.get(name)
        if hook is not None:
            await hook()
            return
        for _ in range(self.rng.randint(0, 2) if self.rng is not None else 1):
            await anyio.lowlevel.checkpoint()

    async def get(self, task_id: str) -> Task:
        await self._point("get")
        task = self.current(task_id)
        self.calls.append(("get", task_id, task.version, task.version))
        return task

    async def resume(self, task_id: str, cursor: int) -> Resume:
        await self._point("resume")
        task = self.current(task_id)
        mode, reason = resume_mode(task.version, cursor, self.retention_versions)
        await self._point("resume:task-read")
        found: list[tuple[int, bytes]] = []
        if mode == "delta":
            # As Book: bounded by the version of the task as read, whatever was committed since.
            found = [(v, raw) for v, raw in self.entries[task_id] if cursor < v <= task.version]
        self.calls.append(("resume", task_id, cursor, task.version))
        return Resume(mode, reason, task, found)

    async def versions(self, task_ids: list[str]) -> dict[str, int]:
        await self._point("versions")
        self.calls.append(("versions", ",".join(task_ids), 0, 0))
        return {i: self.current(i).version for i in task_ids if i in self.states}

    async def entries_between(self, task_id: str, after: int, upto: int) -> list[tuple[int, bytes]]:
        await self._point("entries")
        self.current(task_id)
        self.calls.append(("entries", task_id, after, upto))
        return [(v, raw) for v, raw in self.entries[task_id] if after < v <= upto]


def next_event(task: Task, at_ms: int, rng: random.Random | None = None) -> Event:
    """An event that moves a live task on: start, progress steps, a retryable failure, now and then (with
    an ``rng``) a success that ends it."""
    if task.state == "queued":
        return Start(at_ms, f"w{task.attempts + 1}")
    assert task.state == "running", task
    step = rng.randint(1, 30) if rng is not None else 7
    if rng is not None and rng.random() < 0.01:
        return Succeed(at_ms, f"ref-{task.version}", f"hash-{task.version}")
    if task.progress + step <= 100 and (rng is None or rng.random() < 0.85):
        return Progress(at_ms, task.progress + step, f"c{task.version}")
    return Fail(at_ms, f"boom {task.attempts}", True)
