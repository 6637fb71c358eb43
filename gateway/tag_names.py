"""What a tag may be (protocol.md, Tags), in the protocol's words: pure, one place for every check.

A tag names a group of tasks (``owner:u42``, ``project:7``): 1 to 128 characters of ``[A-Za-z0-9:._@-]``, so
that it travels unescaped in a query string, a JWT claim and a log line. A task carries at most
:data:`MAX_TAGS`, fixed at creation, none twice. The create body, the task list's ``tag=`` query, a tag token
(``POST /v1/tokens``, ``gateway token --tag``) and a ``/v1/ws`` tag subscribe all check a tag here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from gateway.errors import InvalidRequest

MAX_TAG_LENGTH = 128
MAX_TAGS = 16
TAG_ALPHABET = "A-Za-z0-9:._@-"
# The rule as a JSON Schema pattern (ECMA-262, which Python's re reads alike).
TAG_PATTERN = f"^[{TAG_ALPHABET}]{{1,{MAX_TAG_LENGTH}}}$"
_TAG = re.compile(f"[{TAG_ALPHABET}]{{1,{MAX_TAG_LENGTH}}}")
_NOT_IN_ALPHABET = re.compile(f"[^{TAG_ALPHABET}]")
JSON_SCHEMA: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_TAG_LENGTH,
    "pattern": TAG_PATTERN,
    "description": f"1 to {MAX_TAG_LENGTH} characters of A-Z, a-z, 0-9 and : . _ @ -",
}


def tag_problem(value: object) -> str | None:
    """Why ``value`` is not a tag, or ``None`` for a tag (a field's words, without the field's name)."""
    if not isinstance(value, str):
        return "must be a string"
    if _TAG.fullmatch(value):
        return None
    if value == "":
        return "must not be empty"
    if len(value) > MAX_TAG_LENGTH:
        return f"at most {MAX_TAG_LENGTH} characters, got {len(value)}"
    bad = _NOT_IN_ALPHABET.search(value)
    assert bad is not None
    return f"only A-Z, a-z, 0-9 and : . _ @ - may be in a tag, not {bad.group()!r}"


def check_tag(value: object, field: str = "tag") -> str:
    """``value`` if it is a tag, else ``InvalidRequest`` naming ``field``."""
    problem = tag_problem(value)
    if problem is not None:
        raise InvalidRequest(f"{field}: {problem}")
    assert isinstance(value, str)
    return value


def check_tags(values: Sequence[object], field: str = "tags") -> tuple[str, ...]:
    """The tags of one task: at most :data:`MAX_TAGS`, each a tag, none twice; sorted (as they are stored),
    else ``InvalidRequest`` naming ``field`` (and the position of a bad tag in it)."""
    if len(values) > MAX_TAGS:
        raise InvalidRequest(f"{field}: at most {MAX_TAGS} tags, got {len(values)}")
    tags = [check_tag(value, f"{field}[{i}]") for i, value in enumerate(values)]
    seen: set[str] = set()
    for i, tag in enumerate(tags):
        if tag in seen:
            raise InvalidRequest(f"{field}[{i}]: {tag!r} is given more than once")
        seen.add(tag)
    return tuple(sorted(tags))
