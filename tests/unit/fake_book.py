"""An in-memory twin of the store reads the hub makes, for socket-free tests of the fan-out core and its
driver.

A :class:`FakeBook` holds tasks and their whole history, built with the pure machine
(``gateway.machine.apply_event``): every state a task has been in (by version) and every entry as the
store keeps it, ``(version, orjson.dumps(event_to_json(event)))``. Its reads answer as ``Book`` does, and
it is a ``gateway.live.hub.BookReads`` (mypy checks that it fits, with no ignore):

- ``get(task_id)``: the current task, ``UnknownTask`` when there is none;
- ``resume(task_id, cursor, epoch)``: a :class:`gateway.machine.Resume`, mode chosen by
  ``machine.resume_from`` (retention 8 by default), a delta's entries bounded by the version of the task as
  read;
- ``entries_between(task_id, after, upto)``: the entries ``after < version <= upto``, in order;
- ``ahead(known)``: of the tasks in ``known`` (id -> version), those stored at a higher version, with it;

and the reads of tags (``gateway.live.hub.TagStore``, as ``gateway.book.tag_reads.TagReads`` answers them):

- ``list(tag, limit)``: the ids of the tasks carrying ``tag``, newest first (createdAtMs, then id,
  descending), at most ``limit``, and whether more were left out;
- ``resume_many(cursors, epochs)``: ``resume`` of each task of the map that exists, in one read;
- ``tagged_since(tags, since_ms)``: ``(tag, task id, epoch)`` of the tasks carrying one of ``tags`` created
  at ``since_ms`` or later.

A task is created with an epoch a test gives (none by default); :meth:`FakeBook.delete` forgets it, as
retention does, so that its id can be created again (another history).

The pure tests call the same reads synchronously (``resume_now``, ``entries_now``); the driver tests await
them. Each awaited read passes through named *points* a test can hook (``hooks[name]`` is awaited there):
``"resume"`` before the task is read, ``"resume:task-read"`` after the task is read and before its entries
are, ``"get"``, ``"entries"``, ``"ahead"``, ``"list"``, ``"resume_many"`` and ``"tagged_since"`` before
those reads. Without a hook a point is one checkpoint.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace

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
    resume_from,
)
from gateway.task_times import stamped

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

    def create(
        self,
        task_id: str,
        *,
        ttl_ms: float = 10**12,
        max_attempts: int = 10**6,
        tags: Sequence[str] = (),
        created_at_ms: int | None = None,
        epoch: str = "",
    ) -> Task:
        """A task at version 0, with ``tags`` (stored sorted), created now (``clock``) or at
        ``created_at_ms``, of the history ``epoch``."""
        task = create_task(id=task_id, now_ms=self.clock, ttl_ms=ttl_ms, max_attempts=max_attempts)
        at = self.clock if created_at_ms is None else created_at_ms
        task = replace(task, tags=tuple(sorted(set(tags))), created_at_ms=at, epoch=epoch)
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
        transition = stamped(apply_event(task, event), event.at_ms)  # as the book does
        assert transition.entry is not None, f"{event} does not change {task}"
        new = transition.task
        encoded = orjson.dumps(event_to_json(transition.entry.event))
        self.states[task_id].append(new)
        self.entries[task_id].append((new.version, encoded))
        self.events[task_id].append(transition.entry.event)
        assert len(self.states[task_id]) == new.version + 1
        return Committed(new, transition.entry, encoded)

    def delete(self, task_id: str) -> None:
        """Forget the task and its history, as retention deletes a finished task: its id is free."""
        del self.states[task_id], self.entries[task_id], self.events[task_id]

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

    # --- the reads, synchronous (the pure tests) ------------------------------------------------------

    def resume_now(
        self, task_id: str, cursor: int, *, as_of: int | None = None, epoch: str | None = None
    ) -> Resume:
        """What ``Book.resume`` answers now, or (``as_of``) when the task was at that version."""
        task = self.current(task_id) if as_of is None else self.state_at(task_id, as_of)
        mode, reason = resume_from(task, cursor, self.retention_versions, epoch)
        found: list[tuple[int, bytes]] = []
        if mode == "delta":
            # As Book: bounded by the version of the task as read, whatever was committed since.
            found = [(v, raw) for v, raw in self.entries[task_id] if cursor < v <= task.version]
        self.calls.append(("resume", task_id, cursor, task.version))
        return Resume(mode, reason, task, found)

    def entries_now(self, task_id: str, after: int, upto: int) -> list[tuple[int, bytes]]:
        self.current(task_id)
        self.calls.append(("entries", task_id, after, upto))
        return [(v, raw) for v, raw in self.entries[task_id] if after < v <= upto]

    def get_now(self, task_id: str) -> Task:
        task = self.current(task_id)
        self.calls.append(("get", task_id, task.version, task.version))
        return task

    def list_now(self, tag: str, limit: int) -> tuple[list[str], bool]:
        tagged = [states[0] for states in self.states.values() if tag in states[0].tags]
        tagged.sort(key=lambda task: (task.created_at_ms, task.id), reverse=True)
        self.calls.append(("list", tag, limit, len(tagged)))
        return [task.id for task in tagged[:limit]], len(tagged) > limit

    def resume_many_now(
        self, cursors: Mapping[str, int], epochs: Mapping[str, str] | None = None
    ) -> dict[str, Resume]:
        self.calls.append(("resume_many", ",".join(cursors), len(cursors), 0))
        out = {}
        for task_id, cursor in cursors.items():
            if task_id in self.states:
                out[task_id] = self.resume_now(task_id, cursor, epoch=(epochs or {}).get(task_id))
                self.calls.pop()  # one read for all of them
        return out

    def tagged_since_now(self, tags: Sequence[str], since_ms: int) -> list[tuple[str, str, str]]:
        self.calls.append(("tagged_since", ",".join(tags), since_ms, 0))
        return [
            (tag, states[0].id, states[0].epoch)
            for tag in tags
            for states in self.states.values()
            if tag in states[0].tags and states[0].created_at_ms >= since_ms
        ]

    # --- the reads of Book, awaited (the driver tests) ------------------------------------------------

    async def _point(self, name: str) -> None:
        hook = self.hooks.get(name)
        if hook is not None:
            await hook()
            return
        await anyio.lowlevel.checkpoint()

    async def get(self, task_id: str) -> Task:
        await self._point("get")
        return self.get_now(task_id)

    async def resume(self, task_id: str, cursor: int, epoch: str | None = None) -> Resume:
        await self._point("resume")
        as_of = self.current(task_id).version
        await self._point("resume:task-read")
        return self.resume_now(task_id, cursor, as_of=as_of, epoch=epoch)

    async def ahead(self, known: Mapping[str, int]) -> dict[str, int]:
        await self._point("ahead")
        self.calls.append(("ahead", ",".join(known), 0, 0))
        versions = {i: self.current(i).version for i in known if i in self.states}
        return {i: version for i, version in versions.items() if version > known[i]}

    async def entries_between(self, task_id: str, after: int, upto: int) -> list[tuple[int, bytes]]:
        await self._point("entries")
        return self.entries_now(task_id, after, upto)

    async def resume_many(
        self, cursors: Mapping[str, int], epochs: Mapping[str, str] | None = None
    ) -> dict[str, Resume]:
        await self._point("resume_many")
        return self.resume_many_now(cursors, epochs)

    async def tagged_since(self, tags: Sequence[str], since_ms: int) -> list[tuple[str, str, str]]:
        await self._point("tagged_since")
        return self.tagged_since_now(tags, since_ms)

    # Last: a method named ``list`` hides the builtin in the annotations of the class's later methods.
    async def list(self, tag: str, limit: int) -> tuple[list[str], bool]:
        await self._point("list")
        return self.list_now(tag, limit)


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
