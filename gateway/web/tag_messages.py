"""A ``/v1/ws`` message about a tag (protocol.md, Live: tags), validated: ``{"type": "subscribe", "tag",
"token", "cursors"}`` or ``{"type": "unsubscribe", "tag"}``; or about a batch, the same with ``parent``
instead of ``tag`` (protocol.md, Batches). Each refusal is ``invalid-request`` in words
that name the field at fault."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.errors import InvalidRequest
from gateway.tag_names import MAX_TAG_LENGTH, check_tag, parent_key
from gateway.web.task_ids import MAX_LENGTH as MAX_TASK_ID
from gateway.web.wire import message_cursor


@dataclass(frozen=True, slots=True)
class TagMessage:
    kind: str  # subscribe | unsubscribe
    tag: str
    token: str | None = None
    # Task id -> the last version the client saw of it (every task it knows).
    cursors: dict[str, int] = field(default_factory=dict)
    # Task id -> the epoch of the history that version is of, for the cursors sent as ``V:E``.
    epochs: dict[str, str] = field(default_factory=dict)


def tag_of(message: dict[str, Any]) -> str | None:
    """The tag a message is about, once it is known to be one (for the error frame that answers it)."""
    tag = message.get("tag")
    return tag if isinstance(tag, str) and len(tag) <= MAX_TAG_LENGTH else None


def parent_of_message(message: dict[str, Any]) -> str | None:
    """The parent a message follows the batch of, once it is known to be one (for its error frame)."""
    parent = message.get("parent")
    return parent if isinstance(parent, str) and len(parent) <= MAX_TASK_ID else None


def tag_message(kind: str, message: dict[str, Any], max_cursors: int) -> TagMessage:
    """A ``subscribe`` or ``unsubscribe`` message that names a ``tag``, or a ``parent`` (a batch: its
    ``tag`` is then the parent's key, ``gateway.tag_names.parent_key``); at most ``max_cursors`` cursors
    (GATEWAY_TAG_SUBSCRIPTION_MAX)."""
    if "taskId" in message and "tag" in message:
        raise InvalidRequest("a message names a taskId or a tag, not both")
    if "parent" in message and ("taskId" in message or "tag" in message):
        raise InvalidRequest("a message names a taskId, a tag or a parent: one of them")
    if "parent" in message:
        parent = message["parent"]
        if not isinstance(parent, str) or not 1 <= len(parent) <= MAX_TASK_ID:
            raise InvalidRequest(f"parent: must be a task id (a string of 1 to {MAX_TASK_ID} characters)")
        tag = parent_key(parent)
    else:
        tag = check_tag(message.get("tag"))
    if kind == "unsubscribe":
        return TagMessage(kind, tag)
    token = message.get("token")
    if token is not None and not isinstance(token, str):
        raise InvalidRequest("token: must be a string")
    cursors = message.get("cursors", {})
    if not isinstance(cursors, dict):
        raise InvalidRequest("cursors: must be an object of task id -> the last version seen of it")
    if len(cursors) > max_cursors:
        raise InvalidRequest(
            f"cursors: at most {max_cursors} tasks (GATEWAY_TAG_SUBSCRIPTION_MAX), got {len(cursors)}"
        )
    versions: dict[str, int] = {}
    epochs: dict[str, str] = {}
    for task_id, cursor in cursors.items():
        versions[task_id], epoch = message_cursor(cursor, f"cursors[{task_id[:40]!r}]")
        if epoch is not None:
            epochs[task_id] = epoch
    return TagMessage(kind, tag, token, versions, epochs)
