"""Every statement the store runs, once: the reads and the writes, on SQLite and on PostgreSQL.

procrastinate keeps its statements in one file for the same reason: a statement is read where its
columns, its index and its lock can be seen together, and changed in one place. They are written in the
SQL both databases speak, with ``?`` placeholders, and run on each database's own driver with no
SQLAlchemy between (``gateway.store.transaction``): compiling Core statements cost a callback more CPU than
the driver did, and a read through Core was about a fifth as fast. The read path and the write
transactions run the same texts.

Where the databases differ, said here once:

- placeholders: asyncpg numbers them (``$1, $2...``), :func:`numbered` does, once per text;
- locks: a PostgreSQL write transaction locks the task rows it reads (``LOCK``) and claims due rows
  skipping those another transaction holds (``CLAIM``), so that processes sweeping, relaying or retaining
  together take different rows; a SQLite write transaction holds the whole file already, and appends nothing;
- lists of keys: SQLite's ``IN (?, ?, ...)`` in chunks of ``IN_CHUNK`` (its limit on parameters),
  PostgreSQL's ``= ANY(?)`` with one array (one text, so one prepared statement, whatever the list's
  length), except where a lock or a dedup lookup probes the primary key once per key
  (``PG_LOCK_TASKS``, ``PG_DIGESTS``, and why there);
- a batch's writes: SQLite runs each ``INSERT`` below once per row (an ``executemany``, which costs no
  round trip on the writer's thread), PostgreSQL sends them all as one statement (:func:`pg_batch`),
  ``NOTIFY`` included, which SQLite does not have;
- upserts: none on either. A key inserted twice is a unique violation, which the writers raise as
  ``StoreRace``: the book runs the transaction again, and it sees the winner's row.

Not here: transaction control (``BEGIN IMMEDIATE``, ``COMMIT``), which belongs to the code that holds the
connection (``sqlite_writer``, ``pg_writer``); a connection's PRAGMAs (``sqlite_writer.apply_pragmas``);
the schema, which Alembic's revisions spell out (``migrations/``, their lock in ``migrate.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from sqlalchemy import Table
from sqlalchemy.dialects import postgresql

from gateway.store.tables import (
    ACTIVE_STATES,
    INSERT_ONLY,
    LEASED,
    TASK_COLUMNS,
    UPDATED_COLUMNS,
    callbacks,
    entries,
    outbox,
    stream_batches,
    streams,
    tasks,
)

# ``IN (...)`` lists go in chunks of this size (SQLite's default limit is 32,766 parameters).
IN_CHUNK = 500
# The predicate of the partial index ix_tasks_live_deadline: a query that repeats it is answered from the
# index in O(rows wanted), whatever the table's size.
_LIVE = "state IN ({})".format(", ".join(f"'{s}'" for s in ACTIVE_STATES))


def _insert(table: str, columns: Sequence[str]) -> str:
    return f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"


# --- tasks ------------------------------------------------------------------------------------------------

# Its rows are ``TASK_COLUMNS`` (``tables.task_from_row``: the tags and the creation time among them, so
# that every read of a task, a callback's locked read too, has them at no cost), then ``ttl_ms``,
# ``heartbeat_ms`` and ``lease_until_ms``.
SELECT_TASK = f"SELECT {', '.join(TASK_COLUMNS)}, ttl_ms, heartbeat_ms, lease_until_ms FROM tasks"
TASK = f"{SELECT_TASK} WHERE id = ?"  # + LOCK in a write transaction
TASKS = f"{SELECT_TASK} WHERE {{ids}} ORDER BY id"  # + LOCK; in id order, so that batches lock in one order
# The tasks stored at a version above a known one: a map of them as rows ``c(id, after)`` (SQLITE_CURSORS,
# PG_CURSORS), each joined to its row by primary key.
AHEAD = "SELECT t.id, t.version FROM {cursors} JOIN tasks AS t ON t.id = c.id WHERE t.version > c.after"
# The same, of the revisions (the changes beside the history): each channel's oldest held one.
REVISIONS_AHEAD = (
    "SELECT t.id, t.revision FROM {cursors} JOIN tasks AS t ON t.id = c.id WHERE t.revision > c.after"
)
TASK_EXISTS = "SELECT 1 FROM tasks WHERE id = ?"
NEXT_DEADLINE = f"SELECT min(expires_at_ms) FROM tasks WHERE {_LIVE}"
# A running attempt whose lease ended before its deadline is left to LEASES_ENDED: its end comes first in the
# history (a heartbeat-timeout fail at the lease's end, then, requeued, this expiry), whoever sweeps first.
DUE = (
    f"{SELECT_TASK} WHERE {_LIVE} AND expires_at_ms <= ? "
    f"AND NOT ({LEASED} AND lease_until_ms < expires_at_ms) ORDER BY expires_at_ms LIMIT ?"  # + CLAIM
)
# Its parameters: ``tables.task_values``, ``tables.insert_only_values``, then these three.
_WRITTEN_ONCE = tuple(name for name in INSERT_ONLY if name != "created_at_ms")
INSERT_TASK = _insert("tasks", (*UPDATED_COLUMNS, *_WRITTEN_ONCE, "ttl_ms", "created_at_ms", "heartbeat_ms"))

# --- tags: fixed at creation, each a row of task_tags (ix_task_tags_tag) beside the task's ``tags`` column -

TAG_COLUMNS = ("tag", "task_id", "created_at_ms")
INSERT_TASK_TAG = _insert("task_tags", TAG_COLUMNS)  # once per tag (SQLite; PostgreSQL: PG_INSERT_TAGGED)
# A tag's tasks, newest first: one range of ix_task_tags_tag, read backwards, LIMIT rows of it.
TAGGED = "SELECT task_id FROM task_tags WHERE tag = ? ORDER BY created_at_ms DESC, task_id DESC LIMIT ?"


@functools.cache
def tagged_tasks(
    *, others: int, by_state: bool, before: bool, parent: bool = False, title: bool = False
) -> str:
    """One page of the task list by tags, newest first: the first tag's range of ix_task_tags_tag read
    backwards from ``(created_at_ms, task_id) < (?, ?)`` where asked, each of ``others`` more tags probed
    by the task's primary key in task_tags, ``state = ?``, ``parent = ?`` and a title containing a text
    (as ``newest_tasks``) where asked; its parameters in that order, then the limit. Keyset pagination:
    each page is one index range, however deep it is."""
    where = ["g.tag = ?"]
    if before:
        where.append("(g.created_at_ms, g.task_id) < (?, ?)")
    where += ["EXISTS (SELECT 1 FROM task_tags AS o WHERE o.task_id = g.task_id AND o.tag = ?)"] * others
    if by_state:
        where.append("t.state = ?")
    if parent:
        where.append("t.parent = ?")
    if title:
        where.append("lower(t.title) LIKE ? ESCAPE '\\'")
    return (
        f"SELECT {', '.join(f't.{name}' for name in TASK_COLUMNS)} FROM task_tags AS g "
        f"JOIN tasks AS t ON t.id = g.task_id WHERE {' AND '.join(where)} "
        "ORDER BY g.created_at_ms DESC, g.task_id DESC LIMIT ?"
    )


# The tasks of some tags created since a time, each with its epoch (which history of its id it is): a range
# of the index per tag ({tags}: ``g.tag IN``/``= ANY``), each task's row found by its primary key.
TAGGED_SINCE = (
    "SELECT g.tag, g.task_id, t.epoch FROM task_tags AS g JOIN tasks AS t ON t.id = g.task_id "
    "WHERE {tags} AND g.created_at_ms >= ? ORDER BY g.tag, g.created_at_ms, g.task_id"
)

# The children of some parents created since a time, each with its epoch: a range of ix_tasks_parent per
# parent ({parents}: ``parent IN``/``= ANY``).
CHILDREN_SINCE = (
    "SELECT parent, id, epoch FROM tasks WHERE {parents} AND created_at_ms >= ? "
    "ORDER BY parent, created_at_ms, id"
)

# --- heartbeat leases (gateway.lease) -----------------------------------------------------------------
# Both repeat the predicate of the partial index ix_tasks_lease_end: answered in O(rows wanted).
NEXT_LEASE_END = f"SELECT min(lease_until_ms) FROM tasks WHERE {LEASED}"
LEASES_ENDED = (
    f"{SELECT_TASK} WHERE {LEASED} AND lease_until_ms <= ? ORDER BY lease_until_ms LIMIT ?"  # + CLAIM
)
RENEW_LEASE = "UPDATE tasks SET lease_until_ms = ? WHERE id = ?"


@functools.cache
def list_tasks(*, by_state: bool, after: bool) -> str:
    """One page of the task list, ``state = ?`` and ``id > ?`` where asked (in that order), then the limit.
    Keyset pagination over the primary key: each page is one index range, however deep it is."""
    where = [condition for condition, wanted in (("state = ?", by_state), ("id > ?", after)) if wanted]
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    return f"{SELECT_TASK}{clause} ORDER BY id LIMIT ?"


@functools.cache
def newest_tasks(*, by_state: bool, before: bool, parent: bool = False, title: bool = False) -> str:
    """One page of the task list newest first (``created_at_ms`` descending, then id descending): one range
    of ix_tasks_created read backwards from ``(created_at_ms, id) < (?, ?)`` where asked (of
    ix_tasks_parent, for a parent's children: ``parent = ?``), ``state = ?`` where asked, a title that
    contains a text, case aside (``lower(title) LIKE ?``, the pattern lowered and escaped with ``\\``)
    where asked; its parameters in that order, then the limit. Keyset pagination, as the id order's."""
    where = [
        condition
        for condition, wanted in (
            ("parent = ?", parent),
            ("(created_at_ms, id) < (?, ?)", before),
            ("state = ?", by_state),
            ("lower(title) LIKE ? ESCAPE '\\'", title),
        )
        if wanted
    ]
    clause = f" WHERE {' AND '.join(where)}" if where else ""
    return f"{SELECT_TASK}{clause} ORDER BY created_at_ms DESC, id DESC LIMIT ?"


def contains_pattern(text: str) -> str:
    """A ``LIKE`` pattern (escaped with ``\\``) of the strings that contain ``text``, lowered."""
    escaped = text.lower().replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


@functools.cache
def update_task(columns: tuple[str, ...]) -> str:
    """A task row moved from the version a transaction read (the last two parameters: id, version before),
    setting only ``columns`` (a progress callback sets two)."""
    return f"UPDATE tasks SET {', '.join(f'{name} = ?' for name in columns)} WHERE id = ? AND version = ?"


# --- history ----------------------------------------------------------------------------------------------

# Many resumes at once: the tasks named by a map of task id -> cursor ({cursors}: rows ``c(id, after)``,
# SQLite's ``SQLITE_CURSORS`` or PostgreSQL's ``PG_CURSORS``) joined to their rows by primary key, each with
# the entries its cursor missed, none when its cursor is more than a retention behind (the parameter after
# the cursors) or ahead of it: those resume with a snapshot. Rows: ``TASK_COLUMNS``, then the entry's
# version and event (NULL when none), by task id and version.
RESUME_ROWS = (
    f"SELECT {', '.join(f't.{name}' for name in TASK_COLUMNS)}, e.version, e.event FROM {{cursors}} "
    "JOIN tasks AS t ON t.id = c.id LEFT JOIN entries AS e ON e.task_id = t.id AND e.version > c.after "
    "AND e.version <= t.version AND c.after >= t.version - ? ORDER BY t.id, e.version"
)
# A JSON object of task id -> cursor as rows (one parameter, whatever the map's size).
SQLITE_CURSORS = "(SELECT key AS id, value AS after FROM json_each(?)) AS c"

ENTRY_COLUMNS = ("task_id", "version", "type", "at_ms", "event")
ENTRIES = (
    "SELECT version, event FROM entries WHERE task_id = ? AND version > ? AND version <= ? ORDER BY version"
)
INSERT_ENTRY = _insert("entries", ENTRY_COLUMNS)

# --- callback ids -----------------------------------------------------------------------------------------

CALLBACK_COLUMNS = ("callback_id", "task_id", "at_ms", "digest")
DIGESTS = "SELECT callback_id, digest FROM callbacks WHERE {ids}"
INSERT_CALLBACK = _insert("callbacks", CALLBACK_COLUMNS)

# --- streams (gateway.streams): a row of running totals per stream, a row per appended batch ---------------

# A head's columns in ``gateway.streams.Head``'s order, and a batch's in ``Batch``'s.
HEAD_COLUMNS = ("name", "attempt", "first_offset", "next_offset", "text_bytes", "next_seq", "last_offset")
BATCH_COLUMNS = ("first_offset", "count", "attempt", "chunk_bytes", "chunks")
STREAM_HEADS = f"SELECT task_id, {', '.join(HEAD_COLUMNS)} FROM streams WHERE {{ids}} ORDER BY task_id, name"
# From the batch that holds an offset (the last that starts at or before it: one probe of the key, read
# backwards), then those after it: one range of the key.
_BATCH = f"SELECT {', '.join(BATCH_COLUMNS)} FROM stream_batches WHERE task_id = ? AND stream = ?"
STREAM_BATCHES = (
    f"{_BATCH} AND first_offset >= COALESCE((SELECT max(first_offset) FROM stream_batches "
    "WHERE task_id = ? AND stream = ? AND first_offset <= ?), 0) ORDER BY first_offset LIMIT ?"
)
# A retry of an earlier batch than the last (rare: a worker sends one batch at a time, and the retry of the
# last one reads it at its offset, with STREAM_BATCHES): batch ``seq`` is the seq-th of the stream's (it
# keeps its attempt's batches alone, every one of them), found in the stream's range of the key.
STREAM_BATCH = f"{_BATCH} ORDER BY first_offset LIMIT 1 OFFSET ?"
DROP_BATCHES = "DELETE FROM stream_batches WHERE task_id = ? AND stream = ? AND first_offset < ?"
INSERT_BATCH = _insert("stream_batches", ("task_id", "stream", *BATCH_COLUMNS))
INSERT_STREAM = _insert("streams", ("task_id", *HEAD_COLUMNS))
_MOVED = ", ".join(f"{name} = ?" for name in HEAD_COLUMNS[1:])
UPDATE_STREAM = f"UPDATE streams SET {_MOVED} WHERE task_id = ? AND name = ?"

# --- receipts ---------------------------------------------------------------------------------------------

RECEIPT_COLUMNS = ("task_id", "result_ref", "result_hash", "idempotency_key", "delivered_at_ms")
RECEIPT = f"SELECT {', '.join(RECEIPT_COLUMNS)} FROM deliveries WHERE idempotency_key = ?"
INSERT_RECEIPT = _insert("deliveries", RECEIPT_COLUMNS)

# --- the outbox: notifications of terminal transitions, drained and relayed independently -----------------

NOTIFICATION_COLUMNS = ("task_id", "state", "at_ms", "version")
INSERT_NOTIFICATION = _insert("outbox", NOTIFICATION_COLUMNS)
# The oldest pending notifications (outbox order), at most a limit. The partial index ix_outbox_pending
# answers the inner query in O(limit): drained rows are not in it. ``{claim}``: rows another drain holds
# are skipped, so that drains running together take different notifications.
DRAIN = (
    "UPDATE outbox SET drained_at_ms = ? WHERE id IN (SELECT id FROM outbox WHERE drained_at_ms IS NULL "
    "ORDER BY id LIMIT ?{claim}) RETURNING id, task_id, state, at_ms, version"
)
DRAIN_PENDING = "SELECT EXISTS (SELECT 1 FROM outbox WHERE drained_at_ms IS NULL)"

# --- drain batches: the answers of drains made with an Idempotency-Key ------------------------------------

DRAIN_BATCH_COLUMNS = ("idempotency_key", "made_at_ms", "more", "body")
DRAIN_BATCH = f"SELECT {', '.join(DRAIN_BATCH_COLUMNS)} FROM drain_batches WHERE idempotency_key = ?"
INSERT_DRAIN_BATCH = _insert("drain_batches", DRAIN_BATCH_COLUMNS)
FORGET_DRAIN_BATCH = "DELETE FROM drain_batches WHERE idempotency_key = ?"
# The oldest batches made before a time, at most a limit (ix_drain_batches_made_at); ``{claim}`` as above.
FORGET_DRAIN_BATCHES = (
    "DELETE FROM drain_batches WHERE idempotency_key IN (SELECT idempotency_key FROM drain_batches "
    "WHERE made_at_ms < ? ORDER BY made_at_ms LIMIT ?{claim})"
)
RELAY_PENDING = "SELECT count(*) FROM outbox WHERE relayed_at_ms IS NULL"
# The partial index ix_outbox_relay_due answers this in O(batch): relayed rows are not in it.
RELAY_DUE = (
    "SELECT id, task_id, state, at_ms, version, relay_attempts FROM outbox "
    "WHERE relayed_at_ms IS NULL AND relay_next_at_ms <= ? ORDER BY relay_next_at_ms, id LIMIT ?"
)  # + CLAIM
RELAY_LEASE = "UPDATE outbox SET relay_next_at_ms = ?, relay_attempts = relay_attempts + 1 WHERE {ids}"
RELAY_SENT = "UPDATE outbox SET relayed_at_ms = ? WHERE {ids} AND relayed_at_ms IS NULL"
RELAY_LATER = "UPDATE outbox SET relay_next_at_ms = ? WHERE id = ? AND relayed_at_ms IS NULL"

# --- retention: finished tasks deleted with everything they own -------------------------------------------

# The tables whose rows belong to one task, with the column that names it (each indexed by it): retention
# deletes a task's rows from each, then the task itself, in one transaction (``SqlTx.forget``). A new table
# keyed by task id joins by adding its line here (and its part to the in-memory twin's ``_Data.forget``).
TASK_OWNED = (
    ("entries", "task_id"),
    ("streams", "task_id"),
    ("stream_batches", "task_id"),
    ("task_tags", "task_id"),
    ("callbacks", "task_id"),
    ("deliveries", "task_id"),
    ("outbox", "task_id"),
)
FORGET = "DELETE FROM {table} WHERE {ids}"
# Where the tasks are walked from: before any (finished_at_ms, id), since times are epoch milliseconds.
FINISHED_START = (-1, "")


def _untaken(*, relay: bool) -> str:
    """The task's notification that nobody took yet: not drained, nor relayed when a relay sends them."""
    relayed = " AND relayed_at_ms IS NULL" if relay else ""
    return f"SELECT 1 FROM outbox WHERE outbox.task_id = tasks.id AND drained_at_ms IS NULL{relayed}"


# A child is never deleted before its parent (protocol.md, Batches): it is kept while its parent is (found
# by its primary key); a task with no parent has none (``p.id = NULL`` holds for no row).
_PARENT_KEPT = "SELECT 1 FROM tasks AS p WHERE p.id = tasks.parent"


@functools.cache
def finished_due(*, relay: bool) -> str:
    """Tasks finished at or before a cutoff whose notification was taken and whose parent (if any) is gone,
    oldest first, after a point ``(finished_at_ms, id)`` (a keyset: one pass walks the index
    ix_tasks_finished once, past the tasks it keeps); its parameters: the cutoff, the point, the limit.
    + CLAIM."""
    return (
        "SELECT finished_at_ms, id FROM tasks WHERE finished_at_ms <= ? AND (finished_at_ms, id) > (?, ?) "
        f"AND NOT EXISTS ({_untaken(relay=relay)}) AND NOT EXISTS ({_PARENT_KEPT}) "
        "ORDER BY finished_at_ms, id LIMIT ?"
    )


@functools.cache
def finished_held(*, relay: bool) -> str:
    """How many tasks finished at or before a cutoff are kept because nobody took their notification."""
    return f"SELECT count(*) FROM tasks WHERE finished_at_ms <= ? AND EXISTS ({_untaken(relay=relay)})"


# --- the deployment: what it knows of itself, by name (gateway.store.deployment) --------------------------

DEPLOYMENT_FACT = "SELECT value FROM deployment WHERE name = ?"
INSERT_DEPLOYMENT_FACT = _insert("deployment", ("name", "value"))


# --- where PostgreSQL differs -----------------------------------------------------------------------------

LOCK = " FOR UPDATE"
CLAIM = " FOR UPDATE SKIP LOCKED"
IN_ARRAY = "{column} = ANY(?)"
# Locks and dedup look each key up on its own (an index probe per key). A prepared ``id = ANY(?)`` gets a
# generic plan after five runs, and on a table without statistics yet (a new database, until autovacuum
# analyzes it) that plan is a scan of the whole table, kept while the table grows: seen as 450 rows read
# per callback in the callbacks benchmark. In the order of the array (sorted by the caller).
PG_LOCK_TASKS = (
    "SELECT t.* FROM unnest(?::text[]) AS i(id) "
    f"CROSS JOIN LATERAL ({SELECT_TASK} WHERE id = i.id{LOCK}) AS t"
)
# The same, with the heads of the streams of each task flagged in a second array (an array of rows, in name
# order; NULL when it has none, or is not flagged): read under the task's lock, in the same round trip.
PG_LOCK_TASKS_HEADS = (
    f"SELECT t.*, (SELECT array_agg(ROW({', '.join(HEAD_COLUMNS)}) ORDER BY name) FROM streams "
    "WHERE streams.task_id = i.id AND i.streamed) FROM unnest(?::text[], ?::bool[]) AS i(id, streamed) "
    f"CROSS JOIN LATERAL ({SELECT_TASK} WHERE id = i.id{LOCK}) AS t"
)
# A tagged task's row and its tags' rows in one statement (its parameters: ``INSERT_TASK``'s, then the
# task id, its creation time and the tags as one array).
PG_INSERT_TAGGED = (
    f"WITH made AS ({INSERT_TASK}) INSERT INTO task_tags ({', '.join(TAG_COLUMNS)}) "
    "SELECT g.tag, ?, ? FROM unnest(?::text[]) AS g(tag)"
)
# Two arrays, task ids and their cursors, as rows (RESUME_ROWS).
PG_CURSORS = "unnest(?::text[], ?::bigint[]) AS c(id, after)"
# A batch's lease renewals in one statement (SQLite runs ``RENEW_LEASE`` once per row).
PG_RENEW_LEASES = (
    "UPDATE tasks AS t SET lease_until_ms = v.until FROM unnest(?::text[], ?::bigint[]) AS v(id, until) "
    "WHERE t.id = v.id"
)
# Every key asked for, with its digest or NULL.
PG_DIGESTS = (
    "SELECT i.id, (SELECT digest FROM callbacks WHERE callback_id = i.id) FROM unnest(?::text[]) AS i(id)"
)


def _pg_stream_parts() -> list[str]:
    """A transaction's stream appends as parts of a ``WITH`` (``store.base.StreamWrites``): the dropped
    batches, the new ones, the heads made and those moved; their parameters one array per column of each,
    in that order."""
    head = ("task_id", *HEAD_COLUMNS)
    assigned = ", ".join(f"{name} = v.{name}" for name in HEAD_COLUMNS[1:])
    return [
        "stream_dropped AS (DELETE FROM stream_batches AS b USING "
        f"{_unnest(stream_batches, ('task_id', 'stream', 'first_offset'), ('task_id', 'stream', 'before'))} "
        "WHERE b.task_id = v.task_id AND b.stream = v.stream AND b.first_offset < v.before)",
        f"stream_added AS (INSERT INTO stream_batches (task_id, stream, {', '.join(BATCH_COLUMNS)}) "
        f"SELECT * FROM {_unnest(stream_batches, ('task_id', 'stream', *BATCH_COLUMNS))})",
        f"stream_made AS (INSERT INTO streams ({', '.join(head)}) SELECT * FROM {_unnest(streams, head)})",
        f"stream_moved AS (UPDATE streams AS s SET {assigned} FROM {_unnest(streams, head, head)} "
        "WHERE s.task_id = v.task_id AND s.name = v.name)",
    ]


@functools.lru_cache(maxsize=512)
def numbered(sql: str) -> str:
    """``?`` placeholders as PostgreSQL's ``$1, $2...``."""
    first, *rest = sql.split("?")
    return first + "".join(f"${n}{part}" for n, part in enumerate(rest, 1))


_PG = postgresql.dialect()  # type: ignore[no-untyped-call]


def _unnest(table: Table, names: Sequence[str], aliases: Sequence[str] | None = None) -> str:
    """``unnest`` of one array parameter per column of ``table``, typed as the column is."""
    arrays = ", ".join(f"?::{table.c[name].type.compile(dialect=_PG)}[]" for name in names)
    return f"unnest({arrays})" + (f" AS v({', '.join(aliases)})" if aliases else "")


def _insert_rows(table: Table, names: Sequence[str]) -> str:
    return (
        f"{table.name}_rows AS (INSERT INTO {table.name} ({', '.join(names)}) "
        f"SELECT * FROM {_unnest(table, names)} WHERE (SELECT ok FROM checked))"
    )


@functools.cache
def pg_batch(columns: tuple[str, ...] | None, *, streams: bool = False, leases: bool = False) -> str:
    """A batch's writes as one statement: the task rows (``None``: none) setting ``columns``, each checked
    at the version it was read at, then the entries, notifications, callback ids and ``NOTIFY`` messages,
    written only if every task row was as read; with ``streams``, the stream appends (a failed check rolls
    the transaction back: they need no condition); with ``leases``, lease renewals of tasks whose rows it
    does not update (PostgreSQL updates a row once a statement). Its parameters: the task ids, their
    versions before, one array per column and their count; then one array per column of
    ``ENTRY_COLUMNS``, ``NOTIFICATION_COLUMNS``, ``CALLBACK_COLUMNS``, and the channels and payloads; then
    the streams' arrays (:func:`_pg_stream_parts`), then the renewals' task ids and lease ends. Answers
    whether the task rows were as read, and how many messages went."""
    if columns is None:
        parts = ["checked AS (SELECT true AS ok)"]
    else:
        source = _unnest(tasks, ("id", "version", *columns), ("id", "before", *columns))
        assigned = ", ".join(f"{name} = v.{name}" for name in columns)
        parts = [
            f"updated AS (UPDATE tasks AS t SET {assigned} FROM {source} "
            "WHERE t.id = v.id AND t.version = v.before RETURNING t.id)",
            "checked AS (SELECT count(*) = ? AS ok FROM updated)",
        ]
    parts += [
        _insert_rows(entries, ENTRY_COLUMNS),
        _insert_rows(outbox, NOTIFICATION_COLUMNS),
        _insert_rows(callbacks, CALLBACK_COLUMNS),
        # unnest keeps the arrays' order, and pg_notify runs after the ORDER BY: messages go in order.
        "sent AS (SELECT pg_notify(m.channel, m.payload) FROM unnest(?::text[], ?::text[]) "
        "WITH ORDINALITY AS m(channel, payload, n) WHERE (SELECT ok FROM checked) ORDER BY m.n)",
    ]
    if streams:
        parts += _pg_stream_parts()
    if leases:
        parts.append(f"renewed AS ({PG_RENEW_LEASES})")
    return numbered(f"WITH {', '.join(parts)} SELECT (SELECT ok FROM checked), (SELECT count(*) FROM sent)")
