"""The Python clients import nothing of the server: ``from gateway.client import watch, Worker`` (and the
backends, the sync worker) works in an interpreter where the server's packages cannot be imported at all."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SERVER_PACKAGES = (
    "starlette",
    "sqlalchemy",
    "sqlmodel",
    "uvicorn",
    "alembic",
    "asyncpg",
    "aiosqlite",
    "redis",
    "prometheus_client",
)

PROGRAM = textwrap.dedent(
    """
    import importlib.abc
    import sys

    HIDDEN = set(sys.argv[1].split(","))

    class HideServer(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in HIDDEN:
                raise ModuleNotFoundError(f"{name} is hidden from the client", name=name)
            return None

    sys.meta_path.insert(0, HideServer())

    import gateway
    from gateway.client import AsyncBackend, Backend, CallbackIgnored, ClientError, SyncWorker, Worker
    from gateway.client import WorkerError, watch

    worker = Worker("http://127.0.0.1:1", "t-1", "token")
    with Backend("http://127.0.0.1:1"), SyncWorker("http://127.0.0.1:1", "t-1", "token") as sync_worker:
        assert sync_worker.task_id == "t-1" and AsyncBackend("http://127.0.0.1:1").retries == 8
    frames = watch("http://127.0.0.1:1", {"t-1": "token"})
    assert issubclass(CallbackIgnored, WorkerError) and issubclass(WorkerError, ClientError)
    assert callable(frames.__anext__) and worker.task_id == "t-1"
    loaded = sorted({name.split(".")[0] for name in sys.modules} & HIDDEN)
    print("loaded:", ",".join(loaded))
    """
)


def test_the_client_imports_with_the_server_packages_hidden() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, ",".join(SERVER_PACKAGES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "loaded:", done.stdout


def test_the_server_still_imports_through_the_package() -> None:
    from gateway import Settings, create_app

    app = create_app(Settings(secret="s" * 32))
    assert app.state.gateway.settings.secret is not None
