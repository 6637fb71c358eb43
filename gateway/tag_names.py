"""What a tag may be (protocol.md, Tags), in the protocol's words: pure, the one place the rule is written.

A tag names a group of tasks (``owner:u42``, ``project:7``): 1 to 128 characters of ``A-Z a-z 0-9 : . _ @ -``:
no space, so that a task's tags are stored joined by one (``gateway.store.tables``), and nothing a URL, a
JWT claim or a log line would need to escape. A task carries at most :data:`MAX_TAGS`, each once, fixed at
creation and kept sorted. Every place that takes a tag checks it here: a create's ``tags`` and the task
list's ``tag=`` (through the wire types of ``gateway.web.tags``), a tag token (``POST /v1/tokens``,
``gateway token --tag``, the token's own claim) and a ``/v1/ws`` tag subscribe.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from gateway.errors import InvalidRequest

MAX_TAG_LENGTH = 128
MAX_TAGS = 16
# The rule as a JSON Schema pattern (ECMA-262, which Python's re reads alike); _TAG is it, matched whole.
TAG_PATTERN = f"^[A-Za-z0-9:._@-]{{1,{MAX_TAG_LENGTH}}}$"
_TAG = re.compile(f"[A-Za-z0-9:._@-]{{1,{MAX_TAG_LENGTH}}}")
RULE = f"1 to {MAX_TAG_LENGTH} characters of A-Z, a-z, 0-9 and : . _ @ -"
JSON_SCHEMA: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_TAG_LENGTH,
    "pattern": TAG_PATTERN,
    "description": f"a tag: {RULE}",
}


def tag_problem(value: object) -> str | None:
    """Why ``value`` is not a tag, or ``None`` for a tag (a field's words, without the field's name)."""
    if not isinstance(value, str):
        return "a tag must be a string"
    if _TAG.fullmatch(value) is None:
        shown = value if len(value) <= 40 else value[:40] + "..."
        return f"{shown!r} is not a tag: a tag is {RULE}"
    return None


def check_tag(value: object, field: str = "tag") -> str:
    """``value`` if it is a tag, else ``InvalidRequest`` naming ``field``."""
    problem = tag_problem(value)
    if problem is not None:
        raise InvalidRequest(f"{field}: {problem}")
    assert isinstance(value, str)
    return value


def tags_problem(values: Sequence[object]) -> str | None:
    """Why ``values`` are not the tags of one task (at most :data:`MAX_TAGS`, each a tag, each once), or
    ``None``."""
    if len(values) > MAX_TAGS:
        return f"at most {MAX_TAGS} tags per task, got {len(values)}"
    seen: set[str] = set()
    for value in values:
        problem = tag_problem(value)
        if problem is not None:
            return problem
        assert isinstance(value, str)
        if value in seen:
            return f"{value!r} is given more than once (each tag once)"
        seen.add(value)
    return None


# --- a batch followed as a tag is (protocol.md, Batches) -------------------------------------------------

# A parent's subscription is a tag subscription under this key: its children are the tasks it lists and
# announces. No tag starts with it (a tag has no control character), so the two never meet.
PARENT_KEY = "\x00parent:"


def parent_key(task_id: str) -> str:
    """The key under which a subscription follows the children of ``task_id``."""
    return PARENT_KEY + task_id


def parent_of(key: str) -> str | None:
    """The parent a key follows the children of, or ``None`` for a tag."""
    return key[len(PARENT_KEY) :] if key.startswith(PARENT_KEY) else None


def watched_keys(tags: Sequence[str], parent: str | None) -> tuple[str, ...]:
    """The keys a task's creation is news for: its tags, and its parent's key where it has one."""
    return tuple(tags) if parent is None else (*tags, parent_key(parent))
