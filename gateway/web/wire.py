"""Wire models: the request bodies and queries of protocol.md, validated strictly (the JSON the API
answers is ``gateway.web.render``).

Type checks (JSON types, required and unknown fields) happen here and answer ``400 invalid-request``
naming the field; range checks (progress over 100, a blank ``resultRef``) are the state machine's, in its
order. Numbers the machine checks for integrality (``maxAttempts``, ``progress``) are accepted as any
JSON number here so that the machine decides, in the order of protocol.md's task life (a ``progress`` on a
queued task is ``not-running``, whatever its value).
"""

from __future__ import annotations

import difflib
import hashlib
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StrictStr,
    ValidationError,
    WithJsonSchema,
)
from pydantic_core import PydanticCustomError
from starlette.datastructures import QueryParams
from starlette.responses import Response

from gateway.book.drain import DEFAULT_LIMIT as DRAIN_DEFAULT_LIMIT
from gateway.book.drain import MAX_LIMIT as DRAIN_MAX_LIMIT
from gateway.errors import InvalidRequest
from gateway.lease import MIN_HEARTBEAT_MS
from gateway.machine import Event, Fail, Progress, Start, Succeed
from gateway.metadata import MAX_METADATA_BYTES
from gateway.web import task_ids
from gateway.web.tags import TaskTags
from gateway.web.task_fields import MetadataObject, Title

M = TypeVar("M", bound=BaseModel)

# JavaScript's largest safe integer: a deadline beyond it could not be read exactly by a JS client.
MAX_SAFE = 2**53 - 1
# What a stored count (maxAttempts) can hold: a BIGINT.
MAX_STORED = 2**63 - 1
# The longest ttlMs, about 142,800 years: expiresAtMs (now + ttlMs) stays at most MAX_SAFE while the clock is
# below 2**52 ms (the year 144,683), so the limit is one number the schema can state, not one moving with it.
MAX_TTL_MS = 2**52


def _number(value: Any) -> float:
    """Any JSON number (not a boolean); its range is the state machine's to judge."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PydanticCustomError("number_type", "must be a number")
    return value


def _stored_count(value: Any) -> float:
    number = _number(value)
    if number > MAX_STORED:
        raise PydanticCustomError("number_range", "must be at most 2**63-1")
    return number


def _progress(value: Any) -> float:
    """Any JSON number whose integer, if it is one, fits in 64 bits (the machine judges 0..100 in its
    order; an integer past 64 bits is not a number this gateway can hash or store, at any state)."""
    number = _number(value)
    if isinstance(number, int) and not -(2**63) <= number < 2**63:
        raise PydanticCustomError("number_range", "must be a number from 0 to 100 (an integer past 64 bits)")
    return number


def _milliseconds(value: Any) -> int:
    """A whole number of milliseconds (1000 or 1000.0): the gateway's clock counts whole milliseconds."""
    number = _number(value)
    if isinstance(number, float) and not number.is_integer():
        raise PydanticCustomError("whole_ms", "must be a whole number of milliseconds")
    return int(number)


def _text(value: str) -> str:
    if "\x00" in value:
        # PostgreSQL text cannot hold U+0000; refused on every backend alike.
        raise PydanticCustomError("nul_character", "must not contain the NUL character (U+0000)")
    return value


# The JSON schema of each says what the server takes, no more and no less (the OpenAPI document is built from
# it, and schemathesis holds the server to it): ranges the machine checks whatever the task's state are
# stated; those it checks only on a running task (progress, a blank resultRef) cannot be, and are not.
_NO_NUL = "^[^\\u0000]*$"
Text = Annotated[StrictStr, AfterValidator(_text), WithJsonSchema({"type": "string", "pattern": _NO_NUL})]
CallbackId = Annotated[
    StrictStr,
    Field(max_length=256),
    AfterValidator(_text),
    WithJsonSchema({"type": "string", "pattern": _NO_NUL, "maxLength": 256}),
]
TaskId = Annotated[
    StrictStr,
    Field(max_length=task_ids.MAX_LENGTH),
    AfterValidator(_text),
    WithJsonSchema(task_ids.JSON_SCHEMA),
]
Number = Annotated[float, PlainValidator(_number, json_schema_input_type=float)]
ProgressNumber = Annotated[float, PlainValidator(_progress, json_schema_input_type=float)]
StoredCount = Annotated[
    float,
    PlainValidator(_stored_count),
    WithJsonSchema({"type": "integer", "minimum": 1, "maximum": MAX_STORED}),
]
Milliseconds = Annotated[
    int,
    PlainValidator(_milliseconds),
    WithJsonSchema({"type": "integer", "exclusiveMinimum": 0, "maximum": MAX_TTL_MS}),
]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _heartbeat_ms(value: Any) -> int:
    """A lease of at least ``MIN_HEARTBEAT_MS``, in whole milliseconds (the gateway's own field: the task
    machine has no lease, so the range is checked here, with the types)."""
    number = _milliseconds(value)
    if not MIN_HEARTBEAT_MS <= number <= MAX_TTL_MS:
        raise PydanticCustomError(
            "heartbeat_range", f"must be from {MIN_HEARTBEAT_MS} to {MAX_TTL_MS} (milliseconds)"
        )
    return number


HeartbeatMs = Annotated[
    int,
    PlainValidator(_heartbeat_ms),
    WithJsonSchema({"type": "integer", "minimum": MIN_HEARTBEAT_MS, "maximum": MAX_TTL_MS}),
]


def _attempt(value: Any) -> int:
    """An attempt as a task counts them (its ``attempts``: 0 before the first start, at most a BIGINT), as
    any JSON number that is a whole one (1 and 1.0 alike, as the schema's ``integer`` says)."""
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or not 0 <= value <= MAX_STORED:
        raise PydanticCustomError("attempt_range", "must be a whole number from 0 to 2**63-1")
    return int(value)


Attempt = Annotated[
    int,
    PlainValidator(_attempt),
    WithJsonSchema({"type": "integer", "minimum": 0, "maximum": MAX_STORED}),
]


class CreateBody(_Body):
    id: TaskId | None = None
    ttlMs: Milliseconds
    maxAttempts: StoredCount = Field(
        default=1,
        description="how many times a worker may start the task (1 when left out, as Backend.create)",
    )
    heartbeatMs: HeartbeatMs | None = Field(
        default=None,
        description="a heartbeat lease: a running attempt that shows no sign of life (a callback or a "
        "heartbeat) for this long is failed with heartbeat-timeout (retryable)",
    )
    tags: TaskTags = Field(
        default=(),
        description="the task's tags (owner:u42, project:7), at most 16, each once, fixed at creation "
        "(answered sorted): what GET /v1/tasks?tag= finds it by",
    )
    title: Title | None = Field(default=None, description="what a person reads where the task is shown")
    metadata: MetadataObject | None = Field(
        default=None,
        description="live state beside the history, changed by POST /v1/tasks/{task_id}/metadata; "
        f"at most {MAX_METADATA_BYTES} bytes as compact JSON (413 metadata-too-large past it)",
    )
    parent: TaskId | None = Field(
        default=None,
        description="the id of a task that has not ended: this task is one of its children, counted in its "
        "children (404 unknown-task, 409 parent-ended)",
    )
    progressFromChildren: StrictBool = Field(
        default=False,
        description="the gateway moves this task's progress as its children end (ended x 100 / total)",
    )


class StartBody(_Body):
    type: Literal["start"]
    worker: Text

    def at(self, at_ms: int) -> Event:
        return Start(at_ms, self.worker)


class ProgressBody(_Body):
    type: Literal["progress"]
    progress: ProgressNumber
    cursor: Text = Field(
        default="",
        description="the worker's own bookmark in its work (row-400), kept in the history entry beside the "
        "progress; not a subscriber's resume cursor (a version). An empty string when left out",
    )

    def at(self, at_ms: int) -> Event:
        return Progress(at_ms, self.progress, self.cursor)


class SucceedBody(_Body):
    type: Literal["succeed"]
    resultRef: Text
    resultHash: Text

    def at(self, at_ms: int) -> Event:
        return Succeed(at_ms, self.resultRef, self.resultHash)


class FailBody(_Body):
    type: Literal["fail"]
    error: Text
    retryable: StrictBool

    def at(self, at_ms: int) -> Event:
        return Fail(at_ms, self.error, self.retryable)


EVENT_TYPES = ("start", "progress", "succeed", "fail")
_EVENT_BODIES: dict[str, type[BaseModel]] = {
    "start": StartBody,
    "progress": ProgressBody,
    "succeed": SucceedBody,
    "fail": FailBody,
}
EventBody = Annotated[StartBody | ProgressBody | SucceedBody | FailBody, Field(discriminator="type")]


class CallbackBody(_Body):
    # A start cannot carry attempt (parse_callback refuses it): said in the schema too.
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {"properties": {"event": {"properties": {"type": {"const": "start"}}}}},
                    "then": {"properties": {"attempt": {"type": "null"}}},
                }
            ]
        }
    )

    callbackId: CallbackId | None = None
    attempt: Attempt | None = None
    event: EventBody

    def digest(self, task_id: str) -> str:
        """The callback as parsed JSON (task id, event, attempt), for telling a retry from a reuse."""
        event = self.event.model_dump()
        progress = self.event.progress if isinstance(self.event, ProgressBody) else None
        if progress is not None and float(progress).is_integer() and abs(progress) < 2**63:
            event["progress"] = int(progress)  # 50 and 50.0 are one JSON number
        canonical = orjson.dumps(
            {"taskId": task_id, "event": event, "attempt": self.attempt}, option=orjson.OPT_SORT_KEYS
        )
        return hashlib.sha256(canonical).hexdigest()


# The longest reason a cancel may carry (it is kept in the task's history and pushed to every subscriber).
MAX_CANCEL_REASON = 1024


CancelReason = Annotated[
    StrictStr,
    Field(min_length=1, max_length=MAX_CANCEL_REASON),
    AfterValidator(_text),
    WithJsonSchema({"type": "string", "pattern": _NO_NUL, "minLength": 1, "maxLength": MAX_CANCEL_REASON}),
]


class CancelBody(_Body):
    """``POST /v1/tasks/{task_id}/cancel``: why, in a person's words (optional; kept in the entry)."""

    reason: CancelReason | None = None


def parse_cancel(raw: bytes) -> CancelBody:
    """The cancel body; an empty body (``curl -X POST`` with nothing) is ``{}``, no reason."""
    return CancelBody() if raw.strip() == b"" else _validate(CancelBody, parse_json(raw))


class EmptyBody(_Body):
    """The body of a route that takes no field (a drain: its limit is in the query; a delivery: its key is
    the ``Idempotency-Key`` header): none, or ``{}``."""


def parse_empty_body(raw: bytes, elsewhere: Mapping[str, str] | None = None) -> None:
    """Refuse a body with a field where the route takes none: a field a route does not know is refused,
    never ignored (protocol.md, Errors). ``elsewhere``: where such a field belongs instead, by name."""
    if raw.strip() == b"":
        return
    data = parse_json(raw)
    if isinstance(data, dict):
        for name, where in (elsewhere or {}).items():
            if name in data:
                raise InvalidRequest(f"{name}: unknown field ({where})")
    _validate(EmptyBody, data)


class HeartbeatBody(_Body):
    attempt: Attempt = Field(
        description="the attempt the worker is running (the task's attempts at its start)"
    )


# --- queries --------------------------------------------------------------------------------------------

State = Literal["queued", "running", "succeeded", "failed", "expired"]


class DrainQuery(BaseModel):
    """The query of ``POST /v1/notifications/drain``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    limit: Annotated[int, Field(ge=1, le=DRAIN_MAX_LIMIT)] = Field(
        default=DRAIN_DEFAULT_LIMIT,
        description="notifications a new batch takes at most, the oldest first (a kept batch is answered "
        "as it was made)",
    )


def parse_drain_query(params: QueryParams) -> DrainQuery:
    repeated = sorted({name for name, _ in params.multi_items() if len(params.getlist(name)) > 1})
    if repeated:
        raise InvalidRequest(f"{repeated[0]}: given more than once")
    return _validate(DrainQuery, dict(params))


def parse_json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"malformed JSON: {exc}") from None


def parse_create(raw: bytes) -> CreateBody:
    return _validate(CreateBody, parse_json(raw))


def parse_heartbeat(raw: bytes) -> HeartbeatBody:
    return _validate(HeartbeatBody, parse_json(raw))


def parse_callback(raw: bytes) -> CallbackBody:
    data = parse_json(raw)
    if isinstance(data, dict):
        event = data.get("event")
        if isinstance(event, dict):
            if "atMs" in event:
                raise InvalidRequest("event.atMs: not allowed; the gateway stamps the time of each callback")
            kind = event.get("type")
            if kind == "expire":
                raise InvalidRequest("event.type: expire is a system action, not a callback")
            if kind == "cancel":
                raise InvalidRequest(
                    "event.type: cancel is the gateway's own event, not a callback "
                    "(a backend cancels with POST /v1/tasks/{task_id}/cancel)"
                )
            if isinstance(kind, str) and kind not in EVENT_TYPES:
                raise InvalidRequest(
                    f"event.type: unknown event type {kind!r} (expected start, progress, succeed or fail)"
                )
    body = _validate(CallbackBody, data)
    if body.attempt is not None and isinstance(body.event, StartBody):
        raise InvalidRequest("attempt: only progress, succeed and fail callbacks are fenced by attempt")
    return body


def _validate(model: type[M], data: Any) -> M:
    if not isinstance(data, dict):
        raise InvalidRequest("body: must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(_describe(exc, model, data)) from None


def _describe(exc: ValidationError, model: type[BaseModel], data: dict[str, Any]) -> str:
    errors = exc.errors(include_url=False)
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        # Named first: an unknown field is most often a misspelt one, whose "missing" would hide it.
        return "; ".join(_unknown_field(e["loc"], _not_given(model, data, e["loc"][:-1])) for e in unknown)
    first = errors[0]
    field = _field(first["loc"])
    if first["type"] == "union_tag_not_found":
        return f"{field}.type: required field is missing"
    message = first["msg"]
    if first["type"] == "missing":
        message = "required field is missing"
    return f"{field}: {message}"


def _field(loc: tuple[int | str, ...]) -> str:
    parts = [str(part) for part in loc]
    if len(parts) >= 2 and parts[0] == "event" and parts[1] in EVENT_TYPES:
        del parts[1]  # the discriminator's tag is not a field the client sent
    return ".".join(parts) or "body"


def _not_given(model: type[BaseModel], data: dict[str, Any], place: tuple[int | str, ...]) -> list[str]:
    """The fields a body may have at ``place`` (its top, or its event) that it does not: required or not,
    what a misspelt field most likely meant to be."""
    if place == ():
        return [name for name in model.model_fields if name not in data]
    event = data.get("event")
    if len(place) == 2 and place[0] == "event" and place[1] in _EVENT_BODIES and isinstance(event, dict):
        return [name for name in _EVENT_BODIES[str(place[1])].model_fields if name not in event]
    return []


def _unknown_field(loc: tuple[int | str, ...], not_given: list[str]) -> str:
    """``name: unknown field``, with the field not given beside it that it most likely meant to be."""

    def plain(name: str) -> str:
        return name.lower().replace("_", "").replace("-", "")

    siblings = {plain(name): name for name in not_given}
    close = difflib.get_close_matches(plain(str(loc[-1])), siblings, n=1, cutoff=0.6)
    hint = f" (did you mean {siblings[close[0]]}?)" if close else ""
    return f"{_field(loc)}: unknown field{hint}"


class JSON(Response):
    """A JSON answer, encoded with orjson (bytes already encoded are sent as they are), ending with a newline
    as a text file does: ``curl`` leaves the shell's prompt on a line of its own."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return (content if isinstance(content, bytes) else orjson.dumps(content)) + b"\n"


# A cursor is a version (at most what a JavaScript client can hold exactly), alone or with the epoch of the
# task's history it was read in: ``V:E`` (protocol.md, Resuming).
MAX_CURSOR = MAX_SAFE
_CURSOR = re.compile(r"(-?[0-9]{1,100})(?::([0-9A-Za-z]{1,32}))?")
# What the OpenAPI document says of a cursor in a string: up to 15 digits, always within range, with an
# epoch or not; empty, it is 0 (as when it is left out).
CURSOR_PATTERN = r"^([0-9]{1,15}(:[0-9A-Za-z]{1,32})?)?$"
_SHAPE = "a version (an integer), or a version and the task's epoch as 'V:E'"

# A cursor as read: the version, and the epoch of its history (None: a bare version).
Cursor = tuple[int, str | None]


def query_cursor(query: QueryParams) -> Cursor:
    """``?cursor=N`` or ``?cursor=N:E``; given more than once it is refused, not read as its last value."""
    values = query.getlist("cursor")
    if len(values) > 1:
        raise InvalidRequest("cursor: given more than once")
    return parse_cursor(values[0] if values else None)


def parse_cursor(raw: str | None, field: str = "cursor") -> Cursor:
    """A cursor from a query string, a ``Last-Event-ID`` header or a string in a message: ``V`` or
    ``V:E``."""
    if raw is None or raw == "":
        return 0, None
    match = _CURSOR.fullmatch(raw)
    if match is None:
        raise InvalidRequest(f"{field}: must be {_SHAPE}, got {raw[:60]!r}")
    return cursor_in_range(int(match[1]), field), match[2]


def message_cursor(value: object, field: str = "cursor") -> Cursor:
    """A cursor in a JSON message: an integer (a bare version) or a string ``V:E``."""
    if isinstance(value, str) and ":" in value:
        return parse_cursor(value, field)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{field}: must be {_SHAPE}, got {value!r:.40}")
    return cursor_in_range(value, field), None


def cursor_in_range(cursor: int, field: str = "cursor") -> int:
    """A cursor's version the protocol takes, else ``invalid-request`` in its words (the machine's own
    check would name its internal field, ``cursorVersion``)."""
    if not 0 <= cursor <= MAX_CURSOR:
        raise InvalidRequest(f"{field}: must be an integer from 0 to {MAX_CURSOR}, got {cursor}")
    return cursor
