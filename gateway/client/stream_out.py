"""A worker's output to one of its task's streams (protocol.md, Streams), pure: what ``write(name, text)``
keeps, when it is sent, as which batch, and what the gateway's answer means. ``Worker`` (``SyncWorker``
through it) and the queue integrations' sender (``gateway.integrations.run_protocol``) both decide here.

Buffered: a write's text is cut into chunks (each at most 64 KiB of UTF-8, cut between characters) and
kept; the buffer is due :data:`FLUSH_S` after its oldest chunk was written, or at once once it holds
:data:`FLUSH_BYTES`. A due buffer's chunks become one append (a :class:`Batch`: at most :data:`MAX_CHUNKS`
chunks and a body of at most :data:`MAX_BODY_BYTES`; what is left goes in the next). One batch is on its
way at a time; until it is answered it is sent again as it is, with the same ``seq`` (an answer lost: the
gateway takes it once and answers the retry ``"duplicate": true``, which is success too). Batches are
numbered 0, 1, 2... in each attempt: a worker that runs a new attempt (it took its task back) numbers them
from 0 again, the batch on its way included.

Times are the caller's (``now``, on a monotonic clock): this module reads no clock.
"""

from __future__ import annotations

import json
import math
import re
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

# A chunk is at most this many bytes of UTF-8 (the gateway's limit).
MAX_CHUNK_BYTES: Final = 64 * 1024
# An append holds at most this many chunks, in a body of at most this many bytes (the gateway's limits).
MAX_CHUNKS: Final = 1_000
MAX_BODY_BYTES: Final = 1024 * 1024
# Room in a body for what is not chunks: ``{"attempt":A,"seq":S,"chunks":[]}`` with 19-digit numbers.
BODY_FRAME_BYTES: Final = 80
# A buffer is sent this long after its oldest chunk was written, or at once when it holds FLUSH_BYTES.
FLUSH_S: Final = 0.05
FLUSH_BYTES: Final = 64 * 1024
# A stream's name (protocol.md: 1 to 32 characters of a-z 0-9 _ -).
_NAME = re.compile(r"[a-z0-9_-]{1,32}")
# The 409 codes that say the writer's attempt is over.
ATTEMPT_OVER: Final = frozenset({"stale-attempt", "not-running"})


def check_name(name: str) -> str:
    """``name`` when it is a stream's name, else ``ValueError`` (the gateway would refuse it: 400)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"a stream's name is 1 to 32 characters of a-z 0-9 _ -, not {name!r}")
    return name


def chunks_of(text: str) -> list[tuple[str, int]]:
    """``text`` cut into chunks of at most :data:`MAX_CHUNK_BYTES` of UTF-8, each cut between two
    characters, with their sizes in bytes; ``[]`` for ``""`` (a chunk is at least a byte). A lone
    surrogate cannot be UTF-8: it raises ``UnicodeEncodeError`` here rather than be refused by the gateway."""
    data = text.encode()
    if len(data) <= MAX_CHUNK_BYTES:
        return [(text, len(data))] if data else []
    cut: list[tuple[str, int]] = []
    start = 0
    while start < len(data):
        end = min(start + MAX_CHUNK_BYTES, len(data))
        while end < len(data) and data[end] & 0xC0 == 0x80:  # a continuation byte: not between characters
            end -= 1
        cut.append((data[start:end].decode(), end - start))
        start = end
    return cut


def body_bytes(chunk: str) -> int:
    """What ``chunk`` takes of an append's body (its JSON string, as httpx and ``fetch`` send it: UTF-8,
    not escaped to ASCII), and the comma after it."""
    return len(json.dumps(chunk, ensure_ascii=False).encode()) + 1


@dataclass(frozen=True)
class Batch:
    """One append: ``chunks`` to the stream ``name`` as ``attempt``'s batch number ``seq``."""

    name: str
    attempt: int
    seq: int
    chunks: tuple[str, ...]

    def body(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "seq": self.seq, "chunks": list(self.chunks)}


@dataclass(frozen=True)
class Taken:
    """The batch was appended (or had been: a duplicate); the next one follows."""

    duplicate: bool


@dataclass(frozen=True)
class Again:
    """Send the batch again now, as ``seq`` (the gateway expects it: ``409 seq-gap``)."""

    seq: int


@dataclass(frozen=True)
class Over:
    """The writer's attempt is over (``409 stale-attempt`` / ``not-running``, with the task when the answer
    carries it). The batch stays: sent again as the new attempt's if the worker takes its task back."""

    code: str
    message: str
    task: dict[str, Any] | None


@dataclass(frozen=True)
class Refused:
    """The gateway refused the batch for good (``413 stream-full``, ``409 too-many-streams``, ``seq-reused``,
    a 4xx): it is dropped."""

    status: int
    code: str
    message: str


Verdict = Taken | Again | Over | Refused


class StreamOut:
    """What a worker has written to the stream ``name`` and not had taken yet. ``limit_bytes``: the most
    of its text it holds unsent (``None``: no bound; the ``Worker`` waits instead, :meth:`full`); past it a
    write is dropped whole, and :meth:`write` says so."""

    def __init__(self, name: str, *, limit_bytes: int | None = None) -> None:
        self.name = check_name(name)
        self.limit_bytes = limit_bytes
        self.attempt: int | None = None  # the attempt the batches are numbered in
        self.seq = 0  # the next batch's number in that attempt
        self.inflight: Batch | None = None  # sent, not answered yet
        self._chunks: deque[tuple[str, int, int]] = deque()  # (chunk, its UTF-8 bytes, its body bytes)
        self.buffered_bytes = 0  # UTF-8 bytes of the chunks kept, not in a batch yet
        self.since: float | None = None  # when the oldest of them was written

    def __repr__(self) -> str:
        return f"<StreamOut {self.name} attempt {self.attempt} seq {self.seq}>"

    # --- the writer's side ----------------------------------------------------------------------------------

    def write(self, text: str, now: float) -> bool:
        """Keep ``text`` to send (nothing for ``""``); false when it was dropped (past ``limit_bytes``)."""
        cut = chunks_of(text)
        size = sum(chunk_bytes for _, chunk_bytes in cut)
        if self.limit_bytes is not None and self.buffered_bytes + size > self.limit_bytes:
            return False
        for chunk, chunk_bytes in cut:
            self._chunks.append((chunk, chunk_bytes, body_bytes(chunk)))
        if cut:
            self.buffered_bytes += size
            if self.since is None:
                self.since = now
        return True

    def full(self) -> bool:
        """It holds :data:`FLUSH_BYTES` unsent: a ``Worker``'s write waits for them to be sent."""
        return self.buffered_bytes >= FLUSH_BYTES

    def empty(self) -> bool:
        """Nothing kept and nothing on its way."""
        return self.inflight is None and not self._chunks

    def unsent_chunks(self) -> int:
        return len(self._chunks) + (len(self.inflight.chunks) if self.inflight else 0)

    # --- the sender's side ----------------------------------------------------------------------------------

    def due(self, now: float, *, flush: bool = False) -> float | None:
        """When the next batch goes (``now`` or later); ``None`` when there is nothing to send. ``flush``:
        everything kept goes now (before the attempt's outcome, or asked for)."""
        if self.inflight is not None:
            return now
        if self.since is None:
            return None
        if flush or self.full():
            return now
        return max(now, self.since + FLUSH_S)

    def take(self, attempt: int, now: float, *, flush: bool = False) -> Batch | float | None:
        """The batch to send now as ``attempt`` (the one on its way, again, when there is one), else when one
        will be due, else ``None``. A new attempt numbers its batches from 0, the one on its way too."""
        if attempt != self.attempt:
            self.attempt, self.seq = attempt, 0
            if self.inflight is not None:
                self.inflight = replace(self.inflight, attempt=attempt, seq=0)
        due = self.due(now, flush=flush)
        if due is None or due > now:
            return due
        if self.inflight is None:
            self.inflight = Batch(self.name, attempt, self.seq, self._cut())
        return self.inflight

    def _cut(self) -> tuple[str, ...]:
        """The kept chunks that fit one append, oldest first (at least one: any chunk fits a body)."""
        taken: list[str] = []
        room = MAX_BODY_BYTES - BODY_FRAME_BYTES
        while self._chunks and len(taken) < MAX_CHUNKS and self._chunks[0][2] <= room:
            chunk, size, encoded = self._chunks.popleft()
            taken.append(chunk)
            room -= encoded
            self.buffered_bytes -= size
        self.since = self.since if self._chunks else None
        return tuple(taken)

    def answered(self, batch: Batch, status: int, body: dict[str, Any]) -> Verdict:
        """What the gateway's answer to ``batch`` (an answer not to be tried again: not a 5xx or a 429)
        means, and its effect here."""
        if batch is not self.inflight:  # a new attempt renumbered it meanwhile: that one is sent instead
            return Again(self.seq)
        error = body.get("error")
        error = error if isinstance(error, dict) else {}
        code, message = str(error.get("code", f"http-{status}")), str(error.get("message", ""))
        if status < 300:
            self.inflight = None
            self.seq += 1
            return Taken(bool(body.get("duplicate")))
        if status == 409 and code in ATTEMPT_OVER:
            task = body.get("task")
            return Over(code, message, task if isinstance(task, dict) else None)
        expected = body.get("expectedSeq")
        if status == 409 and code == "seq-gap" and isinstance(expected, int) and expected < batch.seq:
            # A batch numbered before this one is not there (another writer of the attempt, a worker that
            # took it over, counted them otherwise): this one takes its number.
            self.seq = expected
            self.inflight = replace(batch, seq=expected)
            return Again(expected)
        self.inflight = None
        return Refused(status, code, message)

    # --- another process takes over -------------------------------------------------------------------------

    def pending(self) -> dict[str, Any]:
        """What it holds, JSON-able, for another process to send (:meth:`resume`)."""
        inflight = self.inflight
        return {
            "name": self.name,
            "attempt": self.attempt,
            "seq": self.seq,
            "inflight": None if inflight is None else [inflight.attempt, inflight.seq, list(inflight.chunks)],
            "chunks": [chunk for chunk, _, _ in self._chunks],
        }

    @classmethod
    def resume(cls, pending: Mapping[str, Any], *, limit_bytes: int | None = None) -> StreamOut:
        """The stream as :meth:`pending` left it, in another process (its kept chunks due at once)."""
        out = cls(str(pending["name"]), limit_bytes=limit_bytes)
        out.attempt, out.seq = pending.get("attempt"), int(pending.get("seq") or 0)
        inflight = pending.get("inflight")
        if inflight is not None:
            attempt, seq, chunks = inflight
            out.inflight = Batch(out.name, int(attempt), int(seq), tuple(chunks))
        for chunk in pending.get("chunks") or ():
            size = len(chunk.encode())
            out._chunks.append((chunk, size, body_bytes(chunk)))
            out.buffered_bytes += size
        out.since = -math.inf if out._chunks else None
        return out
