"""``gateway`` with the time each entry commits written down, for the benchmarks that time a frame from its
commit (bench/workloads/latency_e2e.py; the across-hosts workload).

    BENCH_COMMIT_TIMES=FILE python -m bench.programs.timed serve --port P --database-url URL [--workers N]

(the arguments of ``gateway``).

For every entry a transaction of the SQL store writes (a task's event at a version), the process appends
one line to ``FILE`` once that transaction has committed::

    <CLOCK_MONOTONIC in ns> <version> <task id>\\n

``time.monotonic_ns`` is one clock for the whole machine on Linux (network namespaces included), so these
times compare with any other process's on the same machine. Without ``BENCH_COMMIT_TIMES`` nothing is
written, and the gateway runs as ``gateway serve`` does in every case. ``--workers`` children (started with
multiprocessing's "spawn", which imports this file again as ``__mp_main__``) are patched the same way and
append to the same file (opened ``O_APPEND``: each commit's lines are one ``write``, never interleaved).

What "commit" means here, exactly:

- PostgreSQL (``gateway.store.pg_writer``): the moment the gateway's event loop resumes the transaction
  with PostgreSQL's answer ``COMMIT`` to its ``COMMIT`` in hand (the WAL flushed, the rows visible to
  every other session, its ``NOTIFY`` sent to the bus's listeners): stamped right after
  ``pg_writer._commit`` returns, before the connection goes back to the pool and before the book publishes
  the entries to the process's subscribers. It includes the wait for the event loop to run the coroutine.
- SQLite (``gateway.store.sqlite_writer``): the moment the writer's thread returns from ``COMMIT`` (its
  fsync done), stamped on that thread, before the event loop is woken with the transaction's result
  (``SqliteWriter._run``; and ``SqliteWriter._commit`` for a write made statement by statement).

An entry is known by the transaction's calls to ``record_many`` (every entry the store writes goes
through it); a transaction that rolls back writes no line. Writing the line is one ``os.write`` of a few
dozen bytes per commit (to the page cache), on the event loop for PostgreSQL and on the writer's thread
for SQLite.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from gateway import cli
from gateway.machine import Transition
from gateway.store import pg_writer, sqlite_writer

ENV = "BENCH_COMMIT_TIMES"

_path = os.environ.get(ENV)
_fd: int | None = None
_lock = threading.Lock()
# The entries each connection's transaction has recorded so far: (task id, version), by connection.
_pending: dict[int, list[tuple[str, int]]] = {}


def _write(lines: bytes) -> None:
    global _fd
    if _fd is None:
        assert _path is not None
        _fd = os.open(_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(_fd, lines)


def _committed(conn: object) -> None:
    """The transaction on ``conn`` has just committed: its entries' lines, stamped now."""
    now = time.monotonic_ns()
    with _lock:
        entries = _pending.pop(id(conn), None)
        if entries:
            _write(b"".join(f"{now} {version} {task_id}\n".encode() for task_id, version in entries))


def _began(conn: object) -> None:
    with _lock:
        _pending.pop(id(conn), None)


def _patch_tx(cls: Any) -> None:
    init = cls.__init__
    record_many = cls.record_many

    def __init__(self: Any, conn: Any, *args: Any, **kwargs: Any) -> None:
        init(self, conn, *args, **kwargs)
        _began(conn)

    async def timed_record_many(self: Any, items: Sequence[tuple[Transition, bytes, float]]) -> None:
        await record_many(self, items)
        recorded = [(t.task.id, t.entry.version) for t, _, _ in items if t.entry is not None]
        with _lock:
            _pending.setdefault(id(self._conn), []).extend(recorded)

    cls.__init__ = __init__
    cls.record_many = timed_record_many


def _patch() -> None:
    for cls in (pg_writer.PgTx, sqlite_writer.SqliteTx):
        _patch_tx(cls)

    commit_pg: Callable[..., Awaitable[str]] = pg_writer._commit

    async def timed_commit_pg(driver: Any, deadline: float) -> str:
        status = await commit_pg(driver, deadline)
        if status == "COMMIT":
            _committed(driver)
        return status

    pg_writer._commit = timed_commit_pg

    writer = sqlite_writer.SqliteWriter
    run, commit = writer._run, writer._commit

    def timed_run(self: sqlite_writer.SqliteWriter, *args: Any) -> Any:
        result = run(self, *args)  # returns only once COMMIT did
        _committed(self._conn)
        return result

    def timed_commit(self: sqlite_writer.SqliteWriter) -> None:
        commit(self)
        _committed(self._conn)

    writer._run = timed_run  # type: ignore[method-assign,assignment]
    writer._commit = timed_commit  # type: ignore[method-assign]


if _path:
    _patch()


def read(path: str) -> dict[tuple[str, int], int]:
    """The commit times a file holds: ``{(task id, version): monotonic ns}`` (the first, if written twice)."""
    times: dict[tuple[str, int], int] = {}
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return times
    for line in data.decode().splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3:
            times.setdefault((parts[2], int(parts[1])), int(parts[0]))
    return times


if __name__ == "__main__":
    sys.exit(cli.main())
