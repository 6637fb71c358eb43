from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import FakeClock, postgres_database


@pytest.fixture
def anyio_backend() -> str:
    # uvicorn, asyncpg and aiosqlite run on asyncio.
    return "asyncio"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Each test that takes this runs once on a SQLite file and once on this machine's PostgreSQL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'gateway.db'}"
    else:
        with postgres_database() as url:
            yield url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'gateway.db'}"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
