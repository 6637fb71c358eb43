"""Schema migrations (Alembic, ``gateway/store/migrations``) as an operator meets them: a new database
gets the schema of the models, a database of 0.1.0 (made with ``create_all``, no ``alembic_version``) keeps
its tasks, history, callback ids, notifications and receipts, gateways starting together migrate once, a
migration that fails leaves the database as it was, and ``gateway migrate`` answers in one line.

0.1.0's schema is frozen as DDL in tests/data (``schema_0_1_0_<dialect>.sql``, generated once from the models
of 0.1.0 with ``CreateTable``/``CreateIndex``), so that these tests keep describing that release when the
models change. Its rows are written with plain SQL for the same reason.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
import socket
import subprocess
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.schema import CreateIndex
from sqlmodel import SQLModel

from gateway.store import async_url
from gateway.store.migrate import (
    MIGRATION_LOCK_KEY,
    alembic_config,
    current_revision,
    head_revision,
    migrate,
)
from tests.support import (
    GATEWAY_CLI,
    FakeClock,
    bearer,
    error,
    eventually,
    mint,
    postgres_database,
    running_gateway,
)

# Every PostgreSQL database here starts empty (not a copy of the migrated template): these tests migrate.
pytestmark = pytest.mark.empty_database

DATA = Path(__file__).parent.parent / "data"
API_KEY = "migrations-test-api-key-0123456789"


@asynccontextmanager
async def engine_for(database_url: str) -> AsyncIterator[AsyncEngine]:
    engine = create_async_engine(async_url(database_url))
    try:
        yield engine
    finally:
        await engine.dispose()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    with postgres_database(template=False) as url:
        yield url


def schema_differences(conn: Connection) -> list[Any]:
    """How the database's schema differs from the models: Alembic's autogenerate comparison (tables,
    columns, types, nullability, primary keys, indexes), plus the predicates of partial indexes, which it
    does not compare (see :func:`partial_index_differences`)."""
    differences: list[Any] = list(compare_metadata(MigrationContext.configure(conn), SQLModel.metadata))
    return differences + partial_index_differences(conn)


def partial_index_differences(conn: Connection) -> list[str]:
    """Partial indexes whose ``WHERE`` differs from the model's.

    Alembic's index comparison looks at an index's name, columns or expressions and uniqueness, not at
    ``postgresql_where``/``sqlite_where``: an index that lost or changed its predicate passes
    ``compare_metadata`` unnoticed (no false difference, but no check either). Comparing the reflected
    predicate with the model's text directly would report false differences on PostgreSQL, which stores a
    predicate in its own canonical form (``state IN ('queued', 'running')`` reads back as ``(state)::text =
    ANY (ARRAY[...])``). So each partial index of the models is created once more, under another name and
    from the model, and the database's reading of both predicates must be the same.
    """
    dialect = conn.dialect.name
    found: list[str] = []
    for table in SQLModel.metadata.sorted_tables:
        for index in table.indexes:
            if index.dialect_options[dialect]["where"] is None:
                continue
            assert index.name is not None
            twin = f"{index.name}_as_modelled"
            ddl = str(CreateIndex(index).compile(dialect=conn.dialect))
            conn.exec_driver_sql(ddl.replace(f"INDEX {index.name} ", f"INDEX {twin} ", 1))
            try:
                predicates = {
                    reflected["name"]: str(reflected.get("dialect_options", {}).get(f"{dialect}_where"))
                    for reflected in inspect(conn).get_indexes(table.name)
                }
            finally:
                conn.exec_driver_sql(f"DROP INDEX {twin}")
            if predicates.get(index.name) != predicates[twin]:
                found.append(f"{index.name}: WHERE {predicates.get(index.name)}, modelled {predicates[twin]}")
    return found


async def diff_with_models(engine: AsyncEngine) -> list[Any]:
    async with engine.connect() as conn:
        return await conn.run_sync(schema_differences)


async def version_rows(engine: AsyncEngine) -> list[str]:
    async with engine.connect() as conn:
        return list((await conn.execute(text("SELECT version_num FROM alembic_version"))).scalars())


# --- a new database ---------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_new_database_gets_exactly_the_schema_of_the_models(database_url: str) -> None:
    async with engine_for(database_url) as engine:
        await migrate(engine)
        assert await current_revision(engine) == head_revision()
        assert await diff_with_models(engine) == []
        # The partial indexes are there, with a predicate (the check above compares them with the models).
        async with engine.connect() as conn:
            indexes = await conn.run_sync(
                lambda c: {
                    ix["name"]: ix for name in ("tasks", "outbox") for ix in inspect(c).get_indexes(name)
                }
            )
        for name in ("ix_tasks_live_deadline", "ix_outbox_pending"):
            assert indexes[name]["dialect_options"].get(f"{engine.dialect.name}_where") is not None, name

        # Once at head, migrating again changes nothing.
        await migrate(engine)
        assert await version_rows(engine) == [head_revision()]


@pytest.mark.anyio
async def test_on_postgresql_autovacuum_reuses_the_churning_tables_space_early(postgres_url: str) -> None:
    """Retention deletes from these tables all day: autovacuum must reclaim their dead rows at 2%, not at
    PostgreSQL's 20%, for the tables to stay the same size (docs/deploy.md, Retention); nothing to set up."""
    async with engine_for(postgres_url) as engine:
        await migrate(engine)
        async with engine.connect() as conn:
            rows = (
                await conn.execute(text("SELECT relname, reloptions FROM pg_class WHERE relkind = 'r'"))
            ).all()
    options = {name: set(opts or ()) for name, opts in rows}
    churning = ("tasks", "entries", "callbacks", "outbox", "deliveries", "drain_batches", "task_tags")
    for table in (*churning, "streams", "stream_batches"):
        assert "autovacuum_vacuum_scale_factor=0.02" in options[table], (table, options[table])


@pytest.mark.anyio
async def test_a_migration_that_fails_leaves_the_database_as_it_was(database_url: str) -> None:
    """One transaction: a failure half-way (here a table in the way of the last one created) leaves no
    half-made schema, which the next start would otherwise take for a 0.1.0 database and stamp. SQLite's
    Python driver would commit each CREATE on its own; the migration begins its transaction explicitly."""
    async with engine_for(database_url) as engine:
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE deliveries (x INTEGER)"))
        with pytest.raises(Exception, match="deliveries"):
            await migrate(engine)
        async with engine.connect() as conn:
            assert await conn.run_sync(lambda c: inspect(c).get_table_names()) == ["deliveries"]


# --- a database of 0.1.0 ----------------------------------------------------------------------------------

TASK_ID = "t-0.1.0"
CREATED = 1_700_000_000_000
RESULT_REF, RESULT_HASH = "s3://results/t-0.1.0", "sha256:5f2b"
START_EVENT = {"type": "start", "atMs": CREATED + 10, "worker": "w-1"}
SUCCEED_EVENT = {"type": "succeed", "atMs": CREATED + 20, "resultRef": RESULT_REF, "resultHash": RESULT_HASH}
# The callback that succeeded the task, as its worker sent it, and its digest as 0.1.0 stored it (sha256 of
# the canonical JSON of task id, event and attempt): a retry of it after the upgrade is still a duplicate.
SUCCEED_CALLBACK = {
    "callbackId": "cb-succeed-1",
    "attempt": 1,
    "event": {"type": "succeed", "resultRef": RESULT_REF, "resultHash": RESULT_HASH},
}
SUCCEED_DIGEST = "0eeb664605d3edbbc70d5f631eee854ff5108e71b44a09113f2aa2acd5422767"
TASK_JSON = {
    "id": TASK_ID,
    "state": "succeeded",
    "expiresAtMs": CREATED + 60_000,
    "attempts": 1,
    "maxAttempts": 2,
    "progress": 100,
    "version": 2,
    # Revision 0007: a task stored before tags has none, and its creation time is the one it was stored with.
    "tags": [],
    "createdAtMs": CREATED,
    "resultRef": RESULT_REF,
    "resultHash": RESULT_HASH,
    # Revision 0012: no metadata, no change beside its history; its end is when revision 0004 found it ended
    # (its terminal entry's time); its worker and start, which no row of 0.1.0 kept beside the history, are
    # not shown.
    "metadata": {},
    "revision": 0,
    "endedAtMs": CREATED + 20,
}


def ddl_statements(path: Path) -> list[str]:
    lines = [line for line in path.read_text().splitlines() if not line.startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


async def make_0_1_0_database(engine: AsyncEngine) -> None:
    """The tables 0.1.0 created, holding one succeeded task with its history, its callback id, its pending
    notification and one delivery receipt."""
    async with engine.begin() as conn:
        for statement in ddl_statements(DATA / f"schema_0_1_0_{engine.dialect.name}.sql"):
            await conn.exec_driver_sql(statement)
        await conn.execute(
            text(
                "INSERT INTO tasks (id, state, expires_at_ms, attempts, max_attempts, progress, version, "
                "result_ref, result_hash, error, ttl_ms, created_at_ms) VALUES (:id, 'succeeded', :exp, 1, "
                "2, 100, 2, :ref, :hash, NULL, 60000, :created)"
            ),
            {
                "id": TASK_ID,
                "exp": CREATED + 60_000,
                "ref": RESULT_REF,
                "hash": RESULT_HASH,
                "created": CREATED,
            },
        )
        await conn.execute(
            text(
                "INSERT INTO entries (task_id, version, type, at_ms, event) VALUES (:t, :v, :type, :at, :e)"
            ),
            [
                {"t": TASK_ID, "v": 1, "type": "start", "at": CREATED + 10, "e": orjson.dumps(START_EVENT)},
                {
                    "t": TASK_ID,
                    "v": 2,
                    "type": "succeed",
                    "at": CREATED + 20,
                    "e": orjson.dumps(SUCCEED_EVENT),
                },
            ],
        )
        await conn.execute(
            text("INSERT INTO callbacks (callback_id, task_id, at_ms, digest) VALUES (:c, :t, :at, :d)"),
            {"c": "cb-succeed-1", "t": TASK_ID, "at": CREATED + 20, "d": SUCCEED_DIGEST},
        )
        await conn.execute(
            text(
                "INSERT INTO outbox (task_id, state, at_ms, version, drained_at_ms) "
                "VALUES (:t, 'succeeded', :at, 2, NULL)"
            ),
            {"t": TASK_ID, "at": CREATED + 20},
        )
        await conn.execute(
            text(
                "INSERT INTO deliveries (idempotency_key, task_id, result_ref, result_hash, delivered_at_ms) "
                "VALUES ('deliver-1', :t, :ref, :hash, :at)"
            ),
            {"t": TASK_ID, "ref": RESULT_REF, "hash": RESULT_HASH, "at": CREATED + 30},
        )


@pytest.mark.anyio
async def test_a_database_of_0_1_0_upgrades_with_its_data_kept(database_url: str) -> None:
    async with engine_for(database_url) as engine:
        await make_0_1_0_database(engine)

    clock = FakeClock(CREATED + 1_000)
    async with running_gateway(database_url, clock=clock, api_key=API_KEY) as gw:
        client, key = gw.client, bearer(API_KEY)

        answer = await client.get(f"/v1/tasks/{TASK_ID}", headers=bearer(mint(TASK_ID)))
        assert answer.status_code == 200, answer.text
        # Revision 0010: a task stored before epochs gets one of its own, as a task created now does.
        upgraded = answer.json()
        assert re.fullmatch("[0-9a-f]{12}", upgraded.pop("epoch")), answer.text
        assert upgraded == TASK_JSON
        task_json = answer.json()

        answer = await client.get(f"/v1/tasks/{TASK_ID}/events", params={"cursor": 0}, headers=key)
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "mode": "delta",
            "version": 2,
            "task": task_json,
            "events": [{"version": 1, "event": START_EVENT}, {"version": 2, "event": SUCCEED_EVENT}],
        }

        # The same Idempotency-Key gets the receipt of 0.1.0, not a second delivery.
        answer = await client.post(
            f"/v1/tasks/{TASK_ID}/deliveries", headers={**key, "Idempotency-Key": "deliver-1"}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json() == {
            "ok": True,
            "duplicate": True,
            "reason": "duplicate-delivery",
            "receipt": {
                "taskId": TASK_ID,
                "resultRef": RESULT_REF,
                "resultHash": RESULT_HASH,
                "idempotencyKey": "deliver-1",
                "deliveredAtMs": CREATED + 30,
            },
        }

        # The worker's retry of the callback that succeeded the task is recognised.
        answer = await client.post(
            f"/v1/tasks/{TASK_ID}/callbacks",
            json=SUCCEED_CALLBACK,
            headers=bearer(mint(TASK_ID, "callback")),
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert (body["duplicateCallback"], body["changed"], body["task"]) == (True, False, task_json), body

        # A new task on the upgraded schema, succeeded: its notification is numbered after 0.1.0's.
        answer = await client.post(
            "/v1/tasks", json={"id": "t-new", "ttlMs": 60_000, "maxAttempts": 1}, headers=key
        )
        assert answer.status_code == 201, answer.text
        worker = bearer(answer.json()["callbackToken"])
        for event in (
            {"type": "start", "worker": "w-2"},
            {"type": "succeed", "resultRef": "r", "resultHash": "h"},
        ):
            answer = await client.post("/v1/tasks/t-new/callbacks", json={"event": event}, headers=worker)
            assert answer.status_code == 200 and answer.json()["changed"], answer.text
        new_version = answer.json()["task"]["version"]

        answer = await client.post("/v1/notifications/drain", headers=key)
        assert answer.status_code == 200, answer.text
        assert answer.json() == [
            {"taskId": TASK_ID, "state": "succeeded", "atMs": CREATED + 20, "version": 2},
            {"taskId": "t-new", "state": "succeeded", "atMs": clock.now, "version": new_version},
        ]

    async with engine_for(database_url) as engine:
        assert await version_rows(engine) == [head_revision()]
        assert await diff_with_models(engine) == []


@pytest.mark.anyio
async def test_tasks_finished_before_the_upgrade_are_retained_from_when_they_finished(
    database_url: str,
) -> None:
    """Revision 0003 gives a task that finished before it the time of its terminal notification, so that
    retention deletes it a retention after that, once its notification is drained, like any other."""
    async with engine_for(database_url) as engine:
        await make_0_1_0_database(engine)
    clock = FakeClock(CREATED + 20 + 10_000)  # a retention (10 s) after it finished
    async with running_gateway(database_url, clock=clock, api_key=API_KEY, retain_finished_s=10) as gw:
        async with engine_for(database_url) as engine, engine.connect() as conn:
            finished = await conn.execute(text("SELECT id, finished_at_ms FROM tasks"))
            assert finished.all() == [(TASK_ID, CREATED + 20)]
        key = bearer(API_KEY)
        assert (await gw.client.get(f"/v1/tasks/{TASK_ID}", headers=key)).status_code == 200  # not drained
        drained = await gw.client.post("/v1/notifications/drain", headers=key)
        assert [n["taskId"] for n in drained.json()] == [TASK_ID]
        await eventually(
            lambda: gw.client.get(f"/v1/tasks/{TASK_ID}", headers=key),
            lambda answer: answer.status_code == 404,
            "the task of 0.1.0 deleted by retention",
        )
    async with engine_for(database_url) as engine, engine.connect() as conn:
        for table in ("tasks", "entries", "callbacks", "outbox", "deliveries", "task_tags"):
            rows = await conn.execute(text(f"SELECT count(*) FROM {table}"))
            assert rows.scalar() == 0, table


# --- a database with streams, from before revision 0013 ---------------------------------------------------

STREAMED = "t-streamed"
# The batches of its stream "output" (seq 0, 1, 2 of attempt 1), as revision 0012 stored them: with their
# seq and a digest (blake2b of the array, 16 bytes), and the stream's last digest.
STREAM_BATCHES = [(0, ["a", "b"]), (2, ["é"]), (3, ['"c"\n'])]


async def make_0012_database_with_a_stream(engine: AsyncEngine) -> None:
    """A database at revision 0012 holding a running task (attempt 1) that has appended three batches to its
    stream ``output``; on PostgreSQL, an operator's autovacuum setting on ``stream_batches``."""
    async with engine.begin() as conn:
        await conn.run_sync(lambda sync: command.upgrade(alembic_config(sync), "0012"))
        if engine.dialect.name == "postgresql":
            await conn.execute(text("ALTER TABLE stream_batches SET (autovacuum_vacuum_scale_factor = 0.05)"))
        await conn.execute(
            text(
                "INSERT INTO tasks (id, state, expires_at_ms, attempts, max_attempts, progress, version, "
                "ttl_ms, created_at_ms, epoch) "
                "VALUES (:id, 'running', :exp, 1, 1, 0, 1, 600000, :created, 'e0012')"
            ),
            {"id": STREAMED, "exp": CREATED + 600_000, "created": CREATED},
        )
        start = {"type": "start", "atMs": CREATED, "worker": "w-1"}
        await conn.execute(
            text(
                "INSERT INTO entries (task_id, version, type, at_ms, event) VALUES (:t, 1, 'start', :at, :e)"
            ),
            {"t": STREAMED, "at": CREATED, "e": orjson.dumps(start)},
        )
        digests = []
        for seq, (offset, chunks) in enumerate(STREAM_BATCHES):
            encoded = orjson.dumps(chunks)
            digests.append(hashlib.blake2b(encoded, digest_size=16).digest())
            await conn.execute(
                text(
                    "INSERT INTO stream_batches (task_id, stream, first_offset, attempt, seq, count, "
                    "chunk_bytes, digest, chunks) VALUES (:t, 'output', :o, 1, :seq, :n, :size, :d, :chunks)"
                ),
                {
                    "t": STREAMED,
                    "o": offset,
                    "seq": seq,
                    "n": len(chunks),
                    "size": sum(len(c.encode()) for c in chunks),
                    "d": digests[-1],
                    "chunks": encoded,
                },
            )
        await conn.execute(
            text(
                "INSERT INTO streams (task_id, name, attempt, first_offset, next_offset, text_bytes, "
                "next_seq, last_offset, last_digest) VALUES (:t, 'output', 1, 0, 4, :size, 3, 3, :d)"
            ),
            {"t": STREAMED, "size": len('abé"c"\n'.encode()), "d": digests[-1]},
        )


@pytest.mark.anyio
async def test_a_database_with_streams_upgrades_to_rows_without_digests_or_seqs_with_its_streams_kept(
    database_url: str,
) -> None:
    """Revision 0013 makes the stream tables again without their digests and seqs: the stream reads back
    as it was, and a worker's retry of a batch appended before the upgrade, the last one or an earlier one,
    is still told by its chunks (a duplicate, or seq-reused); the next batch goes on at the next offset."""
    async with engine_for(database_url) as engine:
        await make_0012_database_with_a_stream(engine)

    clock = FakeClock(CREATED + 1_000)
    async with running_gateway(database_url, clock=clock, api_key=API_KEY) as gw:
        key, worker = bearer(API_KEY), bearer(mint(STREAMED, "callback"))
        text_read = await gw.client.get(f"/v1/tasks/{STREAMED}/streams/output/text", headers=key)
        assert text_read.status_code == 200, text_read.text
        assert (text_read.text, text_read.headers["Stream-Next-Offset"]) == ('abé"c"\n', "4")
        url = f"/v1/tasks/{STREAMED}/streams/output"
        answers: list[tuple[int, list[str], tuple[int, int, bool] | str]] = [
            (2, ['"c"\n'], (3, 4, True)),
            (0, ["a", "b"], (0, 2, True)),
            (1, ["é"], (2, 3, True)),
            (2, ["c"], "seq-reused"),
            (0, ["ab"], "seq-reused"),
            (3, ["d"], (4, 5, False)),
            (3, ["d"], (4, 5, True)),
        ]
        for seq, chunks, answer in answers:
            body = {"attempt": 1, "seq": seq, "chunks": chunks}
            sent = await gw.client.post(url, json=body, headers=worker)
            if isinstance(answer, str):
                error(sent, 409, answer)
            else:
                assert sent.status_code == 200, sent.text
                assert (sent.json()["offset"], sent.json()["nextOffset"], sent.json()["duplicate"]) == answer
        assert (await gw.client.get(f"{url}/text", headers=key)).text == 'abé"c"\nd'

    async with engine_for(database_url) as engine:
        assert await version_rows(engine) == [head_revision()]
        assert await diff_with_models(engine) == []
        if engine.dialect.name == "postgresql":
            # The tables made again keep their settings: revision 0011's, or the operator's.
            async with engine.connect() as conn:
                found = await conn.execute(
                    text(
                        "SELECT relname, reloptions FROM pg_class "
                        "WHERE relname IN ('streams', 'stream_batches') AND relkind = 'r'"
                    )
                )
                assert dict(found.all()) == {
                    "streams": ["autovacuum_vacuum_scale_factor=0.02"],
                    "stream_batches": ["autovacuum_vacuum_scale_factor=0.05"],
                }
        else:
            async with engine.connect() as conn:
                schema = await conn.execute(
                    text(
                        "SELECT name, sql FROM sqlite_schema WHERE tbl_name IN ('streams', 'stream_batches')"
                    )
                )
                rows = {name: sql for name, sql in schema.all()}
            # Both live in their key's tree: no rowid, and no index holding the key again.
            assert sorted(rows) == ["stream_batches", "streams"], rows
            assert all(sql.rstrip().endswith("WITHOUT ROWID") for sql in rows.values()), rows


# --- gateways starting together -------------------------------------------------------------------------


def running_upgrades(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The migrations that ran (the gateway says so in one line each time it migrates)."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("database schema migrated")]


@pytest.mark.postgres
@pytest.mark.anyio
async def test_processes_migrating_at_once_migrate_once(postgres_url: str) -> None:
    """Three ``gateway migrate`` processes on one empty database, let go at the same moment: the test holds
    the migration lock until all three wait for it, so they do meet. One migrates; the others wait, then
    find the database at head (running 0001 again would fail on the tables that exist)."""
    async with engine_for(postgres_url) as engine, engine.connect() as holder:
        await holder.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK_KEY})
        env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
        processes = [
            await asyncio.create_subprocess_exec(
                *GATEWAY_CLI, "migrate", "--database-url", postgres_url, env=env, stdout=PIPE, stderr=PIPE
            )
            for _ in range(3)
        ]
        try:
            await eventually(
                lambda: waiting_for_the_lock(engine),
                lambda waiting: waiting >= len(processes),
                f"all {len(processes)} gateway migrate processes waiting for the migration lock",
                within_s=30,
                poll_s=0.01,
            )
        finally:
            await holder.rollback()  # lets them go (or, on a failure, lets them end)
            outputs = [await process.communicate() for process in processes]
        assert [process.returncode for process in processes] == [0, 0, 0], outputs
        for stdout, _ in outputs:
            assert stdout.decode() == f"gateway: database at revision {head_revision()} (head)\n"
        assert await version_rows(engine) == [head_revision()]
        assert await diff_with_models(engine) == []


async def waiting_for_the_lock(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        found = await conn.execute(
            text(
                "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
                "WHERE l.locktype = 'advisory' AND NOT l.granted AND d.datname = current_database()"
            )
        )
        return int(found.scalar_one())


@pytest.mark.postgres
@pytest.mark.anyio
async def test_engines_migrating_at_once_migrate_once(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Three engines of one process on one empty database: one migrates, the others find it at head."""
    engines = [create_async_engine(async_url(postgres_url)) for _ in range(3)]
    try:
        with caplog.at_level(logging.INFO, logger="gateway.store"):
            await asyncio.gather(*(migrate(engine) for engine in engines))
        assert await version_rows(engines[0]) == [head_revision()]
        assert await diff_with_models(engines[0]) == []
    finally:
        for engine in engines:
            await engine.dispose()
    # One engine migrated (all the way to head); the others found the database at head.
    assert len(running_upgrades(caplog)) == 1, running_upgrades(caplog)


@pytest.mark.anyio
async def test_two_databases_migrated_at_once_in_one_process_each_get_their_schema(tmp_path: Path) -> None:
    """Two gateways of one process (as in these tests) starting together on two databases. Alembic keeps the
    running migration in module globals; interleaved, each would run the other's operations."""
    urls = [f"sqlite:///{tmp_path / name}" for name in ("one.db", "two.db")]
    async with engine_for(urls[0]) as one, engine_for(urls[1]) as two:
        await asyncio.gather(migrate(one), migrate(two))
        for engine in (one, two):
            assert await version_rows(engine) == [head_revision()]
            assert await diff_with_models(engine) == []


# --- gateway migrate --------------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    return subprocess.run(
        [*GATEWAY_CLI, "migrate", *args], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def test_gateway_migrate_upgrades_the_database_and_says_to_which_revision(database_url: str) -> None:
    for _ in range(2):  # a new database, then one already at head
        done = run_cli("--database-url", database_url)
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"gateway: database at revision {head_revision()} (head)\n"
        assert "Traceback" not in done.stderr


def test_gateway_migrate_refuses_an_unsupported_database_in_one_line() -> None:
    done = run_cli("--database-url", "mysql://x/y")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.startswith("gateway: ") and done.stderr.count("\n") == 1, done.stderr
    assert "mysql" in done.stderr and "Traceback" not in done.stderr


def test_gateway_migrate_reports_a_database_it_cannot_reach_in_one_line() -> None:
    # A port that is bound but not listening refuses connections: no PostgreSQL needed, no waiting.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        done = run_cli("--database-url", f"postgresql://postgres@127.0.0.1:{port}/gateway")
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith("gateway: cannot migrate the database: "), done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
