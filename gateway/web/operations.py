"""Every HTTP route as the OpenAPI document states it: one table, :data:`OPERATIONS`, of what each takes
(credentials, query, body) and answers (status and model), with the security schemes and error meanings
they name. ``gateway.web.openapi`` builds the document from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from gateway.web import answers, metadata, tag_tokens, task_list, wire

REF = "#/components/schemas/{model}"

# Security schemes: who may call what (docs/protocol.md, Tokens and auth).
API_KEY = "apiKey"
SUBSCRIBE = "subscribeToken"
SUBSCRIBE_QUERY = "subscribeTokenQuery"
CALLBACK = "callbackToken"
TAG = "tagToken"
SECURITY_SCHEMES: dict[str, dict[str, Any]] = {
    API_KEY: {
        "type": "http",
        "scheme": "bearer",
        "description": "`Authorization: Bearer $GATEWAY_API_KEY`, from the header only. With no API key "
        "configured (open mode, loopback only) these routes take no credential.",
    },
    SUBSCRIBE: {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "JWT",
        "description": "the task's subscribeToken (JWT, scope `subscribe`); the API key also reads any task",
    },
    SUBSCRIBE_QUERY: {
        "type": "apiKey",
        "in": "query",
        "name": "token",
        "description": "the task's subscribeToken (or a tag token for a tag the task carries) in the URL, "
        "where a browser cannot set headers",
    },
    TAG: {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "JWT",
        "description": "a tag token (POST /v1/tokens; JWT, claims `tag`, scope `subscribe`): reads a task "
        "only if it carries the token's tag (else 403, whether or not the task exists), and lists tasks only "
        "with its tag among the `tag` parameters",
    },
    CALLBACK: {
        "type": "http",
        "scheme": "bearer",
        "bearerFormat": "JWT",
        "description": "the task's callbackToken (JWT, scope `callback`); never the API key",
    },
}

OPEN_SUBSCRIBE = (
    "the task's subscribeToken (JWT, scope `subscribe`); optional in open mode, but one that is sent must "
    "be right"
)

# What each error status means, by code (docs/protocol.md, Errors).
ERRORS: dict[int, str] = {
    400: "`invalid-request`: malformed JSON, a wrong type, an unknown or missing field, a value out of range",
    401: "`unauthorized`: no credential, or a malformed, expired or badly signed one",
    403: "`forbidden`: a valid credential for another task or scope, a tag token on a task without its tag "
    "(or on no task), or an origin not allowed",
    404: "`unknown-task`: no such task (checked after the credential, so ids cannot be probed); "
    "`not-found` for an unknown route",
    405: "`method-not-allowed`",
    408: "`request-timeout`: the body did not arrive within `GATEWAY_BODY_TIMEOUT_MS`; connection closed",
    409: "a conflict, named by its code",
    413: "`payload-too-large`: the body is over `GATEWAY_MAX_BODY_BYTES`",
    415: "`unsupported-media-type`: a `Content-Type` other than JSON (none at all is read as JSON)",
    429: "`rate-limited`: more callbacks per second for this task than `GATEWAY_CALLBACK_RATE_PER_S`; "
    "retry after `Retry-After` (seconds)",
    503: "`unavailable`: the database cannot be reached; nothing was written; retry after `Retry-After`",
}


@dataclass(frozen=True)
class Param:
    name: str
    where: str  # "query" or "header"
    description: str
    schema: dict[str, Any] = field(default_factory=lambda: {"type": "string"})
    required: bool = False


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    summary: str
    answers: dict[int, type[BaseModel] | None]
    errors: dict[int, str] = field(default_factory=dict)  # status: the codes it can carry, beyond ERRORS
    security: tuple[str, ...] = ()
    body: type[BaseModel] | None = None
    body_required: bool = True  # False: the route takes no body at all too (an empty one)
    query: type[BaseModel] | None = None
    params: tuple[Param, ...] = ()
    media_type: str = "application/json"
    tags: tuple[str, ...] = ()
    description: str = ""
    # Headers of the answers, by status (beyond the Retry-After of a 429 and a 503).
    answer_headers: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)


_TASK = "/v1/tasks/{task_id}"
# A cursor: a version alone (a bare version), or with the epoch of the task's history, ``version:epoch``.
_CURSOR_SCHEMA = {
    "anyOf": [
        {"type": "integer", "minimum": 0, "maximum": wire.MAX_CURSOR},
        {"type": "string", "pattern": wire.CURSOR_PATTERN},
    ]
}
_CURSOR = Param(
    "cursor",
    "query",
    "the last version the client holds, with its task's epoch as `version:epoch` (default 0)",
    {**_CURSOR_SCHEMA, "default": 0},
)
_READ_ERRORS = {401: "", 403: "", 404: "", 503: ""}
_STREAM_NAME = "[a-z0-9_-]{1,32}"
_STREAM_OFFSETS = f"{_STREAM_NAME}(:[0-9]{{1,15}})?(,{_STREAM_NAME}(:[0-9]{{1,15}})?){{0,7}}"
# An SSE event's id: the cursor, then the next offset of each stream asked.
_EVENT_ID = f"^-?[0-9]+(:[0-9A-Za-z]+)?(;{_STREAM_OFFSETS})?$"
_LAST_EVENT_ID = f"^([0-9]{{1,15}}(:[0-9A-Za-z]{{1,32}})?)?(;{_STREAM_OFFSETS})?$"
_STREAMS = Param(
    "streams",
    "query",
    "the task's streams to send, each from the offset the client holds: `output:0,log:120` (a name alone "
    "is `name:0`; a name given twice, its last offset), at most 8; empty, none",
    {"type": "string", "pattern": f"^({_STREAM_OFFSETS})?$"},
)

OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "post",
        "/v1/tasks",
        "Create a task",
        {201: answers.Created, 200: answers.Created},
        {
            400: "",
            401: "",
            403: "",
            408: "",
            404: "`unknown-task`: no task has the `parent` id",
            409: "`task-exists`: this id exists with other parameters (tags compared as a set; title, parent "
            "and progressFromChildren too); `parent-ended`: the parent has ended (the body carries it as "
            "`task`)",
            413: "`metadata-too-large`: `metadata` past 8192 bytes as compact JSON",
            415: "",
            503: "",
        },
        security=(API_KEY,),
        body=wire.CreateBody,
        tags=("backend",),
        description="A queued task at version 0 and its two tokens. The same id with the same parameters "
        "(and the same tags, in any order) again answers 200 with the same task and fresh tokens; without "
        "`id` the gateway names the task.",
    ),
    Operation(
        "get",
        "/v1/tasks",
        "List tasks",
        {200: answers.TaskPage},
        {400: "", 401: "", 403: "", 503: ""},
        security=(API_KEY, TAG),
        query=task_list.TaskListQuery,
        tags=("operator",),
        description="Every task, a page at a time, in id order; follow `nextCursor` until it is null. "
        "With `tag` (repeatable: every one must match), the tasks carrying it, newest first; with `parent`, "
        "a batch's children, and with `title`, the tasks whose title contains a text, newest first. A tag "
        "token lists only with its own tag among the `tag` parameters (else 403).",
    ),
    Operation(
        "get",
        _TASK,
        "Read a task",
        {200: answers.TaskJson},
        _READ_ERRORS,
        security=(SUBSCRIBE, TAG, SUBSCRIBE_QUERY, API_KEY),
        tags=("subscriber",),
    ),
    Operation(
        "get",
        _TASK + "/events",
        "Resume from a cursor",
        {200: answers.ResumeAnswer},
        {400: "", **_READ_ERRORS},
        security=(SUBSCRIBE, TAG, SUBSCRIBE_QUERY, API_KEY),
        params=(_CURSOR,),
        tags=("subscriber",),
        description="`caught-up` (nothing missed), `delta` (the missed entries) or `snapshot` (the whole "
        "state: `retention` when the cursor is too far behind, `cursor-ahead` when it is past the task, "
        "`recreated` when its epoch is not the task's: the id was deleted and made again since).",
    ),
    Operation(
        "get",
        _TASK + "/stream",
        "Server-sent events",
        {200: None, 204: None},
        {
            400: "",
            **_READ_ERRORS,
            503: "`too-many-sockets`: this process holds as many connections as its descriptors allow "
            "(GATEWAY_FD_RESERVE): open the stream again later, or on another process",
        },
        security=(SUBSCRIBE, TAG, SUBSCRIBE_QUERY, API_KEY),
        params=(
            _CURSOR,
            _STREAMS,
            Param(
                "Last-Event-ID",
                "header",
                "set by EventSource on a reconnect: the last event's id, `version:epoch`, then with streams "
                "`;name:offset,...` (wins over cursor, and over streams for each stream it names)",
                {"type": "string", "pattern": _LAST_EVENT_ID},
            ),
        ),
        media_type="text/event-stream",
        tags=("subscriber",),
        description="The frames of the single-task WebSocket, each an SSE event named by its type with "
        "`id:` its cursor, `version:epoch`, and with streams the next offset of each after it "
        "(`version:epoch;output:42,log:130`). 204 when a reconnecting EventSource already holds the last "
        "version of a finished task (and its streams' ends).",
    ),
    Operation(
        "post",
        _TASK + "/callbacks",
        "Report a worker event",
        {200: answers.CallbackAnswer},
        {
            400: "",
            401: "",
            403: "",
            404: "",
            408: "",
            409: "`callback-id-reused`: this callbackId came with another body; "
            "`stale-attempt`: attempt is not the task's current one; "
            "`history-full`: the task has `GATEWAY_MAX_HISTORY_VERSIONS` entries and this would not end it",
            413: "",
            415: "",
            429: "",
            503: "",
        },
        security=(CALLBACK,),
        body=wire.CallbackBody,
        tags=("worker",),
        description="The gateway stamps the event with its own clock (`atMs` is refused). Every outcome "
        "the state machine reaches is a 200 with its `reason`, a change or not.",
    ),
    Operation(
        "post",
        _TASK + "/cancel",
        "Cancel a task",
        {200: answers.CancelAnswer},
        {400: "", 401: "", 403: "", 404: "", 408: "", 413: "", 415: "", 503: ""},
        security=(API_KEY,),
        body=wire.CancelBody,
        body_required=False,
        tags=("backend",),
        description='Ends a queued or running task: it becomes `failed` with `error: "cancelled"` '
        "through one `cancel` entry (the gateway's own event, carrying the `reason` given), pushed to "
        "subscribers, with one terminal notification. On a task that has ended nothing changes (200, "
        "`changed: false`, `reason: terminal-conflict`); at or past its deadline the task expires instead. "
        "The worker's next callback is answered `terminal-conflict`.",
    ),
    Operation(
        "post",
        _TASK + "/heartbeat",
        "Renew a running attempt's lease",
        {200: answers.HeartbeatAnswer},
        {
            400: "",
            401: "",
            403: "",
            404: "",
            408: "",
            409: "`stale-attempt`: attempt is not the task's current one; "
            "`not-running`: the task is not running (its attempt is over: requeued, or ended); the body "
            "carries the task beside the error",
            413: "",
            415: "",
            429: "",
            503: "",
        },
        security=(CALLBACK,),
        body=wire.HeartbeatBody,
        tags=("worker",),
        description="Renews the lease of the running attempt (heartbeatMs from now, by the gateway's "
        "clock) and adds no history entry. On a task created without heartbeatMs it renews nothing and "
        "answers nulls: the attempt is still current.",
    ),
    Operation(
        "post",
        _TASK + "/metadata",
        "Patch a task's metadata",
        {200: answers.PatchedAnswer},
        {
            400: "",
            401: "",
            403: "",
            404: "",
            408: "",
            409: "`stale-attempt`: attempt is not the task's current one; `not-running` (the callback token "
            "only): the worker's attempt is over; the body carries the task beside the error",
            413: "`metadata-too-large`: the metadata after the patch would pass 8192 bytes as compact JSON",
            415: "",
            429: "",
            503: "",
        },
        security=(CALLBACK, API_KEY),
        body=metadata.PatchBody,
        tags=("worker", "backend"),
        description="An RFC 7396 merge patch on the task's metadata (null removes a key, objects merge): no "
        "history entry, version unchanged, revision + 1 when the metadata changed (then a `metadata` frame "
        "reaches every subscriber). With the callback token: attempt required and fenced, the lease renewed, "
        "counted with the callbacks; with the API key: any task, ended ones too.",
    ),
    Operation(
        "post",
        _TASK + "/deliveries",
        "Take the result",
        {200: answers.DeliveryAnswer},
        {
            400: "",
            401: "",
            403: "",
            404: "",
            408: "",
            409: "`not-succeeded`: the task has not succeeded; "
            "`key-reused-for-other-task`: this Idempotency-Key was used for another task",
            413: "",
            415: "",
            503: "",
        },
        security=(API_KEY,),
        body=wire.EmptyBody,
        body_required=False,
        params=(
            Param(
                "Idempotency-Key",
                "header",
                "the same key returns the same receipt; another key delivers again",
                {"type": "string", "minLength": 1, "maxLength": 256},
                required=True,
            ),
        ),
        tags=("backend",),
    ),
    Operation(
        "post",
        "/v1/notifications/drain",
        "Drain terminal notifications",
        {200: None},
        {400: "", 401: "", 403: "", 408: "", 413: "", 415: "", 503: ""},
        security=(API_KEY,),
        body=wire.EmptyBody,
        body_required=False,
        query=wire.DrainQuery,
        params=(
            Param(
                "Idempotency-Key",
                "header",
                "keeps the batch under this key for 24 h: the same key answers the same batch again (the "
                "same bytes); a new key takes what is new. Without one a lost answer loses its batch",
                {"type": "string", "minLength": 1, "maxLength": 256},
            ),
        ),
        answer_headers={
            200: {
                "Drain-More": {
                    "schema": {"type": "string", "enum": ["true", "false"]},
                    "description": "`true`: the batch is full and notifications were still to drain after "
                    "it was taken; drain again with a new key. A shorter batch says `false`",
                }
            }
        },
        tags=("backend",),
        description="Up to `limit` of the oldest notifications not drained yet (each of a task reaching "
        "succeeded, failed or expired), listed by task id then time. With an `Idempotency-Key` a backend "
        "retries a drain whose answer it did not get and loses nothing (at least once); without one a "
        "drain is at most once. A batch shorter than `limit` means nothing was left either.",
    ),
    Operation(
        "post",
        "/v1/tokens",
        "Issue a tag token",
        {201: answers.TagToken},
        {400: "", 401: "", 403: "", 408: "", 413: "", 415: ""},
        security=(API_KEY,),
        body=tag_tokens.TokenBody,
        tags=("backend",),
        description="A token that reads every task carrying `tag` (`GET /v1/tasks/{task_id}`, `/events`, "
        "`/stream`, the WebSockets), lists them (`GET /v1/tasks?tag=`) and subscribes to the tag on "
        "`/v1/ws`, for `ttlS` seconds. Give it to the user the tag names (`owner:u42`); it opens nothing "
        "else.",
    ),
    Operation(
        "get",
        "/v1/demo",
        "Whether demo tasks are on",
        {200: answers.DemoStatus},
        tags=("dashboard",),
    ),
    Operation(
        "post",
        "/v1/demo/tasks",
        "Start a demo task",
        {201: answers.DemoCreated},
        {403: "", 404: "`not-found`: demo tasks are off", 503: "also: too many demo tasks are running"},
        tags=("dashboard",),
        description="A task driven by a simulated worker through the public callback route.",
    ),
    Operation("get", "/healthz", "The process is alive", {200: answers.Status}, tags=("operator",)),
    Operation("get", "/readyz", "The database answers", {200: answers.Status}, {503: ""}, tags=("operator",)),
    Operation(
        "get",
        "/metrics",
        "Prometheus metrics",
        {200: None},
        media_type="text/plain; version=0.0.4",
        tags=("operator",),
    ),
)

# One event of an SSE stream (text/event-stream answers are a sequence of these; a JSON schema applies to each
# event): named by its frame type, with ``id:`` the cursor it leaves the client at (``version:epoch``) and the
# frame as data.
SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "event": {
            "type": "string",
            "enum": ["caught-up", "delta", "snapshot", "event", "chunks", "end", "error"],
        },
        "id": {"type": "string", "pattern": _EVENT_ID},
        "data": {"type": "string", "contentMediaType": "application/json"},
        "retry": {"type": "integer", "minimum": 0},
    },
}

# Answers that are not one model: their schema is built here from models.
LIST_OF = {("/v1/notifications/drain", "post"): answers.NotificationJson}

WEBSOCKETS: tuple[dict[str, str], ...] = (
    {
        "path": "/v1/tasks/{task_id}/ws",
        "summary": (
            "One task: ?cursor=N:E&token=T&streams=output:0; the resume frame, then every entry and the "
            "streams' chunks; closes 1000 when done"
        ),
    },
    {
        "path": "/v1/ws",
        "summary": (
            "Many tasks on one socket: subscribe, unsubscribe and ping messages; a task's (taskId, cursor, "
            "streams) or a tag's (tag, cursors: every task of it, new ones announced with an added frame)"
        ),
    },
)
