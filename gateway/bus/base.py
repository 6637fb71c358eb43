"""The bus interface, and the message every implementation carries.

A bus message is news of a commit, not the data's only copy: it names the task and the version, and
carries the entry's ``event`` frame (the task after it included) where it fits, to spare a read. The store
stays the truth: the hub reads what it missed from the store when it sees a version jump, when a listener
reconnects, and on a slow periodic check, so a lost or late message delays an entry, never loses or
reorders one. A task created with tags is news too (``created``, its frame the ``snapshot`` with ``reason:
"new"``), for the subscribers of its tags; the periodic check lists the tags again for one that was lost.

The write path calls a bus twice per entry: :meth:`Bus.announce` inside the committing transaction (where
PostgreSQL's ``NOTIFY`` belongs, so that a message exists exactly when its entry does) and
:meth:`Bus.publish` right after the commit (this process's own subscribers, and Redis). The hub hears
every message, from this process or another, through the ``on_news`` callback of :meth:`Bus.run`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import orjson
from anyio.abc import TaskStatus

from gateway.frames import Beside, Frame, snapshot_frame
from gateway.machine import Task, task_from_json
from gateway.store.base import WriteTx

log = logging.getLogger("gateway.bus")

# PostgreSQL refuses a NOTIFY payload of 8000 bytes or more; a longer frame travels as id and version.
MAX_PAYLOAD_BYTES = 7900
# PostgreSQL's channel, which LISTEN/NOTIFY keeps to one database, so to one deployment, already. On Redis,
# whose pub/sub spans every database number of a server, each deployment has one of its own:
# deployment_channel().
DEFAULT_CHANNEL = "task_gateway"


def deployment_channel(deployment_id: str) -> str:
    """The Redis channel of the deployment whose database holds ``deployment_id`` (gateway.store.deployment):
    shared by every process of that deployment, and by no other deployment."""
    return f"{DEFAULT_CHANNEL}:{deployment_id}"


@dataclass(frozen=True, slots=True)
class StreamRun:
    """Chunks appended to a task's stream, committed (protocol.md, Streams): ``attempt``'s chunks at
    ``offset`` to ``next_offset - 1``, as the stored JSON array (``encoded``) or decoded from a message
    (``chunks``); neither in a bare wake-up, which says only that the stream reaches ``next_offset`` (a
    batch too large for a message: the subscribers read it from the store)."""

    stream: str
    attempt: int
    offset: int
    next_offset: int
    encoded: bytes | None = None
    chunks: list[str] | None = None

    def items(self) -> list[str] | None:
        """The chunks, or ``None`` for a bare wake-up."""
        if self.chunks is not None or self.encoded is None:
            return self.chunks
        chunks: list[str] = orjson.loads(self.encoded)
        return chunks


@dataclass(frozen=True, slots=True)
class News:
    """A committed entry: ``version`` of ``task_id``; ``task`` and ``frame`` unless it is a bare wake-up.
    Or, ``created``, a task created with tags (no entry): ``task`` as created, ``frame`` its ``snapshot``
    (``reason: "new"``), unless it did not fit in a message. An entry decoded from a message carries its
    task as ``task_json`` until :meth:`read` makes it (before then it reads as a bare wake-up)."""

    task_id: str
    version: int
    task: Task | None = None
    frame: Frame | None = None
    created: bool = False
    # Decoded from a message, the task's JSON, not yet made a Task: every process hears every message,
    # most of them of tasks it has no subscriber of, or its own commits heard again (gateway.live.hub reads
    # only those a subscriber here needs).
    task_json: Any = field(default=None, compare=False, repr=False)
    # News of chunks appended to a stream of the task (no entry: ``version`` is -1).
    run: StreamRun | None = None
    # News of a change beside the history (its metadata, its children counts: no entry, ``version`` -1).
    beside: Beside | None = None

    @classmethod
    def of(cls, task: Task, frame: Frame) -> News:
        return cls(task.id, task.version, task, frame)

    @classmethod
    def appended(
        cls, task_id: str, stream: str, attempt: int, offset: int, count: int, encoded: bytes
    ) -> News:
        """News of a batch of ``count`` chunks (``encoded``: their JSON array) appended to ``stream``."""
        return cls(task_id, -1, run=StreamRun(stream, attempt, offset, offset + count, encoded))

    @classmethod
    def besides(cls, task: Task) -> News:
        """News of ``task``'s state beside its history, changed (a metadata patch, a child's move)."""
        return cls(task.id, -1, beside=Beside.of(task))

    @classmethod
    def creation(cls, task: Task) -> News:
        """News of a task just created, for the subscribers of its tags."""
        return cls(task.id, task.version, task, snapshot_frame(task, "new"), created=True)

    def read(self) -> News:
        """This message with its task made from the message (a bare wake-up if that task is not one)."""
        if self.task_json is None:
            return self
        try:
            task = task_from_json(self.task_json)
        except (KeyError, TypeError, ValueError, AttributeError):
            log.warning("bus: a message's task could not be read; reading the store instead")
            return News(self.task_id, self.version, created=self.created)
        return News(self.task_id, self.version, task, self.frame, self.created)

    def encode(self) -> str:
        """The message text: the frame itself, or ``{"taskId", "version"}`` (and ``"created": true``) where it
        does not fit. News of chunks: ``{"type": "chunks", "taskId", "stream", "attempt", "offset",
        "nextOffset", "chunks"}``, without ``chunks`` where they do not fit."""
        if self.run is not None:
            return _encode_run(self.task_id, self.run)
        if self.beside is not None:
            text = self.beside.message()
            if len(text) > MAX_PAYLOAD_BYTES:  # metadata of up to 8 KiB: the subscribers read the store
                text = replace(self.beside, metadata=None, children=None).message()
            return text.decode()
        if self.frame is not None and len(self.frame.text) <= MAX_PAYLOAD_BYTES // 4:
            return self.frame.text  # fast path: even 4-byte UTF-8 everywhere cannot pass the limit
        if self.frame is not None and len(self.frame.text.encode()) <= MAX_PAYLOAD_BYTES:
            return self.frame.text
        bare = {"taskId": self.task_id, "version": self.version}
        if self.created:
            bare["created"] = True
        return orjson.dumps(bare).decode()

    @classmethod
    def decode(cls, text: str | bytes) -> News:
        """Parse a message; ``ValueError`` for one that is not a gateway message."""
        try:
            body = orjson.loads(text)
            if body.get("type") == "chunks":
                return cls(body["taskId"], -1, run=_decode_run(body))
            if body.get("type") == "beside":
                beside = Beside.decode(body)
                return cls(beside.task_id, -1, beside=beside)
            task_id, version = body["taskId"], body["version"]
            if not isinstance(task_id, str) or isinstance(version, bool) or not isinstance(version, int):
                raise TypeError
            kind = body.get("type")
            created = kind == "snapshot" and body.get("reason") == "new"  # a task created with tags
            if kind != "event" and not created:
                return cls(task_id, version, created=body.get("created") is True)
            frame_text = text if isinstance(text, str) else text.decode()
            task_json = body["task"]
            if not isinstance(task_json, dict):
                raise TypeError
            epoch = task_json.get("epoch", "")
            frame = Frame(kind, version, frame_text, epoch if isinstance(epoch, str) else "")
            if created:  # rare, and every tag subscription of the process looks at it
                return cls(task_id, version, task_from_json(task_json), frame, created=True)
            return cls(task_id, version, None, frame, task_json=task_json)  # the task: read() makes it
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise ValueError(f"not a gateway bus message: {exc!r}") from None


def _encode_run(task_id: str, run: StreamRun) -> str:
    head = b'{"type":"chunks","taskId":%b,"stream":%b,"attempt":%d,"offset":%d,"nextOffset":%d' % (
        orjson.dumps(task_id),
        orjson.dumps(run.stream),
        run.attempt,
        run.offset,
        run.next_offset,
    )
    encoded = run.encoded if run.encoded is not None else orjson.dumps(run.chunks)
    if len(head) + len(encoded) + 12 <= MAX_PAYLOAD_BYTES:
        return (head + b',"chunks":' + encoded + b"}").decode()
    return (head + b"}").decode()


def _decode_run(body: dict[str, Any]) -> StreamRun:
    task_id, stream, chunks = body["taskId"], body["stream"], body.get("chunks")
    numbers = [body["attempt"], body["offset"], body["nextOffset"]]
    if not isinstance(task_id, str) or not isinstance(stream, str):
        raise TypeError
    if any(isinstance(n, bool) or not isinstance(n, int) for n in numbers):
        raise TypeError
    attempt, offset, next_offset = numbers
    if chunks is not None:
        if not isinstance(chunks, list) or not all(isinstance(c, str) for c in chunks):
            raise TypeError
        if offset + len(chunks) != next_offset:
            raise ValueError
    return StreamRun(stream, attempt, offset, next_offset, chunks=chunks)


OnNews = Callable[[News], None]
# Called when the bus (re)connects: messages may have been missed meanwhile, so read the store.
OnResync = Callable[[], None]


class Bus(Protocol):
    #: Whether other processes publish on this bus (so that the hub also checks the store now and then).
    shared: bool
    #: Whether the listener is connected now, and how many times it has connected (for metrics).
    connected: bool
    reconnects: int

    def join(self, deployment_id: str) -> None:
        """Before :meth:`run`: the deployment this process serves (its id, kept in its database). A bus that
        several deployments can share (Redis, the twin) carries its messages on the deployment's own
        channel, unless one was configured (``GATEWAY_BUS_CHANNEL``)."""

    async def run(self, on_news: OnNews, on_resync: OnResync, *, task_status: TaskStatus[None]) -> None:
        """Deliver every message to ``on_news`` until cancelled; ``task_status.started()`` once listening.

        Owned by the app's lifespan (``await task_group.start(bus.run, ...)``); it reconnects by itself."""

    async def announce(self, tx: WriteTx, news: Sequence[News]) -> None:
        """Inside the committing transaction: messages that exist exactly when their entries do."""

    def publish(self, news: News) -> None:
        """After the commit; never blocks. This process's listeners hear it at once."""
