"""What a task id may be (protocol.md, Create), in the protocol's words.

An id travels in URL paths and is shown to people: no ``/``, not ``.`` or ``..`` (a browser would resolve
them), no control character (Unicode's category Cc: C0, DEL and C1, such as U+0085 NEXT LINE), and in
Unicode normalization form C, so that two ids that look the same are one id. An id in another form is
refused, not normalized: a backend may have minted tokens for the id it sent, and they would name another
task. Blank ids are the state machine's to refuse (with its own message), and the length is the
wire model's. An id that breaks the rule names no task: in a path it is ``unknown-task``, as any id no
task has, so a task made before the rule keeps being reachable by its id.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from gateway.machine import JS_WHITESPACE

MAX_LENGTH = 128
# Unicode's category Cc, which is closed (no code point will ever be added to it): U+0000-U+001F and
# U+007F-U+009F. tests/unit/test_task_ids.py holds it to unicodedata's.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _escaped(chars: str) -> str:
    return "".join(f"\\u{ord(c):04x}" for c in chars)


# The rule as a JSON Schema pattern (ECMA-262, which Python's re reads alike): not "." or "..", not blank
# (JavaScript's whitespace only, as the machine judges), no "/" and no control character. NFC has no
# pattern: the schema names it as the format "task-id".
PATTERN = "^(?!\\.\\.?$)(?![" + _escaped(JS_WHITESPACE) + "]*$)[^/\\u0000-\\u001f\\u007f-\\u009f]+$"
JSON_SCHEMA: dict[str, Any] = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_LENGTH,
    "pattern": PATTERN,
    "format": "task-id",
    "description": "at most 128 characters, not blank, no '/' or control character (Unicode Cc), not '.' "
    "or '..', in Unicode normalization form C (NFC); without it the gateway names the task (a UUID)",
}


def task_id_problem(task_id: str) -> str | None:
    """Why no task may have this id, or ``None`` for an id that may be created."""
    if task_id in (".", ".."):
        return f"{task_id!r} cannot be addressed in a URL path"
    if "/" in task_id:
        return "must not contain '/'"
    control = CONTROL.search(task_id)
    if control is not None:
        return f"must not contain control characters (U+{ord(control.group()):04X})"
    if not unicodedata.is_normalized("NFC", task_id):
        composed = unicodedata.normalize("NFC", task_id)
        return f"must be in Unicode normalization form C (NFC): send {composed!r}, which looks the same"
    return None
