"""``gateway`` with its store's queries counted, for the benchmarks that count them (bench/workloads/tags.py).

    python -m bench.programs.counted serve --port P --database-url URL   (the arguments of ``gateway``)

Every query a transaction of the SQL store sends (each ``fetch`` of a SQLite read, a SQLite write or a
PostgreSQL transaction: every statement that reads rows) adds one to the gauge
``gateway_bench_store_queries`` on ``/metrics``, and every other statement (``run``, ``run_many``) to
``gateway_bench_store_statements``. Nothing else changes: the gateway runs as ``gateway serve`` does.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import Gauge

from gateway import cli, metrics
from gateway.store import pg_writer, sql, sqlite_writer

_lock = threading.Lock()  # SQLite writes run on a thread of their own
COUNTS = {"queries": 0, "statements": 0}


def _counted(kind: str, method: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _lock:
            COUNTS[kind] += 1
        return await method(self, *args, **kwargs)

    return counted


for cls in (sql.SqliteReadTx, sqlite_writer.SqliteTx, pg_writer.PgTx):
    for name, kind in (("fetch", "queries"), ("run", "statements"), ("run_many", "statements")):
        if name in vars(cls):
            setattr(cls, name, _counted(kind, vars(cls)[name]))

_init = metrics.Metrics.__init__


def _metrics_init(self: metrics.Metrics, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    for kind in COUNTS:
        gauge = Gauge(f"gateway_bench_store_{kind}", f"Store {kind} sent since start", registry=self.registry)
        gauge.set_function(lambda kind=kind: float(COUNTS[kind]))  # type: ignore[misc]


metrics.Metrics.__init__ = _metrics_init  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(cli.main())
