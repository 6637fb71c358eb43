"""The answers' shapes, for the OpenAPI document (``gateway.web.openapi``).

The routes build their answers with orjson for speed (``gateway.web.wire``); these models describe the same
JSON, and the tests check every answer of a real server against them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.json_schema import SkipJsonSchema

from gateway.web.tags import JSON_SCHEMA as TAG_SCHEMA
from gateway.web.wire import FailBody, ProgressBody, StartBody, State, SucceedBody, _Body

Absent = SkipJsonSchema[None]  # a field that is left out of the JSON rather than sent as null


def _drop_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


# The default of an absent field: not in the schema, where ``null`` would contradict the field's type.
ABSENT: Any = Field(default=None, json_schema_extra=_drop_default)
Reason = Literal[
    "started",
    "progress",
    "succeeded",
    "failed",
    "requeued",
    "expired",
    "duplicate-result",
    "duplicate-expire",
    "terminal-conflict",
    "already-running",
    "not-startable",
    "not-running",
    "stale-progress",
    "duplicate-progress",
    "duplicate-callback",
]
# What a cancel answers: the gateway's own transition, or what the machine says of a task it cannot cancel.
CancelReason = Literal["cancelled", "expired", "terminal-conflict"]
ErrorCode = Literal[
    "invalid-request",
    "unauthorized",
    "forbidden",
    "unknown-task",
    "task-exists",
    "key-reused-for-other-task",
    "not-succeeded",
    "callback-id-reused",
    "stale-attempt",
    "history-full",
    "not-running",
    "request-timeout",
    "payload-too-large",
    "unsupported-media-type",
    "rate-limited",
    "not-found",
    "method-not-allowed",
    "unavailable",
    "too-many-sockets",
    "seq-reused",
    "seq-gap",
    "too-many-streams",
    "stream-full",
    "parent-ended",
    "metadata-too-large",
    "internal",
]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


Tag = Annotated[str, WithJsonSchema(TAG_SCHEMA)]


class ChildrenJson(_Answer):
    """A parent's children by state (a cancelled child is ``failed``); ``total`` is the sum of the others."""

    total: int = Field(ge=0)
    queued: int = Field(ge=0)
    running: int = Field(ge=0)
    succeeded: int = Field(ge=0)
    failed: int = Field(ge=0)
    expired: int = Field(ge=0)


class TaskJson(_Answer):
    """A task, without its history."""

    id: str
    state: State
    expiresAtMs: int = Field(description="the deadline for a result, in epoch milliseconds")
    attempts: int
    maxAttempts: int
    progress: int = Field(ge=0, le=100)
    version: int = Field(ge=0, description="how many entries the task's history holds")
    tags: list[Tag] = Field(description="the task's tags, fixed at creation, sorted; [] for none")
    createdAtMs: int = Field(description="when the task was created, by the gateway's clock, in epoch ms")
    epoch: str | Absent = Field(
        default=None,
        json_schema_extra=_drop_default,
        description="which history of its id the task is, made at its creation: a task made again under "
        "the id of a deleted one has another; send it with a cursor (`version:epoch`)",
    )
    resultRef: str | Absent = ABSENT
    resultHash: str | Absent = ABSENT
    error: str | Absent = ABSENT
    # Beside the history (protocol.md, Shapes): never in it, and no event's outcome depends on them.
    title: str | Absent = Field(
        default=None, json_schema_extra=_drop_default, description="what a person reads"
    )
    metadata: dict[str, Any] = Field(description="live state beside the history; {} for none")
    parent: str | Absent = Field(
        default=None, json_schema_extra=_drop_default, description="the parent's id, for a child of a batch"
    )
    progressFromChildren: Literal[True] | Absent = Field(
        default=None,
        json_schema_extra=_drop_default,
        description="the gateway moves the progress as the children end",
    )
    children: ChildrenJson | Absent = Field(
        default=None,
        json_schema_extra=_drop_default,
        description="the children's counts by state, once the task has had a child",
    )
    revision: int = Field(
        ge=0, description="counts the changes beside the history (metadata, children): apply the newest"
    )
    worker: str | Absent = Field(
        default=None, json_schema_extra=_drop_default, description="the last start's"
    )
    startedAtMs: int | Absent = Field(
        default=None, json_schema_extra=_drop_default, description="the last start's time, in epoch ms"
    )
    endedAtMs: int | Absent = Field(
        default=None, json_schema_extra=_drop_default, description="when it became terminal, in epoch ms"
    )


class StartEvent(StartBody):
    atMs: int


class ProgressEvent(ProgressBody):
    atMs: int


class SucceedEvent(SucceedBody):
    atMs: int


class FailEvent(FailBody):
    atMs: int


class ExpireEvent(_Body):
    type: Literal["expire"]
    atMs: int


class CancelEvent(_Body):
    """The gateway's own event (not one of the task machine's: protocol.md, Shapes): the task was cancelled
    on request."""

    type: Literal["cancel"]
    atMs: int
    reason: str | Absent = ABSENT


StoredEvent = Annotated[
    StartEvent | ProgressEvent | SucceedEvent | FailEvent | ExpireEvent | CancelEvent,
    Field(discriminator="type"),
]


class EntryJson(_Answer):
    """One history entry: the event that moved the task to ``version``, stamped by the gateway."""

    version: int
    event: StoredEvent


class Created(_Answer):
    task: TaskJson
    callbackToken: str = Field(description="for the worker: POST /v1/tasks/{task_id}/callbacks")
    subscribeToken: str = Field(description="for subscribers: reads, WebSocket, SSE")


class TagToken(_Answer):
    token: str = Field(
        description="a tag token (JWT, claims tag, scope subscribe, exp): reads and lists the tasks carrying "
        "its tag, and subscribes to the tag on /v1/ws"
    )
    expiresAtMs: int = Field(description="when the token expires (its exp), in epoch milliseconds")


class ResumeAnswer(_Answer):
    mode: Literal["caught-up", "delta", "snapshot"]
    version: int
    reason: Literal["retention", "cursor-ahead", "recreated"] | Absent = ABSENT
    task: TaskJson
    events: list[EntryJson] = Field(description="the entries after the cursor, for a delta; else empty")


# A worker's answers while its task runs with a heartbeat lease (a callback's, a stream append's).
LeaseUntil = Annotated[
    int | Absent,
    Field(
        description="while the task runs with a heartbeat lease: when it ends (epoch ms) unless renewed",
        json_schema_extra=_drop_default,
    ),
]
LeaseLength = Annotated[
    int | Absent,
    Field(
        description="while the task runs with a heartbeat lease: the lease's length, which each callback, "
        "heartbeat or stream append renews",
        json_schema_extra=_drop_default,
    ),
]


class CallbackAnswer(_Answer):
    changed: bool
    duplicate: bool
    duplicateCallback: bool
    notify: bool
    reason: Reason
    task: TaskJson
    leaseUntilMs: LeaseUntil = None
    heartbeatMs: LeaseLength = None


class PatchedAnswer(_Answer):
    task: TaskJson = Field(description="the task after the patch")


class HeartbeatAnswer(_Answer):
    leaseUntilMs: int | None = Field(
        description="the lease's new end (epoch ms); null when the task was created without heartbeatMs"
    )
    heartbeatMs: int | None = Field(description="the lease's length; null when the task has no lease")


class CancelAnswer(_Answer):
    changed: bool = Field(description="whether the task changed (an entry was added)")
    duplicate: bool
    notify: bool = Field(description="the task just became terminal: a notification is waiting")
    reason: CancelReason = Field(
        description="`cancelled`: the task is now failed with error `cancelled`; `expired`: the deadline "
        "had passed, so the task expired instead; `terminal-conflict`: the task had already ended, "
        "nothing changed"
    )
    task: TaskJson


class ReceiptJson(_Answer):
    taskId: str
    resultRef: str
    resultHash: str
    idempotencyKey: str
    deliveredAtMs: int


class DeliveryAnswer(_Answer):
    ok: bool
    duplicate: bool
    reason: Literal["delivered", "duplicate-delivery"]
    receipt: ReceiptJson


class NotificationJson(_Answer):
    taskId: str
    state: Literal["succeeded", "failed", "expired"]
    atMs: int
    version: int


class TaskPage(_Answer):
    tasks: list[TaskJson]
    nextCursor: str | None = Field(description="pass as ?cursor= for the next page; null on the last page")


class ErrorDetail(_Answer):
    code: ErrorCode
    message: str


class ErrorAnswer(_Answer):
    error: ErrorDetail
    task: TaskJson | Absent = Field(
        default=None,
        description="with `not-running` only: the task as it is, so that a worker learns what ended its "
        'attempt (cancelled: `failed` with `error: "cancelled"`)',
        json_schema_extra=_drop_default,
    )
    expectedSeq: int | Absent = Field(
        default=None,
        description="with `seq-gap` only: the seq the stream expects next (a batch before is missing)",
        json_schema_extra=_drop_default,
    )


class Status(_Answer):
    status: Literal["ok", "ready"]


class DemoStatus(_Answer):
    enabled: bool


class DemoCreated(_Answer):
    task: TaskJson
    subscribeToken: str


class StreamAppended(_Answer):
    """A stream append's answer (protocol.md, Streams)."""

    stream: str
    attempt: int
    offset: int = Field(description="the offset of the batch's first chunk")
    nextOffset: int = Field(description="the offset after the batch's last chunk")
    duplicate: bool = Field(description="the batch was appended before (a retry): nothing was appended")
    leaseUntilMs: LeaseUntil = None
    heartbeatMs: LeaseLength = None


class StreamPage(_Answer):
    """A page of a stream's chunks, from an offset."""

    stream: str
    epoch: str = Field(description="the task's epoch: send it with an offset (`offset:epoch`)")
    attempt: int = Field(description="the attempt the chunks are of (0: a stream not made yet)")
    offset: int = Field(description="the offset of the first chunk: the one asked, or its attempt's first")
    chunks: list[str]
    nextOffset: int = Field(description="the offset after the last chunk: ask it next")
    more: bool = Field(description="chunks follow this page")
    closed: bool = Field(description="the task has ended: no chunk is appended any more")


class StreamInfo(_Answer):
    name: str
    attempt: int
    nextOffset: int
    bytes: int = Field(description="the size of the stream's text (its attempt's chunks) in UTF-8")
    closed: bool


class StreamList(_Answer):
    epoch: str
    streams: list[StreamInfo]
