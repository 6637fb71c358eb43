"""A task's metadata (protocol.md, Metadata): a JSON object beside the history, set at create and changed by
merge patches (RFC 7396), at most ``MAX_METADATA_BYTES`` as compact JSON. Pure: no I/O.

It is kept as its compact JSON text (``Task.metadata``), the form the store holds and the size is judged
by; a patch that leaves the object as it was changes nothing (no revision, no frame).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Final

import orjson

from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.json_merge_patch import merge_patch
from gateway.machine import Task

MAX_METADATA_BYTES: Final = 8192
EMPTY: Final = "{}"


def encoded(metadata: dict[str, Any]) -> str:
    """``metadata`` as its compact JSON text; ``413 metadata-too-large`` past ``MAX_METADATA_BYTES``."""
    try:
        text = orjson.dumps(metadata)
    except TypeError as exc:  # an integer past 64 bits: no JSON number this gateway stores exactly
        raise InvalidRequest(f"metadata: {exc}") from None
    if len(text) > MAX_METADATA_BYTES:
        raise PayloadTooLarge(
            f"metadata is {len(text)} bytes as compact JSON; at most {MAX_METADATA_BYTES}",
            code="metadata-too-large",
        )
    return text.decode()


def patched(task: Task, patch: dict[str, Any]) -> Task | None:
    """``task`` with ``patch`` merged into its metadata and its revision counted, or ``None`` when the patch
    leaves the metadata as it was."""
    text = encoded(merge_patch(orjson.loads(task.metadata), patch))
    if text == task.metadata:  # the texts, not the objects: 1 == 1.0 == true in Python, not in JSON
        return None
    return replace(task, metadata=text, revision=task.revision + 1)
