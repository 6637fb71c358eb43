"""A task's streams (protocol.md, Streams): what an append and a read decide. Pure: no I/O, no clock.

A stream is a sequence of chunks at offsets counted over the task's whole life. The store keeps it as one
row of running totals, its :class:`Head` (so that neither an append nor a read scans it), and one row per
appended :class:`Batch`, its chunks together as the JSON array the wire carries (encoded once, on the way
in, and sent as it is stored). Every stored batch is of the head's attempt: the first append of an attempt
drops the earlier attempt's batches in its transaction (no read or subscription may send them again), so
that a stream holds at most ``GATEWAY_STREAM_MAX_BYTES`` whatever its retries. So a stream's batches are its
attempt's, every one of them, in ``seq`` order: batch ``seq`` is the ``seq``-th, and no row keeps its seq.

An append is decided in protocol.md's order: the attempt fenced (``stale-attempt``, ``not-running``), then
its ``seq`` against the batches the attempt has appended (taken, a duplicate answered as the first time,
``seq-reused``, ``seq-gap``), then room (``too-many-streams``, ``stream-full``). A retried ``seq`` is told
from a reused one by the chunks stored under it, which the store reads (:class:`Lookup`: the last batch at
the offset its head keeps, an earlier one by its place): a read on the retry path only, and no digest kept
in every row. A read starts where :func:`read_start` says and is cut into pages by :func:`page_of`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import orjson

from gateway.errors import Conflict, InvalidRequest, PayloadTooLarge
from gateway.lease import fence, heartbeat
from gateway.machine import Task

MAX_STREAMS: Final = 8
# A stream's text at most, unless the settings say otherwise (GATEWAY_STREAM_MAX_BYTES).
MAX_STREAM_BYTES: Final = 16 * 1024 * 1024
NAME_PATTERN: Final = "^[a-z0-9_-]{1,32}$"
_NAME = re.compile(NAME_PATTERN[1:-1])
MAX_CHUNK_BYTES: Final = 64 * 1024
MAX_CHUNKS: Final = 1_000
# An append's body as sent, at most (whatever GATEWAY_MAX_BODY_BYTES says): its chunks are no more.
MAX_APPEND_BYTES: Final = 1024 * 1024
# A seq and an offset are at most what a JavaScript client holds exactly.
MAX_SEQ: Final = 2**53 - 1
MAX_OFFSET: Final = 2**53 - 1
# A page of a read (and a live chunks frame) holds at most this many bytes of chunks, or a single chunk.
PAGE_BYTES: Final = 1024 * 1024
DEFAULT_PAGE_CHUNKS: Final = 1_000
MAX_PAGE_CHUNKS: Final = 10_000


def check_name(name: str, field: str = "stream") -> str:
    """``name`` when it is a stream's name, else ``400 invalid-request`` naming ``field``."""
    if not _NAME.fullmatch(name):
        raise InvalidRequest(
            f"{field}: a stream's name is 1 to 32 characters of a-z 0-9 _ -, got {name[:40]!r}"
        )
    return name


@dataclass(frozen=True, slots=True)
class Chunks:
    """The chunks of one append, as stored: the JSON array the wire carries, their number and their size in
    UTF-8. ``encoded`` is canonical: two appends with the same chunks encode them the same, whatever their
    escaping in the body that carried them (a retry is told by it: :func:`duplicate`)."""

    encoded: bytes
    count: int
    size: int

    @classmethod
    def of(cls, chunks: object) -> Chunks:
        """An append's ``chunks`` as parsed from its JSON body, checked: 1 to ``MAX_CHUNKS`` strings of 1
        byte to ``MAX_CHUNK_BYTES`` in UTF-8 each; else ``400 invalid-request`` naming the chunk."""
        if not isinstance(chunks, list) or not 1 <= len(chunks) <= MAX_CHUNKS:
            raise InvalidRequest(f"chunks: must be an array of 1 to {MAX_CHUNKS} strings")
        size = 0
        for i, chunk in enumerate(chunks):
            if not isinstance(chunk, str):
                raise InvalidRequest(f"chunks[{i}]: must be a string")
            length = len(chunk.encode())
            if not 1 <= length <= MAX_CHUNK_BYTES:
                raise InvalidRequest(
                    f"chunks[{i}]: must be 1 to {MAX_CHUNK_BYTES} bytes in UTF-8, got {length}"
                )
            size += length
        return cls(orjson.dumps(chunks), len(chunks), size)


@dataclass(frozen=True, slots=True)
class Head:
    """A stream's running totals, as its row keeps them."""

    name: str
    # The attempt of its last append: its text is that attempt's chunks.
    attempt: int
    # The offset of that attempt's first chunk, and the one after its last chunk.
    first_offset: int
    next_offset: int
    # That attempt's chunks' size in UTF-8 (the text's), and how many batches it appended (the seq next).
    size: int
    next_seq: int
    # Where the attempt's last batch starts (a retry of it reads that batch alone).
    last_offset: int


@dataclass(frozen=True, slots=True)
class Batch:
    """One appended batch as stored: its chunks at offsets ``offset`` to ``offset + count - 1``. Its seq is
    its place among the stream's batches (above)."""

    offset: int
    count: int
    attempt: int
    size: int
    chunks: bytes


@dataclass(frozen=True, slots=True)
class Append:
    """An append asked of ``stream`` by the worker of ``attempt``."""

    stream: str
    attempt: int
    seq: int
    chunks: Chunks


@dataclass(frozen=True, slots=True)
class Appended:
    """An append's answer (protocol.md): its chunks' offsets; ``duplicate`` when appended before."""

    stream: str
    attempt: int
    offset: int
    next_offset: int
    duplicate: bool


@dataclass(frozen=True, slots=True)
class Take:
    """An append taken: the head after it and the batch to store. ``replaces``: it is its attempt's first
    on a stream an earlier attempt wrote, whose batches (those before ``head.first_offset``) are dropped."""

    head: Head
    batch: Batch
    replaces: bool

    @property
    def answer(self) -> Appended:
        batch = self.batch
        return Appended(self.head.name, batch.attempt, batch.offset, batch.offset + batch.count, False)


@dataclass(frozen=True, slots=True)
class Lookup:
    """The answer needs the stored batch ``seq`` of the stream's attempt (a retry): read it and pass it to
    :func:`duplicate`. ``offset``: where it starts, when the head knows it (the attempt's last batch: one
    probe of the stream's key), else ``None`` (an earlier batch, the ``seq``-th of the stream's)."""

    seq: int
    offset: int | None


def decide_append(
    task: Task, head: Head | None, append: Append, *, streams: int, max_bytes: int
) -> Take | Lookup:
    """What an append does to a stream (``head``: ``None`` for a stream not made yet) of ``task``, which has
    ``streams`` streams: taken, or a read first (a retry); else the error that refuses it."""
    fence(task, append.attempt)
    heartbeat(task)  # 409 not-running with the task, as a heartbeat's
    same = head is not None and head.attempt == append.attempt
    expected = head.next_seq if head is not None and same else 0
    if append.seq > expected:
        raise Conflict(
            "seq-gap",
            f"stream {append.stream}: seq {append.seq} of attempt {append.attempt} is past the next one, "
            f"{expected}: a batch before it is missing",
            extra={"expectedSeq": expected},
        )
    if append.seq < expected:
        assert head is not None
        return Lookup(append.seq, head.last_offset if append.seq == expected - 1 else None)
    if head is None and streams >= MAX_STREAMS:
        raise Conflict("too-many-streams", f"task {task.id} has {streams} streams, the most a task may have")
    chunks = append.chunks
    held = head.size if head is not None and same else 0
    if held + chunks.size > max_bytes:
        raise PayloadTooLarge(
            f"stream {append.stream} holds {held} bytes: {chunks.size} more would take it past its limit "
            f"of {max_bytes} (GATEWAY_STREAM_MAX_BYTES); nothing was appended",
            code="stream-full",
        )
    offset = head.next_offset if head is not None else 0
    first = head.first_offset if head is not None and same else offset
    batch = Batch(offset, chunks.count, append.attempt, chunks.size, chunks.encoded)
    after = Head(
        append.stream,
        append.attempt,
        first,
        offset + chunks.count,
        held + chunks.size,
        append.seq + 1,
        offset,
    )
    return Take(after, batch, replaces=head is not None and not same)


def duplicate(append: Append, batch: Batch) -> Appended:
    """A retried append's answer, given the batch stored under its ``seq`` (a :class:`Lookup`'s): the first
    answer again when its chunks are the same (their canonical arrays, :class:`Chunks`, equal the stored
    one), else ``409 seq-reused``."""
    if batch.chunks != append.chunks.encoded:
        raise Conflict(
            "seq-reused",
            f"stream {append.stream}: seq {append.seq} of attempt {append.attempt} was appended with other "
            "chunks",
        )
    return Appended(append.stream, append.attempt, batch.offset, batch.offset + batch.count, True)


# --- reads ------------------------------------------------------------------------------------------------


def read_start(head: Head | None, offset: int, *, same_history: bool = True) -> int:
    """Where a read or a subscription asked from ``offset`` starts: there, unless it is before the first
    chunk of the stream's attempt or past its end, or of another history of the task id (``same_history``
    false), where it starts at that first chunk (0 for a stream not made yet)."""
    if head is None:
        return 0
    if not same_history or not head.first_offset <= offset <= head.next_offset:
        return head.first_offset
    return offset


def rows_to_read(head: Head | None, limit: int, page_bytes: int = PAGE_BYTES) -> int:
    """How many batches to read at once for a page of ``limit`` chunks and ``page_bytes``, by the stream's
    average batch: enough for the page and one chunk past it in most cases, few past it; two at least (a
    read that goes on from a batch's end may find that batch again, and must find one more)."""
    if head is None or head.next_seq == 0:
        return 2
    chunks_per = max(1, (head.next_offset - head.first_offset) // head.next_seq)
    bytes_per = max(1, head.size // head.next_seq)
    # As many as the page and one chunk (or byte) past it need, plus one for a first batch the read starts
    # within: a stream of batches larger than the page reads two of them for a page, not three.
    by_bytes = -(-(page_bytes + 1) // bytes_per) + 1
    return max(2, min(limit + 1, -(-(limit + 1) // chunks_per) + 1, by_bytes))


@dataclass(frozen=True, slots=True)
class Page:
    """A read's answer: ``count`` chunks of ``attempt`` at ``offset``..., ``size`` bytes of them in UTF-8, as
    the JSON array the wire carries (``encoded``: spliced from the stored arrays, never decoded where whole
    batches make it); ``more`` when chunks follow them."""

    attempt: int
    offset: int
    encoded: bytes
    count: int
    size: int
    more: bool

    @property
    def chunks(self) -> list[str]:
        chunks: list[str] = orjson.loads(self.encoded)
        return chunks

    @property
    def next_offset(self) -> int:
        return self.offset + self.count


def page_of(
    start: int,
    batches: Sequence[Batch],
    *,
    attempt: int,
    limit: int,
    complete: bool,
    page_bytes: int = PAGE_BYTES,
) -> Page | None:
    """The page a read from ``start`` answers, given the batches read so far (in offset order, the one that
    holds ``start`` first, if any does); ``complete`` when they run to the stream's end. ``None`` when more
    batches are needed to know it (the page is not full, or whether chunks follow it is not known).

    The page holds the chunks of one attempt only: the batches of a read are not read at one instant, and
    an attempt that started meanwhile stops it there (its chunks follow, and its answer's offset says so).
    A page whose first batch is past ``start`` (an attempt started meanwhile, dropping the batches that
    held it) starts at that batch. ``attempt``: the page's when it has no chunk (the stream's).

    A batch the page takes whole is spliced into it as stored (its size is known: no chunk is decoded);
    only a batch the page starts within or is cut within is decoded, chunk by chunk."""
    parts: list[bytes] = []  # JSON arrays' insides, joined by commas
    offset, count, size, held_attempt = start, 0, 0, attempt
    for batch in batches:
        skip = 0
        if not count:
            held_attempt = batch.attempt
            offset = max(start, batch.offset)
            skip = offset - batch.offset
        elif batch.attempt != held_attempt:
            return Page(held_attempt, offset, _joined(parts), count, size, True)
        fits = size + batch.size <= page_bytes or (not count and batch.count == 1)
        if not skip and count + batch.count <= limit and fits:
            parts.append(batch.chunks[1:-1])
            count, size = count + batch.count, size + batch.size
            continue
        items: list[str] = orjson.loads(batch.chunks)[skip:]
        taken = 0
        for item in items:
            length = len(item.encode())
            if count == limit or (count and size + length > page_bytes):
                break
            count, size, taken = count + 1, size + length, taken + 1
        if taken:
            parts.append(orjson.dumps(items[:taken])[1:-1])
        if taken < len(items):
            return Page(held_attempt, offset, _joined(parts), count, size, True)
    if not complete:
        return None
    return Page(held_attempt, offset, _joined(parts), count, size, False)


def _joined(parts: Sequence[bytes]) -> bytes:
    return b"[" + b",".join(parts) + b"]"


def text_of(batches: Sequence[Batch]) -> str:
    """A stream's text: its batches' chunks joined (the batches of one attempt, in offset order)."""
    chunks: list[str] = orjson.loads(_joined([batch.chunks[1:-1] for batch in batches]))
    return "".join(chunks)
