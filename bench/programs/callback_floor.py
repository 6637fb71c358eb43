"""The floor of the callbacks workload: uvicorn + Starlette, one handler doing the gateway's transaction per
callback on the bare driver, in a process of its own.

    python -m bench.programs.callback_floor KIND TARGET PORT

``KIND``: ``none`` (answers without a database: what HTTP alone costs), ``sqlite`` (on the file ``TARGET``,
WAL and synchronous=FULL) or ``postgresql`` (asyncpg, at the URL ``TARGET``). Per callback: lock the task,
look the callback id up, update the task, append the entry, remember the id, commit.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import asyncpg  # type: ignore[import-untyped]  # no stubs, no py.typed (as in gateway/store/database.py)
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

SCHEMA = [
    "CREATE TABLE IF NOT EXISTS tasks (id TEXT PRIMARY KEY, state TEXT, progress BIGINT, version BIGINT)",
    "CREATE TABLE IF NOT EXISTS entries (task_id TEXT, version BIGINT, event BYTEA,"
    " PRIMARY KEY (task_id, version))",
    "CREATE TABLE IF NOT EXISTS callbacks (callback_id TEXT PRIMARY KEY, task_id TEXT, digest TEXT)",
]


def ok(body: dict[str, Any]) -> Response:
    return Response(json.dumps(body), media_type="application/json")


def durable_sqlite(path: str) -> sqlite3.Connection:
    """A SQLite connection with the gateway's writer's durability: WAL, and an fsync at every commit."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    return db


class Floor:
    def __init__(self, kind: str, target: str) -> None:
        self.kind, self.target = kind, target
        self.db: sqlite3.Connection | None = None
        self.pool: Any = None  # asyncpg's Pool

    async def create(self, request: Request) -> Response:
        body = json.loads(await request.body())
        if self.db is not None:
            with self.db:
                self.db.execute("INSERT INTO tasks VALUES (?, 'queued', 0, 0)", (body["id"],))
        elif self.pool is not None:
            async with self.pool.acquire() as conn:
                await conn.execute("INSERT INTO tasks VALUES ($1, 'queued', 0, 0)", body["id"])
        return ok({"task": {"id": body["id"]}, "callbackToken": "x", "subscribeToken": "x"})

    async def callback(self, request: Request) -> Response:
        task_id = request.path_params["task_id"]
        body = json.loads(await request.body())
        event, cid = body["event"], body["callbackId"]
        event["atMs"] = time.time_ns() // 1_000_000
        raw = json.dumps(event)
        progress = event.get("progress", 0)
        if self.db is not None:
            db = self.db
            db.execute("BEGIN IMMEDIATE")
            try:
                version = db.execute("SELECT version FROM tasks WHERE id = ?", (task_id,)).fetchone()[0]
                db.execute("SELECT digest FROM callbacks WHERE callback_id = ?", (cid,)).fetchone()
                db.execute(
                    "UPDATE tasks SET state = 'running', progress = ?, version = ? WHERE id = ?",
                    (progress, version + 1, task_id),
                )
                db.execute("INSERT INTO entries VALUES (?, ?, ?)", (task_id, version + 1, raw))
                db.execute("INSERT INTO callbacks VALUES (?, ?, 'd')", (cid, task_id))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        elif self.pool is not None:
            async with self.pool.acquire() as conn, conn.transaction():
                version = await conn.fetchval("SELECT version FROM tasks WHERE id = $1 FOR UPDATE", task_id)
                await conn.fetchval("SELECT digest FROM callbacks WHERE callback_id = $1", cid)
                await conn.execute(
                    "UPDATE tasks SET state = 'running', progress = $1, version = $2 WHERE id = $3",
                    progress,
                    version + 1,
                    task_id,
                )
                await conn.execute(
                    "INSERT INTO entries VALUES ($1, $2, $3)", task_id, version + 1, raw.encode()
                )
                await conn.execute("INSERT INTO callbacks VALUES ($1, $2, 'd')", cid, task_id)
        return ok({"changed": True, "reason": "progress"})

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if self.kind == "sqlite":
            self.db = durable_sqlite(self.target)
            for statement in SCHEMA:
                self.db.execute(statement.replace("BYTEA", "BLOB"))
        elif self.kind == "postgresql":
            self.pool = await asyncpg.create_pool(self.target, min_size=10, max_size=20)
            async with self.pool.acquire() as conn:
                for statement in SCHEMA:
                    await conn.execute(statement)
        yield


def main(kind: str, target: str, port: int) -> None:
    floor = Floor(kind, target)
    routes = [
        Route("/v1/tasks", floor.create, methods=["POST"]),
        Route("/v1/tasks/{task_id}/callbacks", floor.callback, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=floor.lifespan)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
