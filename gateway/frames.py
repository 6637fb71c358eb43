"""Server frames (protocol.md, WebSocket): pure encoding, no I/O.

An ``event`` frame is encoded once per entry, by the process that commits it; the same text goes to every
subscriber of that process and, as the bus message, to every other process, which sends it unchanged.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.machine import Resume, Task, task_to_json


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


def error_frame(code: str, message: str, task_id: str | None = None, *, tag: str | None = None) -> Frame:
    body: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if task_id is not None:
        body["taskId"] = task_id
    if tag is not None:
        body["tag"] = tag
    return Frame("error", -1, orjson.dumps(body).decode())


def tag_frame(tag: str, task_ids: Sequence[str], more: bool) -> Frame:
    """The answer to a tag's ``subscribe``: its tasks, newest first; ``more`` when some were left out."""
    body = {"type": "tag", "tag": tag, "taskIds": list(task_ids), "more": more}
    return Frame("tag", -1, orjson.dumps(body).decode())


def added_frame(tag: str, task_id: str) -> Frame:
    """A task carrying ``tag`` was created: its ``snapshot`` (``reason: "new"``) follows."""
    return Frame("added", -1, orjson.dumps({"type": "added", "tag": tag, "taskId": task_id}).decode())


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
