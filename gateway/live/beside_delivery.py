"""The hub's side of the state beside the history (``gateway.live.beside``): a change heard on the bus handed
to every subscription of its task on this process, straight to the socket where nothing else of the
connection waits (framed once for every socket alike), else to the connection's writer, merged; a bare
wake-up's state read from the store; and the periodic check of each channel's revision against the store's,
which finds a change whose message was lost.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, TypeVar

from gateway.errors import GatewayError
from gateway.frames import Beside, text_frame
from gateway.live.beside import BesideOut
from gateway.live.fanout import Fanout
from gateway.live.streaming import Handle
from gateway.machine import Task

__all__ = ["BesideStore", "check_besides", "deliver_beside", "read_beside"]

# The tasks of one query of the check.
CHECK_CHUNK = 1000

H = TypeVar("H", bound=Handle)


class BesideStore(Protocol):
    """The reads this makes (``gateway.book.metadata.MetadataBook`` has them)."""

    async def get(self, task_id: str) -> Task: ...

    async def revisions_ahead(self, known: Mapping[str, int]) -> dict[str, int]: ...


def deliver_beside(fanout: Fanout[H], state: Beside) -> int:
    """A change beside the history of ``state``'s task (not a bare wake-up) to each subscription of the task
    here; how many went straight to a socket."""
    channel = fanout.channels.get(state.task_id)
    if channel is None:
        return 0
    channel.revision = max(channel.revision, state.revision)
    wires: dict[tuple[str, ...], bytes] = {}  # the frames' bytes, by which frames (the same for every socket)
    direct = 0
    for sub in channel.subscriptions:
        out = sub.beside
        if out is None:
            out = sub.beside = BesideOut()
        last = sub.last
        if not sub.active or not out.offer(state, last):
            continue
        peer = sub.peer
        if last is None or last.terminal or peer.close_code is not None:
            continue  # its resume frame goes first (its turn sends it); a terminal frame ends its stream
        writer = peer.handle.writer
        if (
            writer is not None
            and peer.direct
            and peer.quiet()
            and not (sub.head or sub.pending or sub.conflated)
        ):
            frames = out.frames(last)
            key = tuple(frame.type for frame in frames)
            data = wires.get(key)
            if data is None:
                data = wires[key] = b"".join(text_frame(frame.text.encode()) for frame in frames)
            if not data or writer.can_write(len(data)):
                if data:
                    writer.write(data)
                    direct += 1
                out.sent_now()
                continue
        if peer.wake(sub):
            peer.handle.signal()
    return direct


async def read_beside(fanout: Fanout[H], store: BesideStore, task_id: str) -> int:
    """The state beside the history of a task, read from the store (a bare wake-up, or found behind by the
    check), to its subscriptions here."""
    if task_id not in fanout.channels:
        return 0
    try:
        task = await store.get(task_id)
    except GatewayError:  # gone: nothing to hand out
        return 0
    return deliver_beside(fanout, Beside.of(task))


async def check_besides(fanout: Fanout[H], store: BesideStore) -> int:
    """Compare each channel's revision (the newer of the state beside the history it handed out and its
    last entry's task's) with the store's, in one query per chunk of tasks; a channel behind reads its
    task's state. A channel with no state yet is left to its subscriptions' resume reads."""
    channels = fanout.channels.items()
    known = {t: max(c.revision, c.last.revision) for t, c in channels if c.last is not None}
    ids = list(known)
    direct = 0
    for start in range(0, len(ids), CHECK_CHUNK):
        ahead = await store.revisions_ahead({i: known[i] for i in ids[start : start + CHECK_CHUNK]})
        for task_id in ahead:
            direct += await read_beside(fanout, store, task_id)
    return direct
