"""Configuration, read once into an immutable object that can be passed in.

``Settings.from_environ(os.environ)`` reads the ``GATEWAY_*`` variables; tests build ``Settings(...)``
directly or pass a dict, never patch the process environment. Secrets are ``SecretStr`` so that they never
print in a log or a repr.
"""

from __future__ import annotations

import base64
import binascii
import difflib
import ipaddress
import logging
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from gateway.errors import ConfigError

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
    "tag_subscription_max": "GATEWAY_TAG_SUBSCRIPTION_MAX",
    "demo": "GATEWAY_DEMO",
    "bus_url": "GATEWAY_BUS_URL",
    "bus_channel": "GATEWAY_BUS_CHANNEL",
    "workers": "GATEWAY_WORKERS",
    "reconcile_interval_ms": "GATEWAY_RECONCILE_INTERVAL_MS",
    "notify_url": "GATEWAY_NOTIFY_URL",
    "notify_secret": "GATEWAY_NOTIFY_SECRET",
    "notify_timeout_ms": "GATEWAY_NOTIFY_TIMEOUT_MS",
    "notify_retry_min_ms": "GATEWAY_NOTIFY_RETRY_MIN_MS",
    "notify_retry_max_ms": "GATEWAY_NOTIFY_RETRY_MAX_MS",
    "notify_concurrency": "GATEWAY_NOTIFY_CONCURRENCY",
    "notify_poll_ms": "GATEWAY_NOTIFY_POLL_MS",
    "ws_ping_interval_ms": "GATEWAY_WS_PING_INTERVAL_MS",
    "max_header_bytes": "GATEWAY_MAX_HEADER_BYTES",
    "max_header_count": "GATEWAY_MAX_HEADER_COUNT",
    "header_timeout_ms": "GATEWAY_HEADER_TIMEOUT_MS",
    "body_timeout_ms": "GATEWAY_BODY_TIMEOUT_MS",
    "idle_timeout_ms": "GATEWAY_IDLE_TIMEOUT_MS",
    "ws_max_message_bytes_before_auth": "GATEWAY_WS_MAX_MESSAGE_BYTES_BEFORE_AUTH",
    "ws_max_message_bytes": "GATEWAY_WS_MAX_MESSAGE_BYTES",
    "max_connections_per_address": "GATEWAY_MAX_CONNECTIONS_PER_ADDRESS",
    "fd_reserve": "GATEWAY_FD_RESERVE",
    "callback_rate_per_s": "GATEWAY_CALLBACK_RATE_PER_S",
    "max_history_versions": "GATEWAY_MAX_HISTORY_VERSIONS",
    "slow_close_grace_ms": "GATEWAY_SLOW_CLOSE_GRACE_MS",
    "db_deadline_ms": "GATEWAY_DB_DEADLINE_MS",
    "retain_finished_s": "GATEWAY_RETAIN_FINISHED_S",
    "ws_auth_deadline_s": "GATEWAY_WS_AUTH_DEADLINE_S",
    "worker_stable_s": "GATEWAY_WORKER_STABLE_S",
    "stream_max_bytes": "GATEWAY_STREAM_MAX_BYTES",
    "stream_backlog_bytes": "GATEWAY_STREAM_BACKLOG_BYTES",
}
# GATEWAY_* variables read elsewhere than the server's settings: `gateway watch`'s defaults, the tests'.
_OTHER_VARIABLES = frozenset({"GATEWAY_URL", "GATEWAY_TOKEN", "GATEWAY_TEST_PG_URL"})
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# HS256 wants a key at least as long as its hash (RFC 7518, 3.2): a shorter secret can be guessed offline
# from any one token.
MIN_SECRET_BYTES = 32

# A bus channel by name: what Redis and a PostgreSQL identifier (NOTIFY's channel, at most 63 bytes) take.
BUS_CHANNEL = re.compile(r"[A-Za-z0-9_.:-]{1,63}")

# A webhook secret: "whsec_" + base64 of this many random bytes (Standard Webhooks: 24 to 64).
NOTIFY_KEY_BYTES = (24, 64)


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
    # The tasks a /v1/ws tag subscribe lists (newest first; "more" says some were left out), and the
    # entries its cursors map may have.
    tag_subscription_max: int = Field(1000, ge=1)
    # The server pings every WebSocket this often and drops one whose pong does not come within as long
    # again: a peer that vanished without a FIN is let go within twice this. 0 turns server pings off.
    ws_ping_interval_ms: int = Field(20_000, ge=0)
    # Demo tasks on the dashboard: None means "on where the management API is open" (open mode).
    demo: bool | None = None
    # How entries travel between processes: None is "local" on SQLite and "postgres" on PostgreSQL;
    # "redis://host:port/db" for Redis.
    bus_url: str | None = None
    # The bus's channel: None is the deployment's own on Redis (named for the id its database keeps,
    # gateway.store.deployment), "task_gateway" on PostgreSQL (whose NOTIFY is per database already).
    bus_channel: str | None = None
    # On a bus shared by several processes, how often each checks the store for entries whose message
    # was lost (a Redis outage): the most such an entry can be late.
    reconcile_interval_ms: int = Field(5_000, ge=100)
    # Processes `gateway serve` runs on one port (PostgreSQL only: a SQLite file serves one process).
    workers: int = Field(1, ge=1, le=256)
    # The webhook relay (gateway.jobs.relay): every terminal notification POSTed to this URL, signed with the
    # secret ("whsec_" + base64), until the receiver answers 2xx. None: no relay.
    notify_url: str | None = None
    notify_secret: SecretStr | None = None
    # One try, connection to answer; a process sending a notification holds it this long plus 5 s.
    notify_timeout_ms: int = Field(10_000, ge=100, le=600_000)
    # Retries wait a random time up to min(max, min * 2^(tries - 1)) ("full jitter").
    notify_retry_min_ms: int = Field(500, ge=1)
    notify_retry_max_ms: int = Field(60_000, ge=1)
    # Notifications one process sends at once.
    notify_concurrency: int = Field(8, ge=1, le=256)
    # How often the relay looks for notifications it was not woken for (other processes', retries).
    notify_poll_ms: int = Field(1_000, ge=10)
    # --- limits on what a client can hold (docs/configuration.md, Limits) ---
    # Request line and headers of one request, in bytes, and how many header lines: past either, 431.
    max_header_bytes: int = Field(16 * 1024, ge=1024)
    max_header_count: int = Field(100, ge=8)
    # From a request's first byte to the end of its headers; past it, 408 and the connection is closed.
    header_timeout_ms: int = Field(10_000, ge=1)
    # From the end of the headers to the end of the body; past it, 408 and the connection is closed.
    body_timeout_ms: int = Field(10_000, ge=1)
    # A connection with no request in progress (new, or kept alive between requests) is closed after this.
    idle_timeout_ms: int = Field(5_000, ge=1)
    # WebSocket messages a client may send: until one of its subscriptions is authorized, then after.
    ws_max_message_bytes_before_auth: int = Field(4 * 1024, ge=256)
    ws_max_message_bytes: int = Field(64 * 1024, ge=256)
    # Open connections (HTTP, WebSocket, SSE) from one client address; 0 for no limit (behind a proxy
    # every connection comes from the proxy's address).
    max_connections_per_address: int = Field(256, ge=0)
    # File descriptors kept for callbacks, health checks and the database: once the process's open
    # connections reach its soft RLIMIT_NOFILE minus this, a new WebSocket is refused (503
    # too-many-sockets) while plain requests go on. 0 for no reserve.
    fd_reserve: int = Field(256, ge=0)
    # Callbacks per second per task (with a burst of one second's worth); past it, 429 with Retry-After.
    # 0 for no limit.
    callback_rate_per_s: float = Field(100.0, ge=0)
    # History entries a task may have; past it only a callback that ends the task is taken (409
    # history-full). 0 for no limit.
    max_history_versions: int = Field(10_000, ge=0)
    # How long a connection cut for not reading (4008) keeps its socket for that close frame to reach it.
    slow_close_grace_ms: int = Field(30_000, ge=1)
    # The longest one database operation may take, its COMMIT and rollback included: past it, the request
    # is answered 503 (Retry-After) and the connection given up.
    db_deadline_ms: int = Field(10_000, ge=100, le=600_000)
    # A task finished longer ago than this is deleted with everything it owns, once its notification was
    # taken (gateway.jobs.retention). 0 keeps every task forever; at most 100 years (in milliseconds, the
    # cutoff stays within a 64-bit column's range).
    retain_finished_s: int = Field(7 * 24 * 3600, ge=0, le=100 * 365 * 24 * 3600)
    # A /v1/ws socket holding no authorized subscription for this long (since it opened, or since its last
    # subscription ended) is closed with 4408, whatever it sends meanwhile.
    ws_auth_deadline_s: float = Field(10.0, gt=0)
    # --workers: a worker that lived this long before it died counts as stable, and its slot's restart
    # delay starts again from the first (gateway.server.workers.RestartBackoff).
    worker_stable_s: float = Field(60.0, gt=0)
    # --- streams (protocol.md, Streams) ---
    # The most a stream's text (its attempt's chunks, UTF-8) may hold: past it an append is 413 stream-full.
    stream_max_bytes: int = Field(16 * 1024 * 1024, ge=1)
    # Live chunks one socket may hold unsent (merged as it falls behind): past it the socket is closed with
    # 4008, and its client resumes from its offsets.
    stream_backlog_bytes: int = Field(4 * 1024 * 1024, ge=64 * 1024)

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
                (
                    f"{_ENV.get(str(e['loc'][0]), e['loc'][0])}: {e['msg'].removeprefix('Value error, ')}"
                    if e["loc"]
                    else e["msg"].removeprefix("Value error, ")
                )
                for e in exc.errors()
            )
            raise ConfigError(problems) from None

    @field_validator("api_key", "secret")
    @classmethod
    def _not_blank(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("must not be blank (leave it unset instead)")
        return value

    @field_validator("bus_channel")
    @classmethod
    def _a_channel_name(cls, value: str | None) -> str | None:
        if value is not None and not BUS_CHANNEL.fullmatch(value):
            raise ValueError(
                f"must be 1 to 63 letters, digits, '_', '-', '.' or ':', got {value!r} (or leave it unset: "
                "each deployment then has a channel of its own)"
            )
        return value

    @field_validator("notify_url")
    @classmethod
    def _a_web_address(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"must be an http:// or https:// URL with a host, got {value!r}")
        return value

    @field_validator("notify_secret")
    @classmethod
    def _a_webhook_secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            webhook_key(value.get_secret_value())
        return value

    @model_validator(mode="after")
    def _relay_is_signed(self) -> Settings:
        if self.notify_url is not None and self.notify_secret is None:
            raise ValueError(
                "GATEWAY_NOTIFY_URL is set but GATEWAY_NOTIFY_SECRET is not: the relay signs every "
                "notification so that its receiver can tell it from a forgery; set GATEWAY_NOTIFY_SECRET "
                "to whsec_ + base64 of 32 random bytes"
            )
        if self.notify_retry_max_ms < self.notify_retry_min_ms:
            raise ValueError("GATEWAY_NOTIFY_RETRY_MAX_MS must not be below GATEWAY_NOTIFY_RETRY_MIN_MS")
        return self

    @property
    def notify_key(self) -> bytes | None:
        """The relay's signing key (the secret's base64 decoded), or ``None`` without a relay."""
        if self.notify_url is None or self.notify_secret is None:
            return None
        return webhook_key(self.notify_secret.get_secret_value())

    @field_validator("secret")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        size = 0 if value is None else len(value.get_secret_value().encode())
        if value is not None and size < MIN_SECRET_BYTES:
            raise ValueError(
                f"must be at least {MIN_SECRET_BYTES} bytes (it has {size}); "
                "make one with: python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"
            )
        return value

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, value: str) -> str:
        if value.strip().lower() not in LOG_LEVELS:
            raise ValueError(f"unknown log level {value!r} (use one of {', '.join(LOG_LEVELS)})")
        return value.strip().lower()

    @property
    def logging_level(self) -> int:
        """``log_level`` as a number for ``logging`` (uvicorn's ``trace`` is 5, below ``debug``)."""
        return 5 if self.log_level == "trace" else int(getattr(logging, self.log_level.upper()))

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

    @property
    def demo_enabled(self) -> bool:
        return self.open_mode if self.demo is None else self.demo


def webhook_key(secret: str) -> bytes:
    """The key bytes of a Standard Webhooks secret, ``whsec_`` + base64; ``ValueError`` saying what is wrong
    (never the secret itself)."""
    prefix = "whsec_"
    if not secret.startswith(prefix):
        raise ValueError("must be whsec_ followed by base64 (e.g. whsec_$(openssl rand -base64 32))")
    encoded = secret[len(prefix) :].strip()
    try:
        key = base64.b64decode(encoded + "=" * (-len(encoded) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the part after whsec_ is not valid base64") from None
    low, high = NOTIFY_KEY_BYTES
    if not low <= len(key) <= high:
        raise ValueError(f"the key must be {low} to {high} bytes (32 random bytes is usual), got {len(key)}")
    return key


def is_loopback(host: str) -> bool:
    """A loopback name or address; names compare case-insensitively, with or without the final dot."""
    host = host.strip().lower().rstrip(".")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def unknown_variables(environ: Mapping[str, str]) -> str | None:
    """A one-line warning naming each ``GATEWAY_*`` variable that nothing reads (a typo, most often), with
    the known name it is closest to; ``None`` when there is none."""
    known = set(_ENV.values()) | _OTHER_VARIABLES
    unknown = sorted(name for name in environ if name.startswith("GATEWAY_") and name not in known)
    if not unknown:
        return None
    # Compared without the common prefix, which would make every name look close to every other.
    suffixes = sorted(name.removeprefix("GATEWAY_") for name in known)
    described = []
    for name in unknown:
        close = difflib.get_close_matches(name.removeprefix("GATEWAY_"), suffixes, n=1, cutoff=0.7)
        described.append(f"{name} (did you mean GATEWAY_{close[0]}?)" if close else name)
    return f"ignoring unknown variable{'s' if len(unknown) > 1 else ''} {', '.join(described)}"
