"""A task's metadata patches (protocol.md: ``POST /v1/tasks/{id}/metadata``), pure: RFC 7396 JSON merge
patches, what a client checks before it sends one, and how two patches waiting to be sent become one.

A run's patches go in the order the job made them. Two waiting patches are sent as one when one patch says
the same as both (:func:`compose`): a job that reports ``{"current": i}`` a hundred times between two sends
sends one patch, as its progress coalesces. Not every pair can be one patch: ``{"a": null}`` then
``{"a": {"b": 1}}`` makes ``a`` exactly ``{"b": 1}``, which no single merge patch says of a document whose
``a`` is an object (a patch's object merges into it); such a pair goes as two.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

# A task's metadata, serialized (compact JSON, UTF-8), is at most this many bytes (the gateway's limit: a
# create or a patch past it is ``413 metadata-too-large``).
MAX_METADATA_BYTES: Final = 8192
# The key of the status line a person reads under the progress bar (protocol.md's convention).
MESSAGE: Final = "message"


def check_patch(patch: Any, what: str = "metadata") -> dict[str, Any]:
    """``patch`` as a JSON object the gateway takes (a copy, through JSON), else ``ValueError`` saying why:
    not an object (``TypeError`` for keys that are not strings, values JSON cannot hold), or past
    :data:`MAX_METADATA_BYTES` (whatever it merges into would be too)."""
    if not isinstance(patch, Mapping):
        raise ValueError(f"{what} must be a JSON object (a dict), not {type(patch).__name__}")
    try:
        text = json.dumps(patch, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{what} must be JSON: {exc}") from None
    size = len(text.encode())
    if size > MAX_METADATA_BYTES:
        raise ValueError(
            f"{what} takes {size} bytes as JSON; a task's metadata holds at most {MAX_METADATA_BYTES}"
        )
    copy: dict[str, Any] = json.loads(text)
    return copy


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode())


def compose(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any] | None:
    """One patch that does what ``first`` then ``then`` do, to any document (``apply(apply(d, first), then)
    == apply(d, compose(first, then))``), or ``None`` when no single patch does."""
    out = dict(first)
    for key, value in then.items():
        if key not in first or not isinstance(value, dict):
            out[key] = value  # a value (or a removal) replaces whatever ``first`` did to the key
            continue
        earlier = first[key]
        if not isinstance(earlier, dict):
            # ``first`` made the key a value (or removed it), which ``then``'s object replaces by itself
            # alone; one patch's object would merge into the document's instead.
            return None
        inner = compose(earlier, value)
        if inner is None:
            return None
        out[key] = inner
    return out


class PatchQueue:
    """A run's patches not yet taken by the gateway, oldest first; the first may be on its way (sent, not
    answered: sent again as it is until answered, a patch being idempotent). Each patch notes whether the
    job made it while a progress value of its waited (``after_progress``): it then goes after that
    progress's callback, the progress before it in the job's order."""

    def __init__(self) -> None:
        self.items: list[list[Any]] = []  # [patch, after_progress]
        self.sending = False  # the first is on its way

    def __len__(self) -> int:
        return len(self.items)

    def add(self, patch: dict[str, Any], *, after_progress: bool) -> None:
        """Keep ``patch``, as one with the last one waiting when one patch says both (and neither is on its
        way, both stand on the same side of a waiting progress, and the one is not past
        :data:`MAX_METADATA_BYTES`: a refused patch would take the other with it)."""
        if self.items and not (self.sending and len(self.items) == 1):
            last = self.items[-1]
            both = compose(last[0], patch) if last[1] == after_progress else None
            if both is not None and _size(both) <= MAX_METADATA_BYTES:
                last[0] = both
                return
        self.items.append([patch, after_progress])

    def due(self, progress_waits: bool) -> dict[str, Any] | None:
        """The patch to send now (the one on its way, again), or ``None``: none waits, or the first waits for
        the progress before it (``progress_waits``: a progress value is still to be sent)."""
        if not self.items:
            return None
        patch, after_progress = self.items[0]
        if after_progress and progress_waits and not self.sending:
            return None
        self.sending = True
        result: dict[str, Any] = patch
        return result

    def progress_sent(self) -> None:
        """The progress the waiting patches came after was taken: none waits for it any more."""
        for item in self.items:
            item[1] = False

    def answered(self) -> None:
        """The patch on its way was answered (taken, or refused for good): the next one follows."""
        if self.sending:
            self.items.pop(0)
            self.sending = False

    def again(self) -> None:
        """The patch on its way goes again from the start (a new attempt sends it)."""
        self.sending = False

    def pending(self) -> list[dict[str, Any]]:
        """The patches, JSON-able, for another process (:meth:`resume`)."""
        return [item[0] for item in self.items]

    @classmethod
    def resume(cls, patches: Any) -> PatchQueue:
        queue = cls()
        queue.items = [[dict(patch), False] for patch in patches or ()]
        return queue
