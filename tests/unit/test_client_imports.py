"""The Python clients and the queue integrations import nothing of the server: ``from gateway.client import
watch, Worker`` (the backends and the sync worker too) and ``from gateway.integrations.celery import
install, progress`` (RQ's, arq's, Dramatiq's and the run reporter under them) work in an interpreter where
the server's packages cannot be imported at all, and leave no module of the server loaded.

Each import runs in a fresh interpreter that hides the server's third-party packages, less those the queue
itself needs (RQ, arq and Dramatiq's Redis broker talk to Redis through ``redis``); then the modules it
loaded are checked against the server's own: every ``gateway`` module outside ``gateway.client`` and
``gateway.integrations``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

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

# argv: the packages to hide, then the statements to run (each may use what the ones before imported).
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

    exec(sys.argv[2])
    loaded = sorted({name.split(".")[0] for name in sys.modules} & HIDDEN)
    print("loaded:", ",".join(loaded))
    LIGHT = ("gateway.client", "gateway.integrations")
    server = sorted(
        name for name in sys.modules
        if name.startswith("gateway.") and name.split(".")[0] + "." + name.split(".")[1] not in LIGHT
    )
    print("server modules:", ",".join(server))
    """
)

CLIENT = """
from gateway.client import AsyncBackend, Backend, CallbackIgnored, ClientError, SyncWorker, Worker
from gateway.client import WorkerError, watch

worker = Worker("http://127.0.0.1:1", "t-1", "token")
with Backend("http://127.0.0.1:1"), SyncWorker("http://127.0.0.1:1", "t-1", "token") as sync_worker:
    assert sync_worker.task_id == "t-1" and AsyncBackend("http://127.0.0.1:1").retries == 8
frames = watch("http://127.0.0.1:1", {"t-1": "token"})
assert issubclass(CallbackIgnored, WorkerError) and issubclass(WorkerError, ClientError)
assert callable(frames.__anext__) and worker.task_id == "t-1"
"""

# The integrations (issue 19): each module, and the names its users write (docs/integrations.md).
INTEGRATIONS = {
    "report": (
        "from gateway.integrations.report import GatewayConfig, Reporter, current_run, progress, aprogress\n"
        "assert current_run() is None and callable(progress) and callable(aprogress)\n"
        "assert GatewayConfig(url='http://127.0.0.1:1').url == 'http://127.0.0.1:1' and Reporter\n",
        (),
    ),
    "celery": (
        "from gateway.integrations.celery import install, progress\n"
        "assert callable(install) and callable(progress)\n",
        (),
    ),
    "rq": ("from gateway.integrations.rq import progress\nassert callable(progress)\n", ("redis",)),
    "arq": ("from gateway.integrations.arq import progress\nassert callable(progress)\n", ("redis",)),
    # Dramatiq's Redis broker needs the redis client too.
    "dramatiq": (
        "from gateway.integrations.dramatiq import install, progress\n"
        "assert callable(install) and callable(progress)\n",
        ("redis",),
    ),
}


def _run(statements: str, hidden: tuple[str, ...]) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, ",".join(hidden), statements],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return [line.strip() for line in done.stdout.splitlines()]


def test_the_client_imports_with_the_server_packages_hidden() -> None:
    assert _run(CLIENT, SERVER_PACKAGES) == ["loaded:", "server modules:"]


@pytest.mark.parametrize("name", sorted(INTEGRATIONS))
def test_each_integration_imports_with_the_server_packages_hidden(name: str) -> None:
    statements, needs = INTEGRATIONS[name]
    hidden = tuple(p for p in SERVER_PACKAGES if p not in needs)
    assert _run(statements, hidden) == ["loaded:", "server modules:"]


def test_the_check_sees_a_server_module_and_a_hidden_package() -> None:
    """The two checks above can fail: a server module imported, or a hidden package asked for, shows."""
    assert "gateway.machine" in _run("import gateway.machine", SERVER_PACKAGES)[1]
    assert _run("import gateway.web.app", ())[1].startswith("server modules: gateway.")
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, "redis", "import redis"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "redis is hidden from the client" in done.stderr


def test_the_server_still_imports_through_the_package() -> None:
    from gateway import Settings, create_app

    app = create_app(Settings(secret="s" * 32))
    assert app.state.gateway.settings.secret is not None
