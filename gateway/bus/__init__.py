"""How news of committed entries travels from the process that wrote them to every hub that pushes them.

``Bus`` is the interface (``gateway.bus.base``); the implementations, chosen by ``GATEWAY_BUS_URL``:

- ``local``: in process only (one gateway process; the default for SQLite);
- ``postgres``: LISTEN/NOTIFY on the gateway's own PostgreSQL database (the default for PostgreSQL);
- ``redis://host:port/db``: Redis pub/sub, on a channel of the deployment's own (``deployment_channel``);
- ``memory://NAME``: the in-memory twin of a linking bus, for gateways in one Python process (tests).

``GATEWAY_BUS_CHANNEL`` names the channel instead (Redis, PostgreSQL, the twin).

A bus only carries news: the store stays the truth, and the hub fills anything missed from the store.
"""

from __future__ import annotations

from gateway.bus.base import DEFAULT_CHANNEL, Bus, News, deployment_channel
from gateway.bus.local import LocalBus
from gateway.errors import ConfigError

__all__ = ["DEFAULT_CHANNEL", "REDIS_SCHEMES", "Bus", "LocalBus", "News", "bus_for", "deployment_channel"]

# The GATEWAY_BUS_URL of a Redis bus starts with one of these.
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def bus_for(bus_url: str | None, database_url: str, channel: str | None = None) -> Bus:
    """The bus a gateway on ``database_url`` uses: ``bus_url`` as configured, or the database's default;
    on ``channel`` when one is configured, else on the deployment's (named by ``Bus.join`` at start)."""
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
        return PostgresBus(dsn, channel)
    if kind.startswith("memory://"):
        from gateway.bus.memory import MemoryBus

        return MemoryBus(kind.removeprefix("memory://"), channel)
    if kind.startswith(REDIS_SCHEMES):
        from gateway.bus.redis import RedisBus

        return RedisBus(kind, channel)
    raise ConfigError(
        f"GATEWAY_BUS_URL: unsupported bus {kind!r} (use local, postgres or redis://host:port/db)"
    )
