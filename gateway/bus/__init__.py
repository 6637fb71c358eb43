"""How news of committed entries travels from the process that wrote them to every hub that pushes them.

``Bus`` is the interface (``gateway.bus.base``); the implementations, chosen by ``GATEWAY_BUS_URL``:

- ``local``: in process only (one gateway process; the default for SQLite);
- ``postgres``: LISTEN/NOTIFY on the gateway's own PostgreSQL database (the default for PostgreSQL);
- ``redis://host:port/db``: Redis pub/sub;
- ``memory://NAME``: the in-memory twin of a linking bus, for gateways in one Python process (tests).

A bus only carries news: the store stays the truth, and the hub fills anything missed from the store.
"""

from __future__ import annotations

from gateway.bus.base import DEFAULT_CHANNEL, Bus, News
from gateway.bus.local import LocalBus
from gateway.errors import ConfigError

__all__ = ["DEFAULT_CHANNEL", "Bus", "LocalBus", "News", "bus_for"]


def bus_for(bus_url: str | None, database_url: str) -> Bus:
    """The bus a gateway on ``database_url`` uses: ``bus_url`` as configured, or the database's default."""
    from sqlalchemy.engine import make_url

    is_postgres = make_url(database_url).get_backend_name() in ("postgresql", "postgres")
    kind = (bus_url or ("postgres" if is_postgres else "local")).strip()
    if kind == "local":
        return LocalBus()
    if kind in ("postgres", "postgresql"):
        if not is_postgres:
            raise ConfigError("GATEWAY_BUS_URL=postgres needs a PostgreSQL GATEWAY_DATABASE_URL")
        from gateway.bus.postgres import PostgresBus

        dsn = make_url(database_url).set(drivername="postgresql").render_as_string(hide_password=False)
        return PostgresBus(dsn)
    if kind.startswith("memory://"):
        from gateway.bus.memory import MemoryBus

        return MemoryBus(kind.removeprefix("memory://"))
    if kind.startswith(("redis://", "rediss://", "unix://")):
        from gateway.bus.redis import RedisBus

        return RedisBus(kind)
    raise ConfigError(
        f"GATEWAY_BUS_URL: unsupported bus {kind!r} (use local, postgres or redis://host:port/db)"
    )
