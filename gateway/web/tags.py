"""Tags in the wire models: a create's ``tags``, the task list's ``tag=``, a tag token's ``tag``, validated as
pydantic types whose JSON schemas the OpenAPI document states. What a tag may be is ``gateway.tag_names``
(one rule, also for the places that take a tag outside a wire model: a token's claim, a ``/v1/ws``
message, the command line).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

from gateway.tag_names import JSON_SCHEMA, MAX_TAGS, tag_problem, tags_problem

__all__ = ["JSON_SCHEMA", "MAX_TAGS", "Tag", "TaskTags", "WantedTags"]


def _tag(value: Any) -> str:
    problem = tag_problem(value)
    if problem is not None:
        raise PydanticCustomError("tag", problem)
    assert isinstance(value, str)
    return value


Tag = Annotated[str, PlainValidator(_tag), WithJsonSchema(JSON_SCHEMA)]


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
    if not isinstance(value, list):
        raise PydanticCustomError("tags_type", "must be an array of tags")
    problem = tags_problem(value)
    if problem is not None:
        raise PydanticCustomError("tags", problem)
    return tuple(sorted(value))


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
