"""Who may call what: the API key for management routes, task tokens for the rest (protocol.md, Tokens).

A credential is read from ``Authorization: Bearer ...`` or, where a browser cannot set headers (sockets,
SSE, links), from ``?token=``.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection

from gateway.errors import Forbidden, Unauthorized
from gateway.settings import Settings, is_loopback
from gateway.tokens import Scope, Tokens


def host_name(host: str) -> str:
    """The name in a ``Host`` header, without its port: ``[::1]:8000`` -> ``::1``."""
    if host.startswith("["):
        return host[1 : host.find("]")]
    return host.rsplit(":", 1)[0]


def origin_allowed(origin: str | None, host: str | None, allowed: tuple[str, ...]) -> bool:
    """The one rule for a browser's ``Origin``, on HTTP routes and WebSocket handshakes alike.

    No ``Origin`` (not a browser: it holds a token anyway), ``*`` or a listed origin, the gateway's own
    origin (same host and port as ``Host``), or a page on a loopback origin, any port, when the gateway
    itself is reached on a loopback name (a page served on this machine to a browser on this machine).
    """
    if origin is None or "*" in allowed or origin in allowed:
        return True
    parts = urlsplit(origin)
    if host is not None and parts.netloc.lower() == host.lower():
        return True
    return host is not None and is_loopback(parts.hostname or "") and is_loopback(host_name(host))


def bearer(conn: HTTPConnection) -> str | None:
    header = conn.headers.get("authorization")
    if header is None:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthorized("Authorization must be 'Bearer <token>'")
    return value.strip()


def credential(conn: HTTPConnection) -> tuple[str | None, bool]:
    """The credential and whether it came in the ``Authorization`` header (the only place the API key is
    taken from: a query string ends up in access logs)."""
    value = bearer(conn)
    if value is not None:
        return value, True
    return conn.query_params.get("token") or None, False


class Guard:
    def __init__(self, settings: Settings, tokens: Tokens) -> None:
        self._api_key = settings.api_key.get_secret_value().encode() if settings.api_key else None
        self._tokens = tokens

    def _is_api_key(self, value: str) -> bool:
        return self._api_key is not None and hmac.compare_digest(value.encode(), self._api_key)

    def management(self, conn: HTTPConnection) -> None:
        """API key routes; open when no key is configured (loopback only, see Settings.check_bind)."""
        if self._api_key is None:
            return
        value = bearer(conn)
        if value is None:
            raise Unauthorized("this route needs the API key (Authorization: Bearer $GATEWAY_API_KEY)")
        if self._is_api_key(value):
            return
        try:
            self._tokens.claims(value)
        except Unauthorized:
            raise Unauthorized("invalid API key") from None
        raise Forbidden("a task token cannot be used here; this route needs the API key")

    def task_list(self, conn: HTTPConnection) -> None:
        """The task list (``GET /v1/tasks``, with or without ``tag=``): the API key, as a management route.
        Every credential the list takes is decided here."""
        self.management(conn)

    def task(self, conn: HTTPConnection, task_id: str, scope: Scope) -> None:
        """A token for this task and scope. Reads (``subscribe``) also take the API key, or none in open
        mode; callbacks take only the task's callback token."""
        value, from_header = credential(conn)
        self.task_credential(value, task_id, scope, api_key_allowed=from_header)

    def task_credential(
        self,
        value: str | None,
        task_id: str,
        scope: Scope,
        *,
        api_key_allowed: bool = False,
        where: str = "a URL",
    ) -> None:
        """``value`` for this task and scope; ``api_key_allowed``: it came in the ``Authorization`` header,
        the one place the API key is taken from (else it authenticates nothing: it came from ``where``)."""
        if scope == "subscribe":
            if self._api_key is None:
                if value is None:
                    return
                # Open mode: a token that is sent must still be for this task and scope.
            elif value is not None and api_key_allowed and self._is_api_key(value):
                return
        if value is None:
            raise Unauthorized(f"missing {scope} token")
        if self._is_api_key(value):
            if scope == "callback" and api_key_allowed:
                raise Forbidden("callbacks need the task's callback token, not the API key")
            # As on the management routes, callbacks included: a key in a URL authenticates nothing (URLs
            # end up in logs).
            raise Unauthorized(f"the API key is taken only from the Authorization header, never from {where}")
        self._tokens.check(value, task_id, scope)
