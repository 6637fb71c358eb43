"""A PostgreSQL cluster of one's own, never this machine's shared server: made by ``initdb`` in a temporary
directory, run by ``pg_ctl`` on a free loopback port (trust auth, user ``postgres``), stopped and removed,
files and all, when its block ends.

For the tests that stop and start PostgreSQL under a gateway (through tests/support/processes.py, which skips
a test where no cluster can be made) and for bench/workloads/retention.py, which measures PostgreSQL under
autovacuum with settings of its own (the shared server runs with ``autovacuum = off``, and its configuration
is not ours to change). Nothing here imports pytest: what is missing raises :class:`ClusterUnavailable`.
"""

from __future__ import annotations

import glob
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

import anyio


class ClusterUnavailable(RuntimeError):
    """No cluster can be made on this machine (no initdb, or root with no ``postgres`` user to run it as)."""


def postgres_bindir() -> Path:
    """The newest ``/usr/lib/postgresql/*/bin`` holding ``initdb`` and ``pg_ctl`` (Debian's layout)."""
    found = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")]
    found = [d for d in found if (d / "pg_ctl").exists()]
    if not found:
        raise ClusterUnavailable(
            "no initdb/pg_ctl under /usr/lib/postgresql/*/bin (install postgresql to make a cluster)"
        )
    return max(found, key=lambda d: int(re.sub(r"\D", "", d.parent.name) or 0))


def run_as() -> list[str]:
    """The prefix that runs initdb and pg_ctl: none as another user; as root (which initdb refuses),
    ``runuser -u postgres --``."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise ClusterUnavailable("running as root and there is no postgres user to run initdb as") from None
    runuser = shutil.which("runuser")
    if runuser is None:
        raise ClusterUnavailable("running as root and there is no runuser to run initdb as postgres")
    return [runuser, "-u", "postgres", "--"]


def check() -> None:
    """Raise :class:`ClusterUnavailable` if :func:`throwaway_postgres` cannot make a cluster here."""
    postgres_bindir()
    run_as()


def free_port() -> int:
    """A loopback port nobody listens on now (bound, read and released: another process could take it
    before the caller does, which on a test machine does not happen in practice)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ThrowawayPostgres:
    """A cluster made by ``initdb`` in a temporary directory: its user may stop it and start it again on the
    same port and data directory. Its server log is ``log``; ``settings`` go into its
    ``postgresql.conf``."""

    def __init__(
        self,
        bindir: Path,
        base: Path,
        port: int,
        run_as: list[str],
        settings: Mapping[str, str] | None = None,
    ) -> None:
        self.bindir = bindir
        self.base = base
        self.data = base / "data"
        self.log = base / "postgres.log"
        self.port = port
        self.run_as = run_as
        self.settings = dict(settings or {})
        self.up = False

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:])

    async def _run(self, program: str, *args: str, timeout_s: float = 60) -> None:
        command = [*self.run_as, str(self.bindir / program), *args]
        with anyio.fail_after(timeout_s):
            result = await anyio.run_process(command, check=False, stdin=subprocess.DEVNULL)
        if result.returncode != 0:
            output = (result.stdout + result.stderr).decode(errors="replace")
            raise RuntimeError(
                f"{' '.join(command)} exited with {result.returncode}:\n{output}\n{self.tail()}"
            )

    async def initdb(self) -> None:
        await self._run(
            "initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-locale",
            "--no-sync",
        )  # fmt: skip
        if self.settings:
            lines = "".join(f"{name} = '{value}'\n" for name, value in self.settings.items())
            with (self.data / "postgresql.conf").open("a") as conf:  # the file stays the postgres user's
                conf.write("\n# throwaway_postgres()\n" + lines)

    async def start(self) -> None:
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.base}"
        await self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "start")
        self.up = True

    async def stop(self, mode: str = "fast") -> None:
        await self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")
        self.up = False


@asynccontextmanager
async def throwaway_postgres(settings: Mapping[str, str] | None = None) -> AsyncIterator[ThrowawayPostgres]:
    """A cluster on a free loopback port (``settings`` in its ``postgresql.conf``), running when the block
    begins; stopped and removed, files and all, when it ends (its log's tail printed if the block failed).

    initdb refuses to run as root: as root (CI), the directory is given to the ``postgres`` user and initdb
    and pg_ctl run through ``runuser -u postgres --``; as another user they run directly."""
    bindir = postgres_bindir()
    prefix = run_as()
    base = Path(tempfile.mkdtemp(prefix="gw-pg-"))  # under /tmp: the postgres user can reach it
    try:
        if prefix:
            owner = pwd.getpwnam("postgres")
            os.chown(base, owner.pw_uid, owner.pw_gid)
        cluster = ThrowawayPostgres(bindir, base, free_port(), prefix, settings)
        failed = False
        try:
            await cluster.initdb()
            await cluster.start()
            yield cluster
        except BaseException:
            failed = True
            raise
        finally:
            with anyio.CancelScope(shield=True):
                if cluster.up or (cluster.data / "postmaster.pid").exists():
                    try:
                        await cluster.stop("fast")
                    except (RuntimeError, TimeoutError):
                        await cluster.stop("immediate")
            if failed:
                print(f"\n----- throwaway PostgreSQL on port {cluster.port}: {cluster.log} -----")
                print(cluster.tail())
    finally:
        shutil.rmtree(base, ignore_errors=True)
