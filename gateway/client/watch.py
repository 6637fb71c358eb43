"""``watch`` and ``watch_tag``: live frames of tasks over one ``/v1/ws`` socket that heals itself
(``link.py``: reconnects with backoff and jitter, replaces a silently dead link, says what goes wrong once).

``watch`` follows the tasks it is given: it resumes every subscription from its cursor after a drop (the
version it holds with the epoch of that task's history, so that a task made again under a deleted one's
id comes as a ``snapshot``, never as the old one's next versions), checks that each ``event`` frame is
``version == last + 1`` and resubscribes from ``last`` when it is not, and ends once every watched task is
terminal. Given ``streams``, it also yields each task's ``chunks`` and ``end`` frames of those streams
(docs/protocol.md, "Streams"), resumes each stream from the offset after its last chunk yielded, and ends
a task once its streams' ``end`` frames have come too. ``watch_tag`` follows every task carrying a tag,
those there are and those created later, with a cursor per task (``tag_follow.py``); it ends only when its
caller stops. Both also yield each task's ``metadata`` and ``children`` frames (protocol.md: its live
metadata, a batch's counts), none older than the ``revision`` already yielded (``revisions.py``). What they
yield is exactly what the server sent, so a caller can apply frames in order and
hold the exact task state.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, MutableMapping
from typing import Any

import anyio
import orjson
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed

from gateway.client.backoff import Backoff
from gateway.client.errors import WatchError
from gateway.client.link import LinkStatus, linked, log_status, ws_url
from gateway.client.revisions import LIVE_TYPES, Revisions
from gateway.client.tag_follow import TagFollower, Then, cursor_of

__all__ = ["LinkStatus", "WatchError", "log_status", "watch", "watch_tag", "ws_url"]

TERMINAL = frozenset({"succeeded", "failed", "expired"})
RESUME_TYPES = frozenset({"caught-up", "delta", "snapshot"})
# Error codes that retrying cannot cure.
FATAL = frozenset({"unauthorized", "forbidden", "unknown-task", "invalid-request"})
CLOSE_TOO_BIG = 1009  # a message over the gateway's limit


async def watch(
    base_url: str,
    tokens: Mapping[str, str | None],
    *,
    cursors: Mapping[str, int] | None = None,
    epochs: Mapping[str, str] | None = None,
    backoff: Backoff | None = None,
    max_reconnects: int | None = None,
    heartbeat_s: float = 3.0,
    deadline_s: float = 3.0,
    on_status: Callable[[LinkStatus], None] | None = log_status,
    streams: Mapping[str, Mapping[str, int]] | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    """Yield the frames of the tasks in ``tokens`` (task id -> subscribe token) until all are terminal.

    ``cursors`` holds the versions already seen (default 0), ``epochs`` the epoch of the task each was seen
    in (its ``task["epoch"]``; without one a version is taken as one of the task the id names now).
    ``streams`` names, per task id, the streams to follow with the offset to start each from (0: all of its
    text); a ``chunks`` frame whose ``offset`` is not the next one of the attempt held starts the text over
    (a retry's output, or the stream sent from its attempt's first chunk). Raises
    :class:`WatchError` on an error the server will not change its mind about (bad token, unknown task), or
    after ``max_reconnects`` drops. ``on_status`` hears of each change in the link (None: silence).
    """
    cursor = {task_id: (cursors or {}).get(task_id, 0) for task_id in tokens}
    epoch = {task_id: e for task_id, e in (epochs or {}).items() if task_id in cursor}
    # Per task, each stream still open -> the offset to resume it from.
    offsets = {task_id: dict((streams or {}).get(task_id, {})) for task_id in tokens}
    ended: set[str] = set()  # tasks whose terminal frame was yielded (their streams' end may be to come)
    done: set[str] = set()  # tasks with nothing more to yield
    revisions = Revisions()  # of each task's metadata and children, as yielded
    backoff = backoff or Backoff()

    def subscribe(task_id: str) -> str:
        return _subscribe(task_id, cursor[task_id], epoch.get(task_id), tokens[task_id], offsets[task_id])

    async def session(ws: ClientConnection) -> AsyncIterator[dict[str, Any]]:
        awaiting: set[str] = set()  # subscriptions whose resume frame has not come yet
        for task_id in cursor:
            if task_id not in done:
                awaiting.add(task_id)
                await ws.send(subscribe(task_id))
        async for raw in ws:
            frame = orjson.loads(raw)
            kind, task_id = frame.get("type"), frame.get("taskId")
            if kind == "error":
                if frame.get("code") in FATAL:
                    raise WatchError(frame["code"], frame.get("message", ""), task_id)
                continue
            if task_id not in cursor or task_id in done:
                continue
            if kind in LIVE_TYPES:
                if task_id not in ended and revisions.take(frame):
                    yield frame
                continue
            if kind in ("chunks", "end"):
                # Before a resubscription's resume frame, the earlier subscription's: the new one sends the
                # stream again from the offset it was sent with.
                if task_id in awaiting or frame.get("stream") not in offsets[task_id]:
                    continue
                if kind == "end":
                    del offsets[task_id][frame["stream"]]
                    if task_id in ended and not offsets[task_id]:
                        done.add(task_id)
                else:
                    offsets[task_id][frame["stream"]] = frame["offset"] + len(frame["chunks"])
                yield frame
                continue
            if kind in RESUME_TYPES:
                if task_id not in awaiting and kind != "snapshot":
                    continue
                awaiting.discard(task_id)
                backoff.reset()
                if task_id in ended:
                    continue  # resumed for its streams alone: its end was yielded
            elif kind == "event":
                if task_id in awaiting or task_id in ended:
                    continue  # from before a resubscribe; the new resume frame covers it
                if frame["version"] != cursor[task_id] + 1:
                    # A gap: ask again from what we hold.
                    awaiting.add(task_id)
                    await ws.send(subscribe(task_id))
                    continue
            else:
                continue
            cursor[task_id] = frame["version"]
            revisions.task(task_id, frame["task"])
            held = frame["task"].get("epoch")
            if isinstance(held, str):  # a snapshot of a task made again under the id brings its own
                epoch[task_id] = held
            if frame["task"]["state"] in TERMINAL:
                ended.add(task_id)
                if not offsets[task_id]:
                    done.add(task_id)
            yield frame

    async for frame in linked(
        base_url,
        session,
        finished=lambda: len(done) == len(cursor),
        backoff=backoff,
        max_reconnects=max_reconnects,
        heartbeat_s=heartbeat_s,
        deadline_s=deadline_s,
        on_status=on_status,
    ):
        yield frame


async def watch_tag(
    base_url: str,
    tag: str,
    token: str | None = None,
    *,
    cursors: MutableMapping[str, int] | None = None,
    epochs: MutableMapping[str, str] | None = None,
    backoff: Backoff | None = None,
    max_reconnects: int | None = None,
    heartbeat_s: float = 3.0,
    deadline_s: float = 3.0,
    on_status: Callable[[LinkStatus], None] | None = log_status,
) -> AsyncGenerator[dict[str, Any], None]:
    """Yield the frames of every task carrying ``tag``, with ``token`` a tag token for it (``POST
    /v1/tokens``; ``None`` where the gateway runs open), until the caller stops.

    First a ``tag`` frame (the tag's task ids, newest first), then each task's resume frame, then their
    ``event`` frames, per task in order with no gap and no repeat; a task created with the tag later comes
    as an ``added`` frame then its ``snapshot`` (``reason: "new"``) and events. After a drop it subscribes
    again with its cursors map (task id -> last version yielded, every task it knows, finished ones too,
    each with the epoch of its task's history): each task resumes where it was, and tasks created meanwhile
    come as ``snapshot``s (a task made again under the id of one it knew: ``added``, then its ``snapshot``).
    ``cursors`` is that map and ``epochs`` the epochs: pass your own dicts to start from them (versions
    already seen) and to keep them up to date for a later run. Raises :class:`WatchError` on a refusal
    retrying cannot cure (a bad or expired token, a token for another tag), or after ``max_reconnects``
    drops.
    """
    follower = TagFollower(tag, token, cursors, epochs)
    backoff = backoff or Backoff()

    async def session(ws: ClientConnection) -> AsyncIterator[dict[str, Any]]:
        authorized = False  # the socket answered the subscription: it takes bigger messages
        await ws.send(follower.subscribe_message())
        try:
            async for raw in ws:
                shown, then = follower.take(orjson.loads(raw))
                if then is Then.SUBSCRIBE:
                    await ws.send(follower.subscribe_message(authorized=authorized))
                elif then is Then.RETRY_LATER:
                    await anyio.sleep(backoff.next_delay())
                    await ws.send(follower.subscribe_message(authorized=authorized))
                if shown is not None:
                    if shown["type"] == "tag":
                        authorized = True
                        backoff.reset()
                    yield shown
        except ConnectionClosed as exc:
            if exc.rcvd is not None and exc.rcvd.code == CLOSE_TOO_BIG:
                follower.too_big()
            raise

    async for frame in linked(
        base_url,
        session,
        finished=lambda: False,
        backoff=backoff,
        max_reconnects=max_reconnects,
        heartbeat_s=heartbeat_s,
        deadline_s=deadline_s,
        on_status=on_status,
    ):
        yield frame


def _subscribe(
    task_id: str, cursor: int, epoch: str | None, token: str | None, streams: Mapping[str, int]
) -> str:
    message: dict[str, Any] = {"type": "subscribe", "taskId": task_id, "cursor": cursor_of(cursor, epoch)}
    if token is not None:
        message["token"] = token
    if streams:
        message["streams"] = dict(streams)
    return orjson.dumps(message).decode()
