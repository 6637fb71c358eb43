"""Configuration, read once into an immutable object that can be passed in.

``Settings.from_environ(os.environ)`` reads the ``GATEWAY_*`` variables; tests build ``Settings(...)``
directly or pass a dict, never patch the process environment. Secrets are ``SecretStr`` so that they never
print in a log or a repr.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

DEFAULT_DATABASE_URL = "sqlite:///gateway.db"

_ENV = {
    "host": "GATEWAY_HOST",
    "port": "GATEWAY_PORT",
    "database_url": "GATEWAY_DATABASE_URL",
    "secret": "GATEWAY_SECRET",
    "api_key": "GATEWAY_API_KEY",
    "max_body_bytes": "GATEWAY_MAX_BODY_BYTES",
    "retention_versions": "GATEWAY_RETENTION_VERSIONS",
    "sweep_interval_ms": "GATEWAY_SWEEP_INTERVAL_MS",
    "token_grace_s": "GATEWAY_TOKEN_GRACE_S",
    "allowed_origins": "GATEWAY_ALLOWED_ORIGINS",
    "log_level": "GATEWAY_LOG_LEVEL",
    "subscription_backlog": "GATEWAY_SUBSCRIPTION_BACKLOG",
    "write_timeout_ms": "GATEWAY_WRITE_TIMEOUT_MS",
    "max_subscriptions": "GATEWAY_MAX_SUBSCRIPTIONS",
    "demo": "GATEWAY_DEMO",
    "bus_url": "GATEWAY_BUS_URL",
    "workers": "GATEWAY_WORKERS",
    "reconcile_interval_ms": "GATEWAY_RECONCILE_INTERVAL_MS",
}


class ConfigError(Exception):
    """The configuration cannot be used; the message says which setting and why."""


class Settings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    database_url: str = DEFAULT_DATABASE_URL
    secret: SecretStr | None = None
    api_key: SecretStr | None = None
    max_body_bytes: int = Field(64 * 1024, ge=1)
    retention_versions: int = Field(8, ge=0)
    # 0 turns the background sweeper off (tests drive it by hand).
    sweep_interval_ms: int = Field(200, ge=0)
    # A token lives for the task's TTL plus this grace (protocol.md: 24 hours by default).
    token_grace_s: int = Field(24 * 3600, ge=0)
    # Origins allowed on WebSocket handshakes; "*" allows any. Empty: same-host only.
    allowed_origins: tuple[str, ...] = ()
    log_level: str = "info"
    # Live entries one subscription may hold unsent before they collapse into a conflated snapshot.
    subscription_backlog: int = Field(256, ge=1)
    # A socket whose write makes no progress for this long is closed with 4008 (slow consumer).
    write_timeout_ms: int = Field(10_000, ge=1)
    max_subscriptions: int = Field(1000, ge=1)
    # Demo tasks on the dashboard: None means "on where the management API is open" (open mode).
    demo: bool | None = None
    # How entries travel between processes: None is "local" on SQLite and "postgres" on PostgreSQL;
    # "redis://host:port/db" for Redis.
    bus_url: str | None = None
    # On a bus shared by several processes, how often each checks the store for entries whose message
    # was lost (a Redis outage): the most such an entry can be late.
    reconcile_interval_ms: int = Field(5_000, ge=100)
    # Processes `gateway serve` runs on one port (PostgreSQL only: a SQLite file serves one process).
    workers: int = Field(1, ge=1, le=256)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], **overrides: Any) -> Settings:
        values: dict[str, Any] = {}
        for field, name in _ENV.items():
            raw = environ.get(name)
            if raw is None or raw == "":
                continue
            if field == "allowed_origins":
                values[field] = tuple(o.strip() for o in raw.split(",") if o.strip())
            else:
                values[field] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            problems = "; ".join(
                f"{_ENV.get(str(e['loc'][0]), e['loc'][0])}: {e['msg']}" for e in exc.errors()
            )
            raise ConfigError(problems) from None

    @field_validator("api_key", "secret")
    @classmethod
    def _not_blank(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("must not be blank (leave it unset instead)")
        return value

    @property
    def open_mode(self) -> bool:
        """No API key: management routes are open, which is allowed on loopback only."""
        return self.api_key is None

    def check_bind(self) -> None:
        """Refuse to serve the open management API anywhere but loopback."""
        if self.open_mode and not is_loopback(self.host):
            raise ConfigError(
                f"refusing to bind {self.host} without GATEWAY_API_KEY: with no API key the management "
                "API is open, which is only allowed on a loopback address (127.0.0.1, ::1, localhost)"
            )

    @property
    def is_sqlite(self) -> bool:
        return self.database_url.strip().lower().startswith("sqlite")

    def check_processes(self) -> None:
        """Refuse a second process on a SQLite file (``--workers``, or a file another gateway serves)."""
        if not self.is_sqlite:
            return
        if self.workers > 1:
            raise ConfigError(
                f"--workers {self.workers}: a SQLite gateway runs as one process; set GATEWAY_DATABASE_URL "
                "to a PostgreSQL database to run several"
            )
        from gateway.store.database import check_sqlite_free

        check_sqlite_free(self.database_url)

    @property
    def demo_enabled(self) -> bool:
        return self.open_mode if self.demo is None else self.demo


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
