from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import FakeClock
from tests.support.databases import (
    close_postgres_databases,
    empty_databases,
    postgres_database,
    sqlite_database,
)
from tests.support.examples import load_profile


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """The processes ``-n auto`` runs the suite on (pyproject.toml's addopts): two a core, since a test
    mostly waits (a server stopping, a process starting, a socket's timer), at least 4 and at most 8."""
    return max(4, min(8, 2 * (os.cpu_count() or 1)))


def pytest_configure(config: pytest.Config) -> None:
    # Every property test's examples, before a test module asks for its count (tests/support/examples.py).
    load_profile()
    config.addinivalue_line(
        "markers",
        "empty_database: every database this test makes (SQLite and PostgreSQL) is empty (not a copy of "
        "the template database at head), e.g. to test the migrations",
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # However the tests ended: every PostgreSQL database of this process (tests/support/databases.py).
    close_postgres_databases()
    _every_test_ran(session, exitstatus)


def _every_test_ran(session: pytest.Session, exitstatus: int | pytest.ExitCode) -> None:
    """A run that passes ran every test it collected: a scheduler that drops some (pytest-xdist's loadgroup
    did, for tests that share an id) fails the run instead of passing it short. In the process that
    reports (xdist's controller, or the only one)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if exitstatus != 0 or reporter is None or hasattr(session.config, "workerinput"):
        return
    if session.config.option.collectonly or session.shouldfail or session.shouldstop:
        return
    # One outcome a test: its call's, or its setup's where it never reached the call (a skip, an error).
    outcomes = [
        report
        for kind in ("passed", "failed", "skipped", "error", "xfailed", "xpassed")
        for report in reporter.stats.get(kind, [])
        if getattr(report, "when", None) == "call"
        or (getattr(report, "when", None) == "setup" and not report.passed)
    ]
    if len(outcomes) < session.testscollected:
        reporter.write_line(
            f"tests: {session.testscollected} collected, {len(outcomes)} ran: the run fails", red=True
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(autouse=True)
def _empty_databases_where_marked(request: pytest.FixtureRequest) -> Iterator[None]:
    # Autouse, so set up before the fixtures that make the databases (database_url, a module's own).
    if request.node.get_closest_marker("empty_database") is None:
        yield
        return
    with empty_databases():
        yield


@pytest.fixture
def anyio_backend() -> str:
    # uvicorn, asyncpg and aiosqlite run on asyncio.
    return "asyncio"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Each test that takes this runs once on a SQLite file and once on this machine's PostgreSQL (a copy
    of the template database, already migrated; an empty one for tests marked ``empty_database``)."""
    if request.param == "sqlite":
        yield sqlite_database(tmp_path / "gateway.db")
    else:
        with postgres_database() as url:
            yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A SQLite file at the newest schema (empty for tests marked ``empty_database``)."""
    return sqlite_database(tmp_path / "gateway.db")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
