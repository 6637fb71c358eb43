"""RFC 7396 JSON merge patch, the one rule a task's metadata changes by (protocol.md, Metadata): the gateway
applies patches with it (``gateway.metadata``) and the clients compose theirs by it
(``gateway.client.merge_patch``). Pure: no I/O, no import."""

from __future__ import annotations

from typing import Any


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396: an object patch merges into an object target key by key (``null`` removes a key, nested
    objects merge); any other patch replaces the target. Neither is changed."""
    if not isinstance(patch, dict):
        return patch
    merged = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = merge_patch(merged.get(key), value)
    return merged
