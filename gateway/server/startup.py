"""What ``gateway serve`` says it runs on, once per gateway (from the parent with ``--workers``): the
database (a SQLite file's absolute path, or PostgreSQL's host, port, database and user, never the
password), on Redis the bus and its channel, where the token secret comes from, open mode or keyed, and the
dashboard's URL."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from sqlalchemy.engine import make_url

from gateway.bus import REDIS_SCHEMES, deployment_channel
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


def describe_bus(settings: Settings, deployment_id: str) -> str | None:
    """``Redis host:port/db, channel C`` (never a password) for a Redis bus, whose channel is the
    deployment's own unless ``GATEWAY_BUS_CHANNEL`` names one; ``None`` for the others (one process, or
    PostgreSQL's LISTEN/NOTIFY on the database itself)."""
    kind = (settings.bus_url or "").strip()
    if not kind.startswith(REDIS_SCHEMES):
        return None
    parts = urlsplit(kind)
    if parts.scheme == "unix":
        where = f"socket {parts.path}"
    else:
        port = parts.port or 6379
        where = f"{parts.hostname or 'localhost'}:{port}{parts.path or '/0'}"
    channel = settings.bus_channel or deployment_channel(deployment_id)
    return f"Redis {where}, channel {channel}"


def dashboard_url(host: str, port: int) -> str:
    """The dashboard's address as a browser on this host opens it."""
    if host in ("", "0.0.0.0", "::"):  # every address: this host's loopback is one of them
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/"


def summary(settings: Settings, source: str | None, host: str, port: int, *, deployment_id: str) -> list[str]:
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
    bus = describe_bus(settings, deployment_id)
    return [
        f"database {describe_database(settings.database_url)}; {secret}; {mode}",
        *([] if bus is None else [f"bus {bus}"]),
        f"dashboard at {dashboard_url(host, port)}",
    ]


def announce(settings: Settings, source: str | None, host: str, port: int, *, deployment_id: str) -> None:
    """Log :func:`summary` at info level (stderr, with ``gateway serve``'s logging)."""
    for line in summary(settings, source, host, port, deployment_id=deployment_id):
        log.info("%s", line)
