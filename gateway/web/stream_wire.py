"""What the routes of a task's streams take (protocol.md, Streams), validated strictly, and how the OpenAPI
document states them (``STREAM_OPERATIONS``, beside ``gateway.web.operations``' table)."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, StrictStr, WithJsonSchema
from pydantic_core import PydanticCustomError
from starlette.datastructures import QueryParams

from gateway.errors import InvalidRequest
from gateway.streams import (
    DEFAULT_PAGE_CHUNKS,
    MAX_CHUNK_BYTES,
    MAX_CHUNKS,
    MAX_OFFSET,
    MAX_PAGE_CHUNKS,
    MAX_SEQ,
    MAX_STREAMS,
    check_name,
)
from gateway.web import answers, wire
from gateway.web.operations import API_KEY, CALLBACK, SUBSCRIBE, SUBSCRIBE_QUERY, TAG, Operation


def _seq(value: object) -> int:
    """A batch's number: a whole JSON number (3 and 3.0 alike, as the schema's ``integer`` says) from 0 to
    2**53-1."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not float(value).is_integer():
        raise PydanticCustomError("seq_range", "must be a whole number from 0 to 2**53-1")
    if not 0 <= value <= MAX_SEQ:
        raise PydanticCustomError("seq_range", "must be a whole number from 0 to 2**53-1")
    return int(value)


Seq = Annotated[
    int, PlainValidator(_seq), WithJsonSchema({"type": "integer", "minimum": 0, "maximum": MAX_SEQ})
]
# A chunk's limit is in UTF-8 bytes (gateway.streams.Chunks checks it); a schema counts characters.
Chunk = Annotated[StrictStr, WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_CHUNK_BYTES})]


class AppendBody(wire._Body):
    """``POST /v1/tasks/{task_id}/streams/{name}``: chunks appended by the worker of ``attempt``."""

    attempt: wire.Attempt = Field(description="the attempt the worker is running (the task's attempts)")
    seq: Seq = Field(
        description="the batch's number among the worker's batches of this stream in this attempt"
    )
    chunks: list[Chunk] = Field(
        min_length=1,
        max_length=MAX_CHUNKS,
        description="1 to 1000 chunks of 1 byte to 64 KiB in UTF-8 each, appended at consecutive offsets",
    )


def parse_append(raw: bytes) -> AppendBody:
    return wire._validate(AppendBody, wire.parse_json(raw))


class PageQuery(BaseModel):
    """The query of ``GET /v1/tasks/{task_id}/streams/{name}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    offset: Annotated[str, Field(json_schema_extra={"pattern": wire.CURSOR_PATTERN})] | None = Field(
        default=None,
        description="where to read from: an offset, or `offset:epoch` with the task's epoch (default 0); one "
        "before the stream's attempt, past its end or of another epoch reads from the attempt's first chunk",
    )
    limit: Annotated[int, Field(ge=1, le=MAX_PAGE_CHUNKS)] = Field(
        default=DEFAULT_PAGE_CHUNKS, description="chunks at most (and 1 MiB of them)"
    )


# An offset as a query takes it: ``N``, or ``N:E`` with the epoch of the task it was read in.
_OFFSET = re.compile(r"(-?[0-9]{1,100})(?::([0-9A-Za-z]{1,32}))?")


def parse_offset(raw: str | None) -> tuple[int, str | None]:
    """``N`` or ``N:E`` (0 when absent): the offset and the epoch it was read in, if given."""
    if raw is None or raw == "":
        return 0, None
    match = _OFFSET.fullmatch(raw)
    if match is None:
        raise InvalidRequest(
            f"offset: must be an offset (an integer), or one and the task's epoch as 'N:E', got {raw[:60]!r}"
        )
    offset = int(match[1])
    if not 0 <= offset <= MAX_OFFSET:
        raise InvalidRequest(f"offset: must be an integer from 0 to {MAX_OFFSET}, got {offset}")
    return offset, match[2]


# --- the streams a task subscription asks for (protocol.md, Live: chunks and end) ---------------------------


def _stream_offset(name: str, value: object, field: str) -> tuple[str, int]:
    check_name(name, field)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_OFFSET:
        raise InvalidRequest(f"{field}: {name}'s offset must be an integer from 0 to {MAX_OFFSET}")
    return name, value


def at_most(streams: dict[str, int], field: str) -> dict[str, int] | None:
    if len(streams) > MAX_STREAMS:
        raise InvalidRequest(f"{field}: at most {MAX_STREAMS} streams, got {len(streams)}")
    return streams or None


def message_streams(value: object) -> dict[str, int] | None:
    """A subscribe message's ``streams``: ``{"output": 0, "log": 120}``, at most 8 names, each with the
    offset to start from (``None``: no stream asked)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest('streams: must be an object of names and offsets, as {"output": 0}')
    streams = dict(_stream_offset(name, offset, "streams") for name, offset in value.items())
    return at_most(streams, "streams")


def parse_streams(raw: str | None, field: str = "streams") -> dict[str, int] | None:
    """``output:0,log:120`` (a name alone is ``name:0``; one given twice, its last offset), as the
    single-task socket's and SSE's ``?streams=`` and an SSE event's id after its ``;`` carry it."""
    if raw is None or raw == "":
        return None
    streams: dict[str, int] = {}
    items = raw.split(",")
    if len(items) > MAX_STREAMS:  # a name given twice counts twice: at most 8 entries, as the schema says
        raise InvalidRequest(f"{field}: at most {MAX_STREAMS} streams, got {len(items)}")
    for item in items:
        name, _, offset = item.partition(":")
        if offset and not (offset.isascii() and offset.isdigit() and len(offset) <= 15):
            raise InvalidRequest(f"{field}: {name[:40]}'s offset must be an integer, got {offset[:20]!r}")
        streams.update([_stream_offset(name, int(offset or 0), field)])
    return at_most(streams, field)


def query_streams(params: QueryParams) -> dict[str, int] | None:
    """``?streams=output:0,log:120``; given more than once it is refused."""
    values = params.getlist("streams")
    if len(values) > 1:
        raise InvalidRequest("streams: given more than once")
    return parse_streams(values[0] if values else None)


_STREAM = "/v1/tasks/{task_id}/streams"
_READERS = (SUBSCRIBE, TAG, SUBSCRIBE_QUERY, API_KEY)
_READ_ERRORS = {400: "", 401: "", 403: "", 404: "", 503: ""}

STREAM_OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "post",
        _STREAM + "/{name}",
        "Append chunks to a task's stream",
        {200: answers.StreamAppended},
        {
            400: "",
            401: "",
            403: "",
            404: "",
            408: "",
            409: "`stale-attempt`: attempt is not the task's current one; `not-running`: the task is not "
            "running (the body carries the task); `seq-reused`: this seq was appended with other chunks; "
            "`seq-gap`: a batch before this one is missing (the body carries `expectedSeq`); "
            "`too-many-streams`: the task has 8 streams",
            413: "also: over 1 MiB; `stream-full`: the stream's text would pass `GATEWAY_STREAM_MAX_BYTES`",
            415: "",
            429: "",
            503: "",
        },
        security=(CALLBACK, API_KEY),
        body=AppendBody,
        tags=("worker",),
        description="Appends the chunks at the stream's next offsets while the task runs at `attempt`; a "
        "retry of an appended batch (the same attempt, seq and chunks) is answered as the first time, "
        "`duplicate: true`. Adds no history entry; renews a heartbeat lease. A chunk is at most 64 KiB in "
        "UTF-8 and the body at most 1 MiB, which the schema's character counts cannot state.",
    ),
    Operation(
        "get",
        _STREAM + "/{name}",
        "Read a page of a task's stream",
        {200: answers.StreamPage},
        _READ_ERRORS,
        security=_READERS,
        query=PageQuery,
        tags=("subscriber",),
        description="Chunks of the stream's attempt from `offset` (or from the attempt's first chunk), at "
        "most `limit` and 1 MiB. A stream not made yet reads empty.",
    ),
    Operation(
        "get",
        _STREAM + "/{name}/text",
        "Read a task's stream as text",
        {200: None},
        _READ_ERRORS,
        security=_READERS,
        media_type="text/plain; charset=utf-8",
        tags=("subscriber",),
        answer_headers={
            200: {
                "Stream-Attempt": {"schema": {"type": "string"}, "description": "the attempt the text is of"},
                "Stream-Next-Offset": {
                    "schema": {"type": "string"},
                    "description": "the offset after the text's last chunk: subscribe from it",
                },
                "Stream-Closed": {
                    "schema": {"type": "string", "enum": ["true", "false"]},
                    "description": "the task has ended: the text is whole",
                },
            }
        },
        description="The chunks of the stream's attempt joined (empty for a stream not made yet).",
    ),
    Operation(
        "get",
        _STREAM,
        "List a task's streams",
        {200: answers.StreamList},
        _READ_ERRORS,
        security=_READERS,
        tags=("subscriber",),
    ),
)
