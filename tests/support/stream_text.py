"""What a client holds of a task's streams (protocol.md, Live: chunks and end), fed the frames it receives in
order, checking the promises frame by frame: per stream, a ``chunks`` frame of the attempt held continues
the text at the next offset (none missing, none repeated), any other starts it over and is of a later
attempt (a retry's output replaces; no earlier attempt's chunk after a later one's), every chunk goes
before the terminal ``event`` frame that follows it, and an ``end`` frame, after that frame, at the offset
the client holds. Used by the live tests and the streams' chaos test, which resume with :attr:`offsets`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TERMINAL = ("succeeded", "failed", "expired")


@dataclass
class Held:
    """One stream as the client holds it."""

    next: int
    attempt: int = 0
    chunks: list[str] = field(default_factory=list)
    ended: int | None = None
    # Frames that started the text over, and the attempts they were of.
    restarts: list[int] = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.chunks)


class StreamText:
    """The streams of one task subscription, resumed from :attr:`offsets` after a drop."""

    def __init__(self, task_id: str, offsets: Mapping[str, int]) -> None:
        self.task_id = task_id
        self.streams = {name: Held(offset) for name, offset in offsets.items()}
        # The terminal event was received (no chunk may follow), or a resume frame of an ended task (its
        # streams' chunks follow it, then their ends).
        self.terminal_event = False
        self.ended_task = False
        self.frames = 0  # chunks frames received

    @property
    def offsets(self) -> dict[str, int]:
        """The offsets to resume from: the next one held of each stream."""
        return {name: held.next for name, held in self.streams.items()}

    @property
    def texts(self) -> dict[str, str]:
        return {name: held.text for name, held in self.streams.items()}

    @property
    def ended(self) -> bool:
        return all(held.ended is not None for held in self.streams.values())

    def resubscribed(self) -> None:
        """A new subscription (after a drop) from :attr:`offsets`: a resume frame comes first again."""
        self.ended_task = self.terminal_event = False

    def feed(self, frame: Mapping[str, Any]) -> None:
        kind = frame["type"]
        if kind == "chunks":
            self._chunks(frame)
        elif kind == "end":
            assert frame["taskId"] == self.task_id, frame
            held = self.streams[frame["stream"]]
            assert self.ended_task, f"an end before the task's terminal frame: {frame}"
            # At the offset the client holds; or, of a stream it was sent nothing of, from an offset past the
            # stream's end (one the task never made ends at 0).
            assert frame["offset"] == held.next or (not held.chunks and frame["offset"] < held.next), (
                f"end at {frame['offset']}, the client holds {held.next}"
            )
            held.ended = held.next = frame["offset"]
        elif kind in ("event", "snapshot", "delta", "caught-up") and frame.get("taskId") == self.task_id:
            if kind == "snapshot" and frame.get("reason") == "recreated":
                for held in self.streams.values():
                    held.next = 0
            if frame["task"]["state"] in TERMINAL:
                self.ended_task = True
                self.terminal_event = kind == "event"

    def _chunks(self, frame: Mapping[str, Any]) -> None:
        assert frame["taskId"] == self.task_id, frame
        assert set(frame) == {"type", "taskId", "stream", "attempt", "offset", "chunks"}, frame
        held = self.streams[frame["stream"]]
        assert held.ended is None, f"chunks after the stream's end: {frame}"
        assert not self.terminal_event, f"chunks after the task's terminal event frame: {frame}"
        chunks = frame["chunks"]
        assert chunks and all(isinstance(c, str) and c for c in chunks), frame
        self.frames += 1
        if frame["attempt"] == held.attempt and frame["offset"] == held.next:
            held.chunks.extend(chunks)
        else:
            assert frame["attempt"] > held.attempt or not held.chunks, (
                f"stream {frame['stream']}: a frame of attempt {frame['attempt']} at {frame['offset']} while "
                f"the client holds attempt {held.attempt} up to {held.next}: a gap, a repeat or an earlier "
                "attempt's chunks"
            )
            held.attempt = frame["attempt"]
            held.chunks = list(chunks)
            held.restarts.append(frame["attempt"])
        held.next = frame["offset"] + len(chunks)
