"""Every code block of README.md and docs/ that claims to run is run, so that none rots
(docs/development.md, "The code blocks of the documentation"; the parsing is tests/support/doc_blocks.py).

- :func:`test_every_block_runs_or_says_why_not`: each block is text, runs here, or carries a mark, and a
  ``run by PATH`` names a file that does run it.
- :func:`test_the_blocks_of_a_page_run_as_written`: per page, a ``gateway serve`` of its own (as the README's
  first command starts it: in the page's directory, on a SQLite file and the secret kept beside it, in open
  mode; on a free port, the blocks' ``localhost:8000`` turned to it), with a RabbitMQ vhost and a Redis db of
  the test's own where the page needs a queue's broker; the page's blocks run in its order in one bash
  session (``.venv`` there is this venv). Then: every block in the background that must end has ended with
  0, every server and worker is still running, every task the page made has succeeded (but for those it
  leaves open on purpose), and the gateway refused none of the page's requests.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from redis import Redis
from redis.exceptions import RedisError

from gateway.machine import TERMINAL
from tests.support import doc_blocks, eventually, http_client, wait_until
from tests.support.celery_processes import rabbitmq_broker
from tests.support.doc_blocks import BACKGROUND, RUN_BY, UNTIL_STOPPED, Block
from tests.support.processes import DASHBOARD, GatewayProcess, free_port, unavailable

ROOT = doc_blocks.ROOT
VENV = Path(sys.prefix)
# The page bench/lib/report.py writes after each full benchmark run ("do not edit by hand"): its one block
# is the run's own command line, which CI runs as python -m bench --smoke.
GENERATED = {"docs/benchmarks.md": "bench/lib/report.py"}
# Redis dbs of this module's own (the other helpers hold 11, 12 and 13), one per run at a time.
REDIS_DBS = (14, 15)
REDIS_LOCK = "task-gateway:doc-blocks:lock"
PAGE_S = 300.0  # a page's blocks, a queue's workers starting included, on a loaded machine
STOP_S = 20.0
ACCESS = re.compile(r'"(?P<request>[A-Z]+ \S+) HTTP/1\.1" (?P<status>\d{3})')


@dataclass(frozen=True)
class Page:
    """What a page's blocks need beyond a gateway, and the tasks it leaves unfinished on purpose."""

    brokers: bool = False  # a RabbitMQ vhost and a Redis db of the test's own, in the environment
    open_tasks: frozenset[str] = field(default_factory=frozenset)


PAGES = {
    "docs/walkthrough.md": Page(),
    "docs/python.md": Page(open_tasks=frozenset({"report-44"})),  # created to show Backend, never run
    "docs/tags.md": Page(open_tasks=frozenset({"export-7", "export-8"})),  # tasks to follow, never run
    "docs/protocol.md": Page(),
    "docs/deploy.md": Page(),
    "docs/integrations.md": Page(brokers=True),
}


# --- every block runs or says why not -----------------------------------------------------------------------


def test_every_block_runs_or_says_why_not() -> None:
    """Text has no language; a block that runs here is ``sh``, ``python`` or ``sql`` on a page of PAGES;
    anything else carries a mark; ``run by PATH`` names a file of the checkout that reads the page or holds
    the block itself (``.ci/run`` runs the README's test command as written)."""
    unmarked: list[str] = []
    counted = 0
    for page in doc_blocks.pages():
        if page in GENERATED:
            assert (ROOT / GENERATED[page]).is_file() and page in (ROOT / GENERATED[page]).read_text()
            continue
        for block in doc_blocks.blocks(page):
            counted += 1
            if block.language == "":
                assert not re.match(r"\s*(curl|\.venv/bin/|python|import |from \S+ import)", block.text), (
                    f"{block.where}: code in a block without a language (give it one: sh, python, ...)"
                )
            elif block.runs_here:
                assert page in PAGES, (
                    f"{block.where}: a block that runs, on a page test_doc_blocks does not run"
                )
            elif block.mark == RUN_BY:
                assert block.runner is not None
                runner = ROOT / block.runner
                assert runner.is_file(), f"{block.where}: run by {block.runner}, which is not a file"
                said = " ".join(runner.read_text().split())
                assert page in said or " ".join(block.text.split()) in said, (
                    f"{block.where}: {block.runner} neither reads {page} nor holds the block"
                )
            elif block.mark is None:
                unmarked.append(f"{block.where} ({block.language})")
    assert unmarked == [], f"blocks that neither run nor carry a mark (docs/development.md): {unmarked}"
    assert counted > 40


def test_the_marks_are_read() -> None:
    """The parser sees the marks of the blocks this test module and the browser test rely on."""
    readme = doc_blocks.blocks("README.md")
    assert [b.runner for b in readme if b.mark == RUN_BY][:2] == [
        "tests/browser/test_first_hour.py",
        ".ci/run",
    ]
    integrations = doc_blocks.blocks("docs/integrations.md")
    assert {b.file for b in integrations if b.file} == {
        "tasks.py",
        "jobs.py",
        "reports_worker.py",
        "reports.py",
    }
    assert sum(b.mark == UNTIL_STOPPED for b in integrations) == 5
    assert any(b.mark == BACKGROUND for b in doc_blocks.blocks("docs/walkthrough.md"))
    assert doc_blocks.local("curl localhost:8000/v1 http://127.0.0.1:8000/x :80001", 4242) == (
        "curl localhost:4242/v1 http://127.0.0.1:4242/x :80001"
    )


# --- running a page -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def redis_db() -> Iterator[str]:
    """A Redis db of REDIS_DBS held by this run (a lock key with an expiry); the keys the queues made in it
    (``rq:``, ``arq:``, ``dramatiq:``) deleted at the end."""
    token = os.urandom(8).hex()
    for db in REDIS_DBS:
        url = f"redis://127.0.0.1:6379/{db}"
        client = Redis.from_url(url, socket_connect_timeout=2)
        try:
            taken = client.set(REDIS_LOCK, token, nx=True, ex=int(PAGE_S * 3))
        except (RedisError, OSError) as exc:
            unavailable(f"Redis is not reachable at {url} ({exc})")
        if not taken:
            client.close()
            continue
        try:
            yield url
        finally:
            for pattern in ("rq:*", "arq:*", "dramatiq:*"):
                for key in client.scan_iter(match=pattern, count=500):
                    client.delete(key)
            if client.get(REDIS_LOCK) == token.encode():
                client.delete(REDIS_LOCK)
            client.close()
        return
    pytest.fail(f"every Redis db of {REDIS_DBS} is held by another run of this test")


@contextlib.contextmanager
def brokers(page: Page) -> Iterator[dict[str, str]]:
    """The environment of the page's brokers (none where it needs none)."""
    if not page.brokers:
        yield {}
        return
    with rabbitmq_broker() as rabbit, redis_db() as redis_url:
        yield {"CELERY_BROKER_URL": rabbit.url, "REDIS_URL": redis_url}


def environ(extra: dict[str, str]) -> dict[str, str]:
    """A reader's environment: none of the gateway's or the queues' settings, the venv first on PATH."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "CELERY_", "TG_TEST_"))}
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    env["PYTHONUNBUFFERED"] = "1"  # each line in the log as it is printed, as a terminal shows it
    env.update(extra)
    return env


@asynccontextmanager
async def gateway_serve(directory: Path, env: dict[str, str]) -> AsyncIterator[GatewayProcess]:
    """``.venv/bin/gateway serve`` in ``directory`` on a free port (``GATEWAY_PORT``), as the README starts
    it; stopped at the end, its log's tail printed if the block failed."""
    port = free_port()
    log = directory / "gateway.log"
    with log.open("wb") as out:
        process = await anyio.open_process(
            [str(directory / ".venv" / "bin" / "gateway"), "serve"],
            stdout=out,
            stderr=out,
            cwd=directory,
            env={**env, "GATEWAY_PORT": str(port)},
        )
    gw = GatewayProcess("gateway serve", process, log)
    gw.port = port
    try:
        await gw.wait_for(DASHBOARD)
        yield gw
    except BaseException:
        print(f"\n----- gateway serve: {log} -----\n{gw.tail()}")
        raise
    finally:
        await gw.stop()


@dataclass
class Job:
    """A block running in the background: its process group and the files it leaves."""

    block: Block
    pgid: int
    log: Path
    status: Path

    def ended(self) -> int | None:
        text = self.status.read_text().strip() if self.status.exists() else ""
        return int(text) if text else None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def has_ended(self) -> bool:
        return self.ended() is not None

    def has_spoken(self) -> bool:
        return self.output() != "" or self.has_ended()


def session_script(page: str, directory: Path, port: int) -> tuple[str, list[tuple[Block, Path, Path]]]:
    """The bash session that runs ``page``'s blocks in order: each block written to ``.doc-blocks/`` (its
    gateway's address turned to ``port``), then sourced (``sh``), run by ``python`` or on ``gateway.db``
    (``sql``), or copied to the file it is; a block in the background in a process group of its own (job
    control), its exit status written when it ends."""
    blocks_dir = directory / ".doc-blocks"
    blocks_dir.mkdir()
    lines = ["set -e -o pipefail", "set -m", f"cd {directory}"]
    background: list[tuple[Block, Path, Path]] = []
    for block in doc_blocks.blocks(page):
        if not block.runs_here:
            continue
        suffix = {"sh": "sh", "python": "py", "sql": "sql"}[block.language]
        path = blocks_dir / f"{block.line}.{suffix}"
        path.write_text(doc_blocks.local(block.text, port) + "\n")
        if block.file is not None:
            lines += [f"echo '@@ {block.where}: {block.file}'", f"cp {path} {block.file}"]
            continue
        command = {
            "sh": f"source {path}",
            "python": f"python {path}",
            "sql": 'python -c \'import sqlite3, sys; db = sqlite3.connect("gateway.db", timeout=30); '
            f"db.executescript(open(sys.argv[1]).read()); db.commit()' {path}",
        }[block.language]
        if block.mark in (BACKGROUND, UNTIL_STOPPED):
            log, status = path.with_suffix(".log"), path.with_suffix(".status")
            lines += [
                f"echo '@@ {block.where}: in the background'",
                f"( ( {command} ); echo $? > {status} ) > {log} 2>&1 &",
                f"echo $! > {path.with_suffix('.pid')}",
            ]
            background.append((block, log, status))
        else:
            lines += [f"echo '@@ {block.where}'", command]
    return "\n".join(lines) + "\n", background


async def page_tasks(url: str) -> list[dict[str, Any]]:
    """Every task of the page's gateway (open mode: the list takes no credential)."""
    tasks: list[dict[str, Any]] = []
    cursor: str | None = None
    async with http_client(base_url=url, timeout=30) as client:
        while True:
            answer = await client.get(
                "/v1/tasks", params={"limit": 500, **({"cursor": cursor} if cursor else {})}
            )
            assert answer.status_code == 200, answer.text
            tasks += answer.json()["tasks"]
            cursor = answer.json()["nextCursor"]
            if cursor is None:
                return tasks


def stop(job: Job, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pgid, sig)


def group_alive(pgid: int) -> bool:
    """Whether a process of the process group ``pgid`` has not exited (a zombie has)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                return True
    return False


async def stopped(job: Job) -> None:
    """SIGTERM to the job's process group (a worker's pool included), SIGKILL past STOP_S."""
    stop(job, signal.SIGTERM)
    with contextlib.suppress(AssertionError):
        await wait_until(lambda: not group_alive(job.pgid), f"{job.block.where} to stop", STOP_S)
        return
    stop(job, signal.SIGKILL)


@pytest.mark.anyio
@pytest.mark.parametrize("page", sorted(PAGES))
async def test_the_blocks_of_a_page_run_as_written(page: str, tmp_path: Path) -> None:
    settings = PAGES[page]
    directory = tmp_path / "reader"
    directory.mkdir()
    (directory / ".venv").symlink_to(VENV)
    jobs: list[Job] = []
    with brokers(settings) as broker_env:
        env = environ(broker_env)
        async with gateway_serve(directory, env) as gw:
            script, background = session_script(page, directory, gw.port)
            try:
                with anyio.fail_after(PAGE_S):
                    done = await anyio.run_process(
                        ["bash", "-c", script],
                        check=False,
                        cwd=directory,
                        env={**env, "GATEWAY_URL": gw.url, "PYTHONPATH": str(directory)},
                        stderr=-2,  # subprocess.STDOUT: one transcript, in order
                    )
                for block, log, status in background:
                    pid_file = log.with_suffix(".pid")
                    if pid_file.exists():
                        jobs.append(Job(block, int(pid_file.read_text()), log, status))
                transcript = done.stdout.decode(errors="replace")
                assert done.returncode == 0, f"the block after the last @@ failed:\n{transcript[-6000:]}"
                await check_the_end(page, settings, gw, jobs)
            finally:
                for job in jobs:
                    if group_alive(job.pgid):
                        await stopped(job)
                    stop(job, signal.SIGKILL)


async def check_the_end(page: str, settings: Page, gw: GatewayProcess, jobs: list[Job]) -> None:
    """The page's tasks succeeded, its watchers ended with 0, its servers and workers still run, and the
    gateway refused none of its requests."""

    async def unfinished() -> list[dict[str, Any]]:
        tasks = await page_tasks(gw.url)
        return [t for t in tasks if t["id"] not in settings.open_tasks and t["state"] not in TERMINAL]

    def workers_output() -> str:
        return "\n".join(f"----- {job.block.where} -----\n{job.output()[-3000:]}" for job in jobs)

    try:
        await eventually(unfinished, lambda left: left == [], f"{page}: every task to end", 120)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{workers_output()}") from None
    tasks = await page_tasks(gw.url)
    failed = [(t["id"], t["state"], t.get("error")) for t in tasks if t["id"] not in settings.open_tasks]
    assert [f for f in failed if f[1] != "succeeded"] == [], workers_output()
    assert {t["id"] for t in tasks} >= settings.open_tasks, "a task the page leaves open is not there"
    for job in jobs:
        if job.block.mark == BACKGROUND:
            await wait_until(job.has_ended, f"{job.block.where} to end by itself", 60)
            assert job.ended() == 0, f"{job.block.where} ended with {job.ended()}:\n{job.output()}"
        else:  # a server or a worker: it has started (said something) and is still running
            await wait_until(job.has_spoken, f"{job.block.where} to say it runs", 60)
            assert job.ended() is None, f"{job.block.where} (a server) ended:\n{job.output()}"
    refused = [
        f"{m['request']} {m['status']}" for m in ACCESS.finditer(gw.output()) if int(m["status"]) >= 400
    ]
    assert refused == [], f"{page}: requests the gateway refused: {refused}"
