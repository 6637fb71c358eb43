"""What a task id may be (protocol.md, Create), in the protocol's words.

An id travels in URL paths and is shown to people: no ``/``, not ``.`` or ``..`` (a browser would resolve
them), no control character (Unicode's category Cc: C0, DEL and C1, such as U+0085 NEXT LINE), and in
Unicode normalization form C, so that two ids that look the same are one id. An id in another form is
refused, not normalized: a backend may have minted tokens for the id it sent, and they would name another
task. Blank ids are the state machine's to refuse (with the reference's message), and the length is the
wire model's. An id that breaks the rule names no task: in a path it is ``unknown-task``, as any id no
task has, so a task made before the rule keeps being reachable by its id.
"""

from __future__ import annotations

import re
import unicodedata

# Unicode's category Cc, which is closed (no code point will ever be added to it): U+0000-U+001F and
# U+007F-U+009F. tests/unit/test_task_ids.py holds it to unicodedata's.
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


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
