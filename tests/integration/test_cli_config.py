"""The ``gateway`` command as an operator meets it, run as a subprocess: a configuration it cannot use ends
in one line on stderr and a non-zero exit, never a traceback; unknown ``GATEWAY_*`` variables are named
at start; the zero-configuration gateway keeps its tokens valid across a restart (a secret file beside the
SQLite database); ``gateway token`` mints tokens a real server accepts; ``gateway --version``."""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import anyio
import jwt
import orjson
import pytest
from websockets.asyncio.client import connect

from tests.support import (
    GATEWAY_CLI,
    bearer,
    create_task,
    eventually,
    http_client,
    postgres_database,
    running_gateway,
)
from tests.support.processes import spawn_gateway

SECRET = "cli-test-secret-0123456789abcdef0123456789"
RUN_S = 60


def run_cli(
    args: list[str], tmp_path: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``gateway ARGS`` in ``tmp_path`` with no ``GATEWAY_*`` variable of this environment but ``env``."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    environ.update(env or {})
    return subprocess.run(
        [*GATEWAY_CLI, *args], capture_output=True, text=True, timeout=RUN_S, cwd=tmp_path, env=environ
    )


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one line on stderr (and nothing else there), with no traceback."""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert lines[0].startswith("gateway: ")
    return lines[0]


@pytest.mark.parametrize(
    ("env", "code", "words"),
    [
        ({"GATEWAY_DATABASE_URL": "mysql://root@127.0.0.1/tasks"}, 2, "unsupported database 'mysql'"),
        ({"GATEWAY_DATABASE_URL": "no-scheme-at-all"}, 2, "not a database URL"),
        ({"GATEWAY_DATABASE_URL": "sqlite://gateway2.db"}, 2, "three slashes before a relative path"),
        ({"GATEWAY_DATABASE_URL": "sqlite:///file:gateway.db?uri=true"}, 2, "URI filename (uri=true)"),
        (
            {"GATEWAY_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/tasks"},
            3,
            "could not start: the database",
        ),
        ({"GATEWAY_LOG_LEVEL": "loud"}, 2, "GATEWAY_LOG_LEVEL: unknown log level 'loud'"),
        ({"GATEWAY_SECRET": "too-short"}, 2, "GATEWAY_SECRET: must be at least 32 bytes (it has 9)"),
        (
            {"GATEWAY_RETAIN_FINISHED_S": "7d"},
            2,
            "GATEWAY_RETAIN_FINISHED_S: Input should be a valid integer",
        ),
        ({"GATEWAY_RETAIN_FINISHED_S": "-1"}, 2, "GATEWAY_RETAIN_FINISHED_S: Input should be greater than"),
    ],
)
def test_a_bad_setting_ends_in_one_line_and_a_nonzero_exit(
    tmp_path: Path, env: dict[str, str], code: int, words: str
) -> None:
    done = run_cli(["serve", "--port", "0"], tmp_path, env)
    assert done.returncode == code, done.stderr
    assert words in one_line(done)


def test_a_port_in_use_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli(["serve", "--port", str(port)], tmp_path)
    assert done.returncode == 2, done.stderr
    line = one_line(done)
    assert f"cannot listen on 127.0.0.1:{port}" in line and "--port" in line and "GATEWAY_PORT" in line
    assert not (tmp_path / "gateway.db").exists()  # refused before the database was made
    assert not (tmp_path / "gateway.db.lock").exists()  # ... or its lock file


def test_a_sqlite_file_in_a_missing_directory_is_refused_not_created(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such"
    done = run_cli(["serve", "--port", "0", "--database-url", f"sqlite:///{missing}/gateway.db"], tmp_path)
    assert done.returncode == 2
    assert f"the directory {missing} does not exist" in one_line(done)
    assert not (tmp_path / "no").exists()
    done = run_cli(["migrate", "--database-url", f"sqlite:///{missing}/gateway.db"], tmp_path)
    assert done.returncode == 2 and f"{missing} does not exist" in one_line(done)


@pytest.mark.parametrize(
    ("command", "url"),
    [
        (["serve", "--port", "0"], "sqlite:///:memory:"),
        (["serve", "--port", "0"], "sqlite://"),
        (["serve", "--port", "0"], "sqlite+aiosqlite:///file::memory:?cache=shared&uri=true"),
        (["serve", "--port", "0"], "sqlite:///file:gateway?mode=memory&uri=true"),
        (["migrate"], "sqlite:///:memory:"),
        (["token", "subscribe", "t-1"], "sqlite:///:memory:"),
    ],
)
def test_an_in_memory_sqlite_database_is_refused_naming_the_alternatives(
    tmp_path: Path, command: list[str], url: str
) -> None:
    done = run_cli(command, tmp_path, {"GATEWAY_DATABASE_URL": url})
    assert done.returncode == 2, done.stderr
    line = one_line(done)
    assert "GATEWAY_DATABASE_URL: an in-memory SQLite database is not supported" in line
    assert "every task would vanish with the process" in line
    assert line.endswith("use a file, sqlite:///gateway.db, or PostgreSQL")
    assert list(tmp_path.iterdir()) == []  # no file, no lock file, no secret file


@pytest.mark.anyio
async def test_unknown_variables_are_named_and_a_second_process_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/gateway.db"
    first = await spawn_gateway(
        "first", url, tmp_path / "first.log", env={"GATEWAY_SERCET": SECRET, "GATEWAY_COLOUR": "blue"}
    )
    try:
        await first.serving()
        warnings = [line for line in first.output().splitlines() if "warning:" in line]
        assert warnings == [
            "gateway: warning: ignoring unknown variables GATEWAY_COLOUR, "
            "GATEWAY_SERCET (did you mean GATEWAY_SECRET?)"
        ], first.output()

        done = await anyio.to_thread.run_sync(
            lambda: run_cli(
                ["serve", "--port", "0", "--database-url", url], tmp_path, {"GATEWAY_SECRET": SECRET}
            )
        )
        assert done.returncode == 2
        assert "another gateway process is serving" in one_line(done)
    finally:
        await first.stop()


DASHBOARD_LINE = re.compile(rb"INFO: +gateway: dashboard at (http://\S+)")


def start_lines(err: str) -> list[str]:
    """The start-up lines of ``gateway serve`` in its stderr."""
    return [line for line in err.splitlines() if re.match(r"INFO: +gateway: (database|dashboard) ", line)]


@pytest.mark.anyio
async def test_serve_says_on_stderr_what_it_runs_on_zero_config(tmp_path: Path) -> None:
    """The README's first command: which file, which secret, open mode, and the dashboard's URL."""
    err, out = tmp_path / "serve.err", tmp_path / "serve.out"
    gw = await spawn_gateway("zero", "sqlite:///gateway.db", err, stdout=out, env={"GATEWAY_SECRET": ""})
    try:
        await gw.serving()
        dashboard = (await gw.wait_for(DASHBOARD_LINE))[0].group(1).decode()
        lines = start_lines(gw.output())
        assert len(lines) == 2, gw.output()
        assert lines[0].endswith(
            f"gateway: database SQLite {tmp_path}/gateway.db; token secret from the file "
            f"{tmp_path}/gateway.db.secret; open mode (no API key: management API open, loopback only)"
        ), lines
        assert dashboard == f"{gw.url}/"
        async with http_client(timeout=10) as client:
            page = await client.get(dashboard)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert start_lines(out.read_text()) == []  # stderr only
    finally:
        await gw.stop()


@pytest.mark.anyio
async def test_ctrl_c_stops_serve_cleanly_without_a_traceback(tmp_path: Path) -> None:
    """Ctrl-C is how a newcomer stops the README's first command: a clean stop, exit 0, no traceback; and
    the demo worker's HTTP requests are not logged one line each."""
    err = tmp_path / "serve.err"
    gw = await spawn_gateway("ctrl-c", "sqlite:///gateway.db", err, env={"GATEWAY_SECRET": SECRET})
    try:
        await gw.serving()
        async with http_client(base_url=gw.url, timeout=10) as client:
            started = await client.post("/v1/demo/tasks")
            assert started.status_code == 201, started.text
            task_id = started.json()["task"]["id"]

            async def version() -> int:
                return int((await client.get(f"/v1/tasks/{task_id}")).json()["version"])

            # Polling the task as a client would; its worker reports.
            await eventually(
                version, lambda v: v >= 3, f"the demo task {task_id} at version 3", within_s=30, poll_s=0.1
            )
    finally:
        code = await gw.stop(signal.SIGINT)
    output = gw.output()
    assert code == 0, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert "Application shutdown complete" in output
    assert "httpx" not in output, output


@pytest.fixture
def pg_database() -> Iterator[str]:
    with postgres_database() as url:
        yield url


@pytest.mark.anyio
@pytest.mark.postgres
async def test_serve_names_the_postgresql_database_without_its_password(
    pg_database: str, tmp_path: Path
) -> None:
    # Trust authentication ignores the password; the gateway must not repeat it.
    with_password = pg_database.replace("postgresql://postgres@", "postgresql://postgres:hunter2@")
    assert with_password != pg_database
    gw = await spawn_gateway(
        "pg",
        with_password,
        tmp_path / "serve.err",
        stdout=tmp_path / "serve.out",
        env={"GATEWAY_API_KEY": "operator-key"},
    )
    try:
        await gw.wait_for(DASHBOARD_LINE)
        lines = start_lines(gw.output())
        name = pg_database.rsplit("/", 1)[1]
        assert len(lines) == 2 and lines[0].endswith(
            f"gateway: database PostgreSQL postgres@127.0.0.1:5432/{name}; token secret from "
            "GATEWAY_SECRET; keyed (management API needs GATEWAY_API_KEY)"
        ), lines
        assert "hunter2" not in gw.output() and "operator-key" not in gw.output()
    finally:
        await gw.stop()


async def subscribe_once(base_url: str, task_id: str, token: str) -> dict[str, object]:
    """The first frame of a WebSocket subscription with ``token``."""
    ws_url = base_url.replace("http://", "ws://") + f"/v1/tasks/{task_id}/ws?cursor=0&token={token}"
    async with connect(ws_url, open_timeout=10, close_timeout=2) as ws:
        with anyio.fail_after(10):
            frame: dict[str, object] = orjson.loads(await ws.recv())
            return frame


@pytest.mark.anyio
async def test_tokens_of_the_zero_config_gateway_survive_a_restart(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/gateway.db"
    no_secret = {"GATEWAY_SECRET": ""}  # the zero-configuration default: no GATEWAY_SECRET
    before = await spawn_gateway("before", url, tmp_path / "before.log", env=no_secret)
    try:
        await before.serving()
        async with http_client(base_url=before.url, timeout=10) as client:
            made = await create_task(client, "kept-1", ttl_ms=600_000)
    finally:
        await before.stop()
    secret_file = tmp_path / "gateway.db.secret"
    assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600

    after = await spawn_gateway("after", url, tmp_path / "after.log", env=no_secret)
    try:
        await after.serving()
        frame = await subscribe_once(after.url, "kept-1", made.subscribe_token)
        assert frame["type"] == "caught-up", frame
        async with http_client(base_url=after.url, timeout=10) as client:
            answer = await client.post(
                "/v1/tasks/kept-1/callbacks",
                json={"event": {"type": "start", "worker": "w"}},
                headers=bearer(made.callback_token),
            )
            assert answer.status_code == 200 and answer.json()["reason"] == "started", answer.text

        # `gateway token` signs with the same secret file, with no GATEWAY_SECRET either.
        minted = await anyio.to_thread.run_sync(
            lambda: run_cli(["token", "subscribe", "kept-1", "--database-url", url], tmp_path)
        )
        assert minted.returncode == 0 and minted.stderr == "", minted.stderr
        frame = await subscribe_once(after.url, "kept-1", minted.stdout.strip())
        assert frame["type"] == "delta" and frame["version"] == 1, frame
    finally:
        await after.stop()


@pytest.mark.parametrize(
    ("mode", "content", "words"),
    [
        (0o644, "s" * 43 + "\n", "is open to other users (mode 644)"),
        (0o600, "short\n", "is malformed"),
    ],
)
def test_a_secret_file_open_to_others_or_malformed_is_refused(
    tmp_path: Path, mode: int, content: str, words: str
) -> None:
    secret_file = tmp_path / "gateway.db.secret"
    secret_file.write_text(content)
    secret_file.chmod(mode)
    done = run_cli(["serve", "--port", "0", "--database-url", f"sqlite:///{tmp_path}/gateway.db"], tmp_path)
    assert done.returncode == 2
    assert f"{secret_file} {words}" in one_line(done)
    assert secret_file.read_text() == content  # left as it was


@pytest.mark.anyio
async def test_gateway_token_mints_tokens_a_real_server_accepts(sqlite_url: str, tmp_path: Path) -> None:
    async with running_gateway(sqlite_url, secret=SECRET) as gw:
        await create_task(gw, "ops-1", ttl_ms=600_000)
        env = {"GATEWAY_SECRET": SECRET}
        subscribe = await anyio.to_thread.run_sync(
            lambda: run_cli(["token", "subscribe", "ops-1", "--ttl", "15m"], tmp_path, env)
        )
        callback = await anyio.to_thread.run_sync(
            lambda: run_cli(["token", "callback", "ops-1"], tmp_path, env)
        )
        for done in (subscribe, callback):
            assert done.returncode == 0 and done.stderr == "", done.stderr
            assert len(done.stdout.splitlines()) == 1  # only the token

        answer = await gw.client.post(
            "/v1/tasks/ops-1/callbacks",
            json={"event": {"type": "start", "worker": "ops"}},
            headers=bearer(callback.stdout.strip()),
        )
        assert answer.status_code == 200 and answer.json()["reason"] == "started", answer.text
        frame = await subscribe_once(gw.url, "ops-1", subscribe.stdout.strip())
        assert frame["type"] == "delta" and frame["version"] == 1, frame
        # Each token opens only its own scope.
        answer = await gw.client.get("/v1/tasks/ops-1", headers=bearer(callback.stdout.strip()))
        assert answer.status_code == 403 and "subscribe token" in answer.json()["error"]["message"]

    no_secret = run_cli(["token", "subscribe", "ops-1", "--database-url", sqlite_url], tmp_path)
    assert no_secret.returncode == 2 and "no secret to sign with" in one_line(no_secret)
    bad_ttl = run_cli(["token", "subscribe", "ops-1", "--ttl", "soon"], tmp_path, {"GATEWAY_SECRET": SECRET})
    assert bad_ttl.returncode == 2 and "--ttl" in one_line(bad_ttl)


@pytest.mark.anyio
async def test_gateway_token_mints_a_tag_token_a_real_server_takes(sqlite_url: str, tmp_path: Path) -> None:
    env = {"GATEWAY_SECRET": SECRET}
    done = await anyio.to_thread.run_sync(
        lambda: run_cli(["token", "subscribe", "--tag", "owner:u42", "--ttl", "2h"], tmp_path, env)
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert len(done.stdout.splitlines()) == 1  # only the token
    token = done.stdout.strip()
    claims = jwt.decode(token, SECRET, algorithms=["HS256"])
    assert set(claims) == {"tag", "scope", "exp"} and claims["tag"] == "owner:u42"
    assert claims["scope"] == "subscribe" and 7100 < claims["exp"] - time.time() <= 7200
    async with running_gateway(sqlite_url, secret=SECRET, api_key="cli-key") as gw:
        await create_task(gw, "ops-1", tags=["owner:u42"], headers=bearer("cli-key"))
        await create_task(gw, "ops-2", headers=bearer("cli-key"))
        answer = await gw.client.get("/v1/tasks/ops-1", headers=bearer(token))
        assert answer.status_code == 200 and answer.json()["tags"] == ["owner:u42"], answer.text
        frame = await subscribe_once(gw.url, "ops-1", token)
        assert frame["type"] == "caught-up", frame
        # A tag token reads only the tasks carrying its tag.
        answer = await gw.client.get("/v1/tasks/ops-2", headers=bearer(token))
        assert answer.status_code == 403, answer.text
        assert answer.json()["error"]["message"] == "the task does not carry this token's tag"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["subscribe", "ops-1", "--tag", "owner:u42"], "give a task id or --tag, not both"),
        (["subscribe"], "give a task id (a task's token) or --tag TAG (a tag token)"),
        (["callback", "--tag", "owner:u42"], "--tag makes a subscribe token"),
        (["subscribe", "--tag", "owner u42"], "--tag: 'owner u42' is not a tag: a tag is 1 to 128"),
        (["subscribe", "--tag", "owner:u42", "--ttl", "366d"], "a tag token lasts at most 31536000 s"),
    ],
)
def test_gateway_token_refuses_a_task_and_a_tag_at_once_or_a_bad_tag(
    tmp_path: Path, args: list[str], words: str
) -> None:
    done = run_cli(["token", *args], tmp_path, {"GATEWAY_SECRET": SECRET})
    assert done.returncode == 2 and done.stdout == ""
    assert words in one_line(done)


@pytest.mark.anyio
async def test_gateway_token_says_when_the_task_does_not_exist_yet(sqlite_url: str, tmp_path: Path) -> None:
    """A typo in the id is said on stderr; the token is still printed, and works once the task exists."""
    env = {"GATEWAY_SECRET": SECRET, "GATEWAY_DATABASE_URL": sqlite_url}
    async with running_gateway(sqlite_url, secret=SECRET) as gw:
        await create_task(gw, "ops-1", ttl_ms=600_000)
        known, unknown = await anyio.to_thread.run_sync(
            lambda: (
                run_cli(["token", "subscribe", "ops-1"], tmp_path, env),
                run_cli(["token", "subscribe", "ops-2"], tmp_path, env),
            )
        )
        assert known.returncode == 0 and known.stderr == "", known.stderr
        assert unknown.returncode == 0 and len(unknown.stdout.splitlines()) == 1
        path = sqlite_url.removeprefix("sqlite:///")
        assert one_line(unknown) == (
            f"gateway: note: no task 'ops-2' in SQLite {path} yet; the token works once a task with this id "
            "is created"
        )
        await create_task(gw, "ops-2", ttl_ms=600_000)
        frame = await subscribe_once(gw.url, "ops-2", unknown.stdout.strip())
        assert frame["type"] == "caught-up", frame

    # Where it cannot be told, nothing is said (and no database is made to find out).
    for url in (f"sqlite:///{tmp_path}/none.db", "postgresql://postgres@127.0.0.1:1/none"):
        done = run_cli(
            ["token", "callback", "ops-3", "--database-url", url], tmp_path, {"GATEWAY_SECRET": SECRET}
        )
        assert done.returncode == 0 and done.stderr == "" and len(done.stdout.splitlines()) == 1, done
    assert not (tmp_path / "none.db").exists()


@pytest.mark.postgres
def test_gateway_token_says_when_the_task_is_not_in_postgresql(pg_database: str, tmp_path: Path) -> None:
    done = run_cli(
        ["token", "subscribe", "ops-9", "--database-url", pg_database], tmp_path, {"GATEWAY_SECRET": SECRET}
    )
    assert done.returncode == 0 and len(done.stdout.splitlines()) == 1
    assert "gateway: note: no task 'ops-9' in PostgreSQL postgres@127.0.0.1:5432/" in one_line(done)


def test_gateway_version_prints_the_package_version(tmp_path: Path) -> None:
    done = run_cli(["--version"], tmp_path)
    assert done.returncode == 0
    assert done.stdout == f"gateway {version('task-gateway')}\n"
