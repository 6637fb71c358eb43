"""Server frames (protocol.md, WebSocket): pure encoding, no I/O.

An ``event`` frame is encoded once per entry, by the process that commits it; the same text goes to every
subscriber of that process and, as the bus message, to every other process, which sends it unchanged.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.machine import CHILDREN_FIELDS, Resume, Task, task_to_json
from gateway.tag_names import parent_of


@dataclass(frozen=True, slots=True)
class Frame:
    """One server frame: its ``type``, the cursor it leaves the client at (its version, of the history
    ``epoch`` of its task: ``""`` for a frame of no task, or of a task with none), and its JSON text."""

    type: str
    version: int
    text: str
    epoch: str = ""

    @property
    def cursor(self) -> str:
        """The cursor as a client sends it back (protocol.md, Resuming): ``V:E``, or ``V`` without an
        epoch; an SSE event's ``id``."""
        return f"{self.version}:{self.epoch}" if self.epoch else str(self.version)


def event_frame(task: Task, encoded_event: bytes) -> Frame:
    text = b'{"type":"event","taskId":%b,"version":%d,"event":%b,"task":%b}' % (
        orjson.dumps(task.id),
        task.version,
        encoded_event,
        orjson.dumps(task_to_json(task)),
    )
    return Frame("event", task.version, text.decode(), task.epoch)


def resume_frame(resume: Resume) -> Frame:
    task = resume.task
    head: dict[str, Any] = {"type": resume.mode, "taskId": task.id, "version": task.version}
    if resume.reason is not None:
        head["reason"] = resume.reason
    head["task"] = task_to_json(task)
    text = orjson.dumps(head)
    if resume.mode == "delta":
        text = text[:-1] + b',"events":' + resume.entries_json() + b"}"
    return Frame(resume.mode, task.version, text.decode(), task.epoch)


def snapshot_frame(task: Task, reason: str) -> Frame:
    body = {"type": "snapshot", "taskId": task.id, "version": task.version, "reason": reason}
    body["task"] = task_to_json(task)
    return Frame("snapshot", task.version, orjson.dumps(body).decode(), task.epoch)


def _about(tag: str) -> dict[str, str]:
    """What a frame about a tag subscription names: the tag, or the parent a batch's subscription follows."""
    parent = parent_of(tag)
    return {"tag": tag} if parent is None else {"parent": parent}


def error_frame(code: str, message: str, task_id: str | None = None, *, tag: str | None = None) -> Frame:
    body: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if task_id is not None:
        body["taskId"] = task_id
    if tag is not None:
        body.update(_about(tag))
    return Frame("error", -1, orjson.dumps(body).decode())


def tag_frame(tag: str, task_ids: Sequence[str], more: bool) -> Frame:
    """The answer to a tag's ``subscribe``: its tasks, newest first; ``more`` when some were left out. For
    a batch's (``tag`` a parent's key): a ``batch`` frame, the parent first, then its children."""
    kind = "tag" if parent_of(tag) is None else "batch"
    body = {"type": kind, **_about(tag), "taskIds": list(task_ids), "more": more}
    return Frame(kind, -1, orjson.dumps(body).decode())


def added_frame(tag: str, task_id: str) -> Frame:
    """A task carrying ``tag`` (a child of the parent a batch's subscription follows) was created: its
    ``snapshot`` (``reason: "new"``) follows."""
    return Frame("added", -1, orjson.dumps({"type": "added", **_about(tag), "taskId": task_id}).decode())


PONG = Frame("pong", -1, '{"type":"pong"}')


def text_frame(payload: bytes) -> bytes:
    """A complete, unmasked, final WebSocket text frame (RFC 6455 5.2), as a server sends it: framed once,
    the same bytes are valid on every socket (per-message compression is off)."""
    n = len(payload)
    if n < 126:
        return struct.pack("!BB", 0x81, n) + payload
    if n < 65536:
        return struct.pack("!BBH", 0x81, 126, n) + payload
    return struct.pack("!BBQ", 0x81, 127, n) + payload


def chunks_frame(task_id: str, stream: str, attempt: int, offset: int, chunks: Sequence[str]) -> Frame:
    """Chunks of one attempt of a task's stream, from ``offset`` (protocol.md, Live: chunks and end)."""
    body = {
        "type": "chunks",
        "taskId": task_id,
        "stream": stream,
        "attempt": attempt,
        "offset": offset,
        "chunks": chunks,
    }
    return Frame("chunks", -1, orjson.dumps(body).decode())


def end_frame(task_id: str, stream: str, offset: int) -> Frame:
    """A task's stream is complete: ``offset`` is its final ``nextOffset``."""
    body = {"type": "end", "taskId": task_id, "stream": stream, "offset": offset}
    return Frame("end", -1, orjson.dumps(body).decode())


@dataclass(frozen=True, slots=True)
class Beside:
    """A task's state beside its history at one ``revision`` (protocol.md, Metadata and Batches): its whole
    metadata (compact JSON text) and children counts, consistent with each other, as a ``metadata`` and a
    ``children`` frame carry them. ``metadata`` is ``None`` in a bare wake-up (a bus message too large to
    carry it): the state is then read from the store."""

    task_id: str
    revision: int
    metadata: str | None
    children: tuple[int, ...] | None = None
    epoch: str = ""
    # Its frames, encoded once whatever the number of subscribers they go to (by type).
    encoded: dict[str, Frame] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, task: Task) -> Beside:
        return cls(task.id, task.revision, task.metadata, task.children, task.epoch)

    @property
    def bare(self) -> bool:
        return self.metadata is None

    def frames(self, sent: Beside | None) -> list[Frame]:
        """The frames that bring a client holding ``sent`` to this state: a ``metadata`` frame where the
        metadata differs, a ``children`` frame where the counts do (none where neither does)."""
        out = []
        if self.metadata is not None and (sent is None or sent.metadata != self.metadata):
            out.append(self.metadata_frame())
        if self.children is not None and (sent is None or sent.children != self.children):
            out.append(self.children_frame())
        return out

    def metadata_frame(self) -> Frame:
        assert self.metadata is not None
        if (made := self.encoded.get("metadata")) is not None:
            return made
        text = b'{"type":"metadata","taskId":%b,"revision":%d,"metadata":%b}' % (
            orjson.dumps(self.task_id),
            self.revision,
            self.metadata.encode(),
        )
        made = self.encoded["metadata"] = Frame("metadata", -1, text.decode())
        return made

    def children_frame(self) -> Frame:
        assert self.children is not None
        if (made := self.encoded.get("children")) is not None:
            return made
        counts = dict(zip(CHILDREN_FIELDS, self.children, strict=True))
        body = {"type": "children", "taskId": self.task_id, "revision": self.revision, "children": counts}
        made = self.encoded["children"] = Frame("children", -1, orjson.dumps(body).decode())
        return made

    def message(self) -> bytes:
        """As a bus message (``gateway.bus.base.News``): ``{"type": "beside", "taskId", "epoch", "revision",
        "metadata", "children"?}``, or without ``metadata`` and ``children`` for a bare wake-up."""
        head = b'{"type":"beside","taskId":%b,"epoch":%b,"revision":%d' % (
            orjson.dumps(self.task_id),
            orjson.dumps(self.epoch),
            self.revision,
        )
        if self.metadata is None:
            return head + b"}"
        counts = b"" if self.children is None else b',"children":' + orjson.dumps(self.children)
        return head + b',"metadata":' + self.metadata.encode() + counts + b"}"

    @classmethod
    def decode(cls, body: dict[str, Any]) -> Beside:
        """The inverse of :meth:`message` (of its parsed JSON); ``TypeError`` or ``KeyError`` for another."""
        task_id, epoch, revision = body["taskId"], body["epoch"], body["revision"]
        if not isinstance(task_id, str) or not isinstance(epoch, str) or type(revision) is not int:
            raise TypeError("not a beside message")
        if "metadata" not in body:
            return cls(task_id, revision, None, None, epoch)
        metadata, children = body["metadata"], body.get("children")
        if not isinstance(metadata, dict):
            raise TypeError("metadata is not an object")
        if children is not None and (
            not isinstance(children, list)
            or len(children) != len(CHILDREN_FIELDS)
            or not all(type(c) is int for c in children)
        ):
            raise TypeError("children are not counts")
        counts = None if children is None else tuple(children)
        return cls(task_id, revision, orjson.dumps(metadata).decode(), counts, epoch)
