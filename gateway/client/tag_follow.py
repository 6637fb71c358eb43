"""What a tag subscription knows and does with each frame, apart from any socket (pure, as gateway-client.js
does it): the cursors map (task id -> last version seen, for every task of the tag it knows, finished ones
too) with the epoch of each task's history, the subscribe message that sends them (``version:epoch``), and
for each frame whether to hand it on, subscribe again, or give up.

Per task, frames are applied in order with no gap and no repeat: a resume frame or an ``event`` at version
last + 1 moves the task on; a ``snapshot`` replaces it whatever its version (a task made anew); an
``event`` past last + 1 (a gap) asks for the tag again with every cursor, and the resume frames that
answer cover what was missed; a ``delta`` that overlaps what was applied (frames of the earlier
subscription still on their way) is cut to its new entries. An ``added`` frame for a task it knows says
that the id was made again (the task it knew was deleted by retention): what it held of it goes, and the
new task's ``snapshot`` follows. A ``tag`` frame lists the tag's tasks: one no longer listed (deleted by
retention) is forgotten, so the map does not grow for ever.

A subscribe message must fit the gateway's limit on messages: 4 KiB on a socket that holds no authorized
subscription yet (GATEWAY_WS_MAX_MESSAGE_BYTES_BEFORE_AUTH), 64 KiB after (GATEWAY_WS_MAX_MESSAGE_BYTES).
It carries the cursors of the newest tasks that fit; a task left out gets a snapshot, never a loss. A
gateway that closes a socket with ``1009`` has a lower limit: the messages are made half as big.
"""

from __future__ import annotations

import enum
from collections.abc import MutableMapping
from typing import Any

import orjson

from gateway.client.errors import WatchError
from gateway.client.revisions import LIVE_TYPES, Revisions

RESUME_TYPES = frozenset({"caught-up", "delta", "snapshot"})
# Error codes about a tag subscription that retrying cannot cure.
FATAL = frozenset({"unauthorized", "forbidden", "invalid-request"})
# The gateway's limits on a message (its defaults), before and after the socket's first authorized
# subscription.
MESSAGE_BYTES_BEFORE_AUTH = 4096
MESSAGE_BYTES = 65536


class Then(enum.Enum):
    """What the socket's owner does after a frame."""

    NOTHING = "nothing"
    SUBSCRIBE = "subscribe"  # send subscribe_message() now
    RETRY_LATER = "retry-later"  # the gateway could not take the subscription now: send it again after a wait


class TagFollower:
    """One tag subscription's state. ``cursors`` is the map it keeps, ``epochs`` the epoch of each task's
    history those versions are of (the caller's own mappings when given, updated in place, so that they can
    be saved and handed to a later run: a version without its epoch is taken as one of the task its id names
    then); ``tasks`` the latest task of each id."""

    def __init__(
        self,
        tag: str,
        token: str | None,
        cursors: MutableMapping[str, int] | None = None,
        epochs: MutableMapping[str, str] | None = None,
    ) -> None:
        self.tag = tag
        self.token = token
        self.cursors: MutableMapping[str, int] = cursors if cursors is not None else {}
        self.epochs: MutableMapping[str, str] = epochs if epochs is not None else {}
        for task_id, cursor in list(self.cursors.items()):
            if isinstance(cursor, bool) or not isinstance(cursor, int) or cursor < 0:
                raise ValueError(f"cursors[{task_id!r}]: must be an integer >= 0, got {cursor!r}")
        for task_id, epoch in list(self.epochs.items()):
            if not isinstance(epoch, str) or not epoch.isascii() or not epoch.isalnum():
                raise ValueError(f"epochs[{task_id!r}]: must be a task's epoch, got {epoch!r}")
        self.tasks: dict[str, dict[str, Any]] = {}
        self._known: set[str] = set(self.cursors)  # the tag's tasks: listed, added, or given a cursor
        self._awaiting: set[str] = set(self.cursors)  # no resume frame since the last subscribe
        self._subscribing = False  # a subscribe sent, its tag frame not come yet
        self._listed = 0  # how many tasks the last tag frame listed
        self._cap: int | None = None  # the most cursors to send, once the gateway has shown its limit
        self._sent = 0  # how many cursors the last subscribe sent
        self._bytes = (MESSAGE_BYTES_BEFORE_AUTH, MESSAGE_BYTES)  # the room for a message, before/after auth
        self._revisions = Revisions()  # of each task's metadata and children, as handed on

    def subscribe_message(self, *, authorized: bool = False) -> str:
        """The subscribe message with the cursors of the newest tasks that fit the gateway's limit on a
        message (higher once the socket is ``authorized``: it has answered a subscription), and no more than
        ``cap`` of them once the gateway showed its limit on a listing."""
        self._subscribing = True
        self._awaiting = set(self._known)
        message: dict[str, Any] = {"type": "subscribe", "tag": self.tag, "cursors": {}}
        if self.token is not None:
            message["token"] = self.token
        room = self._bytes[authorized] - len(orjson.dumps(message))
        cursors: dict[str, int | str] = {}
        for task_id in sorted(self.cursors, key=self._age, reverse=True):
            cursor = cursor_of(self.cursors[task_id], self.epochs.get(task_id))
            size = len(orjson.dumps(task_id)) + len(orjson.dumps(cursor)) + 2  # "id":N, or "id":"N:E",
            if (self._cap is not None and len(cursors) >= self._cap) or size > room:
                break
            cursors[task_id] = cursor
            room -= size
        self._sent = len(cursors)
        message["cursors"] = cursors
        return orjson.dumps(message).decode()

    def too_big(self) -> None:
        """The gateway closed the socket with ``1009``: its limit is lower than its default, so the next
        messages are half as big."""
        self._bytes = (max(512, self._bytes[0] // 2), max(512, self._bytes[1] // 2))

    def take(self, frame: dict[str, Any]) -> tuple[dict[str, Any] | None, Then]:
        """The frame to hand on (``None``: nothing new in it, or not this tag's) and what to do next. Raises
        :class:`WatchError` for an error frame that retrying cannot cure."""
        kind = frame.get("type")
        if kind in ("tag", "added") or (kind == "error" and "tag" in frame):
            if frame.get("tag") != self.tag:
                return None, Then.NOTHING
            if kind == "error":
                return None, self._error(frame)
            if kind == "tag":
                return self._listing(frame), Then.NOTHING
            task_id = frame.get("taskId")
            if not isinstance(task_id, str):
                return None, Then.NOTHING
            if task_id in self._known:  # announced once: again, the id was made again (another task)
                self._forget(task_id)
            self._known.add(task_id)
            self._awaiting.add(task_id)
            return frame, Then.NOTHING
        task_id = frame.get("taskId")
        if kind in LIVE_TYPES:  # a task's metadata or children: not older than what was handed on
            taken = task_id in self._known and self._revisions.take(frame)
            return (frame if taken else None), Then.NOTHING
        if task_id not in self._known or not isinstance(frame.get("task"), dict):
            return None, Then.NOTHING
        cursor = self.cursors.get(task_id)
        version = frame.get("version")
        if not isinstance(version, int):
            return None, Then.NOTHING
        shown = frame
        if kind in RESUME_TYPES:
            if kind != "snapshot" and cursor is not None and version < cursor:
                return None, Then.NOTHING  # older than what was applied
            if kind == "delta" and cursor is not None:
                events = [entry for entry in frame.get("events", ()) if entry.get("version", 0) > cursor]
                if len(events) != len(frame.get("events", ())):
                    shown = {**frame, "events": events}
            self._awaiting.discard(task_id)
        elif kind == "event":
            if cursor is None or version <= cursor:
                return None, Then.NOTHING  # before the task's first frame, or seen
            if version != cursor + 1:
                if task_id in self._awaiting or self._subscribing:
                    return None, Then.NOTHING  # the resume frame on its way covers it
                return None, Then.SUBSCRIBE
        else:
            return None, Then.NOTHING
        self.cursors[task_id] = version
        self.tasks[task_id] = frame["task"]
        self._revisions.task(task_id, frame["task"])
        epoch = frame["task"].get("epoch")
        if isinstance(epoch, str):
            self.epochs[task_id] = epoch
        else:
            self.epochs.pop(task_id, None)
        return shown, Then.NOTHING

    def _listing(self, frame: dict[str, Any]) -> dict[str, Any]:
        listed = [task_id for task_id in frame.get("taskIds", ()) if isinstance(task_id, str)]
        self._subscribing = False
        self._listed = len(listed)
        if frame.get("more"):
            self._cap = len(listed) if self._cap is None else min(self._cap, len(listed))
        keep = set(listed)
        for task_id in self._known - keep:
            self._forget(task_id)
        self._awaiting = (self._awaiting | (keep - self._known)) & keep
        self._known = keep
        return frame

    def _forget(self, task_id: str) -> None:
        self.cursors.pop(task_id, None)
        self.epochs.pop(task_id, None)
        self.tasks.pop(task_id, None)
        self._revisions.forget(task_id)

    def _error(self, frame: dict[str, Any]) -> Then:
        code = str(frame.get("code", ""))
        cap_above = self._cap is None or self._cap > self._listed
        if code == "invalid-request" and self._sent > self._listed and cap_above:
            # More cursors than the gateway takes (tasks were added since it listed them): send the newest.
            self._cap = self._listed
            return Then.SUBSCRIBE
        if code in FATAL:
            raise WatchError(code, str(frame.get("message", "")), tag=self.tag)
        return Then.RETRY_LATER

    def _age(self, task_id: str) -> tuple[int, str]:
        task = self.tasks.get(task_id, {})
        created = task.get("createdAtMs", 0)
        return (created if isinstance(created, int) else 0, task_id)


def cursor_of(version: int, epoch: str | None) -> int | str:
    """A cursor as the gateway takes it: ``"version:epoch"``, or the bare version where no epoch is known
    (taken as a version of the task the id names now)."""
    return version if epoch is None else f"{version}:{epoch}"
