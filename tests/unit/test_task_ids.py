"""The task id rule (``gateway.web.task_ids``), by itself: its control characters are Unicode's."""

from __future__ import annotations

import unicodedata

from gateway.web.task_ids import CONTROL, task_id_problem


def test_control_characters_are_exactly_unicode_category_cc() -> None:
    """U+0000-U+001F, U+007F-U+009F: C0, DEL and C1 (Cc is closed: Unicode never adds to it)."""
    cc = {c for c in range(0x110000) if unicodedata.category(chr(c)) == "Cc"}
    assert {c for c in range(0x110000) if CONTROL.search(chr(c))} == cc


def test_each_problem_in_the_protocols_words() -> None:
    assert task_id_problem("report-42") is None
    assert task_id_problem("caf\u00e9") is None
    assert task_id_problem("a/b") == "must not contain '/'"
    assert task_id_problem("a\u0085b") == "must not contain control characters (U+0085)"
    assert task_id_problem("a\nb") == "must not contain control characters (U+000A)"
    assert task_id_problem("..") == "'..' cannot be addressed in a URL path"
    assert task_id_problem("cafe\u0301") == (
        "must be in Unicode normalization form C (NFC): send 'café', which looks the same"
    )
