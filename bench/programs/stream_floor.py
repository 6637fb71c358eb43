"""The floor of the streams workload: uvicorn + Starlette, a bare handler that inserts each appended batch as
one row on the bare driver, in a process of its own.

    python -m bench.programs.stream_floor KIND TARGET PORT

``KIND``: ``sqlite`` (sqlite3 on the file ``TARGET``, WAL and synchronous=FULL, as the gateway's writer) or
``postgresql`` (asyncpg at the URL ``TARGET``). Routes, the gateway's paths:

- ``POST /v1/tasks/{task_id}/streams/{name}`` with the gateway's body (``{"attempt", "seq", "chunks"}``):
  one row per batch (the task, the stream, its first offset, attempt, seq, the chunks as one JSON array),
  committed alone; the stream's next offset is kept in memory. No credential, no fencing, no seq check.
- ``GET /v1/tasks/{task_id}/streams/{name}``: a bare ``SELECT`` of the stream's rows and one send of all
  their chunks, ``{"chunks": [...], "nextOffset": N}`` (the resume read's floor).
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import sys
from collections.abc import AsyncIterator
from typing import Any

import asyncpg  # type: ignore[import-untyped]  # no stubs, no py.typed (as in gateway/store/database.py)
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bench.programs.callback_floor import durable_sqlite

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS batches (task_id TEXT, stream TEXT, first_offset BIGINT, attempt BIGINT, "
    "seq BIGINT, chunks BYTEA, PRIMARY KEY (task_id, stream, first_offset))"
)
INSERT = "INSERT INTO batches VALUES ({})"
SELECT = "SELECT first_offset, chunks FROM batches WHERE task_id = {} AND stream = {} ORDER BY first_offset"


def ok(body: bytes) -> Response:
    return Response(body, media_type="application/json")


class Floor:
    def __init__(self, kind: str, target: str) -> None:
        self.kind, self.target = kind, target
        self.db: sqlite3.Connection | None = None
        self.pool: Any = None  # asyncpg's Pool
        self.next_offset: dict[tuple[str, str], int] = {}

    async def append(self, request: Request) -> Response:
        task_id, name = request.path_params["task_id"], request.path_params["name"]
        body = json.loads(await request.body())
        chunks = body["chunks"]
        raw = json.dumps(chunks, ensure_ascii=False, separators=(",", ":")).encode()
        offset = self.next_offset.get((task_id, name), 0)
        row = (task_id, name, offset, body["attempt"], body["seq"], raw)
        if self.db is not None:
            with self.db:
                self.db.execute(INSERT.format(", ".join("?" * 6)), row)
        else:
            async with self.pool.acquire() as conn:
                await conn.execute(INSERT.format("$1, $2, $3, $4, $5, $6"), *row)
        self.next_offset[(task_id, name)] = offset + len(chunks)
        answer = {
            "stream": name,
            "attempt": body["attempt"],
            "offset": offset,
            "nextOffset": offset + len(chunks),
            "duplicate": False,
        }
        return ok(json.dumps(answer).encode())

    async def read(self, request: Request) -> Response:
        key = (request.path_params["task_id"], request.path_params["name"])
        if self.db is not None:
            rows = self.db.execute(SELECT.format("?", "?"), key).fetchall()
        else:
            async with self.pool.acquire() as conn:
                rows = await conn.fetch(SELECT.format("$1", "$2"), *key)
        # Each row holds a JSON array: their insides joined are the stream's array.
        inside = b",".join(bytes(row[1])[1:-1] for row in rows)
        return ok(
            b'{"chunks":[' + inside + b'],"nextOffset":' + str(self.next_offset.get(key, 0)).encode() + b"}"
        )

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self.kind == "sqlite":
            self.db = durable_sqlite(self.target)
            self.db.execute(SCHEMA.replace("BYTEA", "BLOB") + " WITHOUT ROWID")
        else:
            self.pool = await asyncpg.create_pool(self.target, min_size=10, max_size=20)
            async with self.pool.acquire() as conn:
                await conn.execute(SCHEMA)
        try:
            yield
        finally:
            if self.db is not None:
                self.db.close()
            if self.pool is not None:
                await self.pool.close()


def main(kind: str, target: str, port: int) -> None:
    floor = Floor(kind, target)
    routes = [Route("/v1/tasks/{task_id}/streams/{name}", floor.append, methods=["POST"])]
    routes.append(Route("/v1/tasks/{task_id}/streams/{name}", floor.read, methods=["GET"]))
    app = Starlette(routes=routes, lifespan=floor.lifespan)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
