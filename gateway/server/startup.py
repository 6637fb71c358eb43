"""What ``gateway serve`` says it runs on, once per gateway (from the parent with ``--workers``): the
database (a SQLite file's absolute path, or PostgreSQL's host, port, database and user, never the
password), where the token secret comes from, open mode or keyed, and the dashboard's URL."""

from __future__ import annotations

import logging

from sqlalchemy.engine import make_url

from gateway.settings import Settings

log = logging.getLogger("gateway")


def secret_source(settings: Settings, *, option: bool = False) -> str | None:
    """Where the secret ``settings`` will sign with comes from, read before the secret file is loaded: the
    option or variable, the secret file's path, or ``None`` (a random secret made at start)."""
    from gateway.secret_file import secret_path

    if settings.secret is not None:
        return "--secret" if option else "GATEWAY_SECRET"
    path = secret_path(settings)
    return None if path is None else f"the file {path}"


def describe_database(url: str) -> str:
    """``SQLite /abs/path.db`` or ``PostgreSQL user@host:port/db``, without the password."""
    from gateway.store.database import async_url, sqlite_path

    parsed = make_url(async_url(url))
    if parsed.drivername.startswith("sqlite"):
        return f"SQLite {sqlite_path(url)}"
    user = f"{parsed.username}@" if parsed.username else ""
    port = f":{parsed.port}" if parsed.port else ""
    return f"PostgreSQL {user}{parsed.host or 'localhost'}{port}/{parsed.database or ''}"


def dashboard_url(host: str, port: int) -> str:
    """The dashboard's address as a browser on this host opens it."""
    if host in ("", "0.0.0.0", "::"):  # every address: this host's loopback is one of them
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"


def summary(settings: Settings, source: str | None, host: str, port: int) -> list[str]:
    secret = (
        f"token secret from {source}"
        if source is not None
        else "token secret random, made at start (set GATEWAY_SECRET to keep tokens valid across restarts)"
    )
    mode = (
        "open mode (no API key: management API open, loopback only)"
        if settings.open_mode
        else "keyed (management API needs GATEWAY_API_KEY)"
    )
    return [
        f"database {describe_database(settings.database_url)}; {secret}; {mode}",
        f"dashboard at {dashboard_url(host, port)}",
    ]


def announce(settings: Settings, source: str | None, host: str, port: int) -> None:
    """Log :func:`summary` at info level (stderr, with ``gateway serve``'s logging)."""
    for line in summary(settings, source, host, port):
        log.info("%s", line)
