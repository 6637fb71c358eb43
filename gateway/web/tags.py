"""What a tag may be (docs/protocol.md, Tags), in the protocol's words, wherever one is taken: the tags of a
create, the task list's ``tag=``.

A tag is 1 to 128 characters of ``A-Z a-z 0-9 : . _ @ -`` (``owner:u42``, ``project:7``): no space, so
that a task's tags are stored joined by one (``gateway.store.tables``), and nothing a URL or a log line
would need to escape. A task has at most ``MAX_TAGS``, each once, fixed at creation and kept sorted.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

MAX_TAGS = 16
MAX_LENGTH = 128
# The rule as a JSON Schema pattern (ECMA-262); _TAG is the same, matched whole.
PATTERN = "^[A-Za-z0-9:._@-]{1,128}$"
_TAG = re.compile("[A-Za-z0-9:._@-]{1,128}")
RULE = "1 to 128 characters of A-Z, a-z, 0-9 and : . _ @ -"
JSON_SCHEMA: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_LENGTH,
    "pattern": PATTERN,
    "description": f"a tag: {RULE}",
}


def tag_problem(value: object) -> str | None:
    """Why ``value`` is not a tag, or ``None`` for a tag."""
    if not isinstance(value, str):
        return "a tag must be a string"
    if _TAG.fullmatch(value) is None:
        shown = value if len(value) <= 40 else value[:40] + "..."
        return f"{shown!r} is not a tag: a tag is {RULE}"
    return None


def _tag_list(value: Any, what: str) -> list[str]:
    if not isinstance(value, list):
        raise PydanticCustomError("tags_type", "must be an array of tags")
    if len(value) > MAX_TAGS:
        raise PydanticCustomError("tags_count", f"at most {MAX_TAGS} {what}, got {len(value)}")
    for item in value:
        problem = tag_problem(item)
        if problem is not None:
            raise PydanticCustomError("tag", problem)
    return value


def _task_tags(value: Any) -> tuple[str, ...]:
    """A create's tags: each once, at most ``MAX_TAGS``; kept sorted."""
    tags = _tag_list(value, "tags per task")
    seen: set[str] = set()
    for tag in tags:
        if tag in seen:
            raise PydanticCustomError("tag_repeated", f"{tag!r} is given more than once (each tag once)")
        seen.add(tag)
    return tuple(sorted(tags))


def _wanted_tags(value: Any) -> tuple[str, ...]:
    """The task list's ``tag=`` values, in the order given, each once (a task has at most ``MAX_TAGS``)."""
    return tuple(dict.fromkeys(_tag_list(value, "tag parameters")))


TaskTags = Annotated[
    tuple[str, ...],
    PlainValidator(_task_tags),
    WithJsonSchema(
        {
            "type": "array",
            "items": JSON_SCHEMA,
            "maxItems": MAX_TAGS,
            "uniqueItems": True,
            "description": f"at most {MAX_TAGS}, each once, fixed at creation (answered sorted)",
        }
    ),
]
WantedTags = Annotated[
    tuple[str, ...],
    PlainValidator(_wanted_tags),
    WithJsonSchema({"type": "array", "items": JSON_SCHEMA, "maxItems": MAX_TAGS}),
]
