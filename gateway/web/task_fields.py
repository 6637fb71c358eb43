"""The fields a task has beside its history (protocol.md, Shapes), as wire types: a create's ``title`` and
``metadata``, validated with the body's types and stated in its JSON schema (the OpenAPI document)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from gateway.machine import is_blank
from gateway.metadata import MAX_METADATA_BYTES

# A title a person reads (protocol.md, Shapes): 1 to 200 characters, not blank, no control character (C0,
# DEL, C1: a line break or a terminal's escape would break the dashboard's and `gateway watch`'s lines).
MAX_TITLE = 200
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_NO_CONTROL = "^[^\\u0000-\\u001f\\u007f-\\u009f]*$"


def _title(value: Any) -> str:
    if not isinstance(value, str):
        raise PydanticCustomError("title_type", "must be a string")
    if not 1 <= len(value) <= MAX_TITLE:
        raise PydanticCustomError("title_length", f"must be 1 to {MAX_TITLE} characters")
    if _CONTROL.search(value):
        raise PydanticCustomError("title_control", "must not contain a control character")
    if is_blank(value):
        raise PydanticCustomError("title_blank", "must not be blank")
    return value


Title = Annotated[
    str,
    PlainValidator(_title),
    WithJsonSchema({"type": "string", "minLength": 1, "maxLength": MAX_TITLE, "pattern": _NO_CONTROL}),
]


def _metadata(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PydanticCustomError("metadata_type", "must be a JSON object")
    return value


MetadataObject = Annotated[
    dict[str, Any],
    PlainValidator(_metadata),
    WithJsonSchema({"type": "object", "description": f"at most {MAX_METADATA_BYTES} bytes as compact JSON"}),
]
