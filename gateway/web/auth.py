"""Who may call what: the API key for management routes, task tokens for the rest, tag tokens for reading
the tasks that carry their tag (protocol.md, Tokens).

A credential is read from ``Authorization: Bearer ...`` or, where a browser cannot set headers (sockets,
SSE, links), from ``?token=``.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection

from gateway.errors import Forbidden, Unauthorized, UnknownTask
from gateway.machine import Task
from gateway.settings import Settings, is_loopback
from gateway.tokens import Scope, Tokens

# A tag token on a task without its tag, or on no task at all: one answer for both, so that ids cannot be
# probed with a tag token either.
NOT_CARRIED = "the task does not carry this token's tag"


@dataclass(frozen=True, slots=True)
class Grant:
    """What a credential that passed grants on a task route: the whole task (``tag`` None: its own token,
    the API key, open mode), or the task only if it carries ``tag`` (a tag token), which can be told only
    from the task itself: the route checks the task it reads anyway (:meth:`check`), inside
    :meth:`reading`. ``expires_at``: the token's ``exp`` (seconds since the epoch), when a token granted
    it: a live subscription ends then."""

    tag: str | None = None
    expires_at: float | None = None

    def check(self, task: Task) -> Task:
        """``task``, if this grant reads it; ``Forbidden`` otherwise."""
        if self.tag is not None and self.tag not in task.tags:
            raise Forbidden(NOT_CARRIED)
        return task

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Around the read of the task: for a tag token, no such task is the same ``Forbidden`` as a task
        without its tag (a tag token learns nothing of the tasks it may not read)."""
        try:
            yield
        except UnknownTask:
            if self.tag is None:
                raise
            raise Forbidden(NOT_CARRIED) from None


WHOLE_TASK = Grant()


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


# The task list reads its credential from the Authorization header alone (a URL ends up in logs): one sent
# as ?token= is told where it goes.
LIST_NEEDS = "the task list needs the API key, or a tag token with its tag in tag= (Authorization: Bearer)"
LIST_CREDENTIAL = (
    "the task list takes its credential from the Authorization header, never from ?token=: send "
    "Authorization: Bearer <the API key, or a tag token with its tag in tag=>"
)


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
        self._api_key_or_refuse(value)

    def task_list(self, conn: HTTPConnection) -> None:
        """The task list (``GET /v1/tasks``, with or without ``tag=``): the API key (open when none is
        configured), or a tag token whose tag is among the query's ``tag`` values (it lists only tasks
        carrying its tag; others may narrow the list). Every credential the list takes is decided here."""
        if self._api_key is None:
            return
        value = bearer(conn)
        if value is None:
            raise Unauthorized(LIST_CREDENTIAL if "token" in conn.query_params else LIST_NEEDS)
        tag = self._api_key_or_refuse(value, tag_token_lists=True)
        if tag is not None and tag not in conn.query_params.getlist("tag"):
            raise Forbidden(f"a tag token lists only the tasks carrying its tag: add tag={tag} to the query")

    def _api_key_or_refuse(self, value: str, *, tag_token_lists: bool = False) -> str | None:
        """Pass the API key (``None``), and a tag token on the task list (its tag, which the query must
        name); refuse anything else: ``Unauthorized`` for what proves nothing, ``Forbidden`` for a token of
        the gateway's."""
        if self._is_api_key(value):
            return None
        try:
            claims = self._tokens.claims(value)
        except Unauthorized:
            raise Unauthorized("invalid API key") from None
        if claims.tag is None:
            raise Forbidden("a task token cannot be used here; this route needs the API key")
        if not tag_token_lists:
            raise Forbidden("a tag token cannot be used here; this route needs the API key")
        return claims.tag

    def task(self, conn: HTTPConnection, task_id: str, scope: Scope) -> Grant:
        """A token for this task and scope. Reads (``subscribe``) also take the API key, or none in open
        mode, or a tag token (the task must carry its tag: see :class:`Grant`); callbacks take only the
        task's callback token."""
        value, from_header = credential(conn)
        return self.task_credential(value, task_id, scope, api_key_allowed=from_header)

    def task_credential(
        self,
        value: str | None,
        task_id: str,
        scope: Scope,
        *,
        api_key_allowed: bool = False,
        where: str = "a URL",
    ) -> Grant:
        """``value`` for this task and scope; ``api_key_allowed``: it came in the ``Authorization`` header,
        the one place the API key is taken from (else it authenticates nothing: it came from ``where``)."""
        if scope == "subscribe":
            if self._api_key is None:
                if value is None:
                    return WHOLE_TASK
                # Open mode: a token that is sent must still be for this task and scope.
            elif value is not None and api_key_allowed and self._is_api_key(value):
                return WHOLE_TASK
        if value is None:
            raise Unauthorized(f"missing {scope} token")
        self._no_api_key_from(value, where, callback=scope == "callback" and api_key_allowed)
        claims = self._tokens.check(value, task_id, scope)
        return Grant(claims.tag, claims.exp)

    def producer(self, conn: HTTPConnection, task_id: str) -> None:
        """A stream append's credential (protocol.md, Streams): the task's callback token, or the API key
        from the ``Authorization`` header; in open mode none, as on the management routes (a token that is
        sent must still be the task's callback token)."""
        value, from_header = credential(conn)
        if value is None and self._api_key is None:
            return
        if value is not None and from_header and self._is_api_key(value):
            return
        if value is None:
            raise Unauthorized("missing callback token (or the API key, in the Authorization header)")
        self._no_api_key_from(value, "a URL")
        self._tokens.check(value, task_id, "callback")

    def patcher(self, conn: HTTPConnection, task_id: str) -> bool:
        """A metadata patch's credential (protocol.md, Metadata): ``True`` for the task's callback token
        (its worker's patch), ``False`` for the API key from the ``Authorization`` header (a backend's), or
        none in open mode; as :meth:`producer` otherwise."""
        value, from_header = credential(conn)
        if value is None and self._api_key is None:
            return False
        if value is not None and from_header and self._is_api_key(value):
            return False
        if value is None:
            raise Unauthorized("missing callback token (or the API key, in the Authorization header)")
        self._no_api_key_from(value, "a URL")
        self._tokens.check(value, task_id, "callback")
        return True

    def tag_credential(self, value: str | None, tag: str, *, where: str) -> float | None:
        """``value`` for subscribing to ``tag`` (``where``: the message it came in): a tag token for this
        tag (its ``exp`` is returned: the subscription ends then), or none in open mode (``None``). A tag
        token for another tag or a task token is ``Forbidden``; a malformed or expired token, the API key
        (never taken from a message) or none (with an API key configured) is ``Unauthorized``."""
        if value is None:
            if self._api_key is None:
                return None
            raise Unauthorized("missing subscribe token (a tag token: POST /v1/tokens)")
        self._no_api_key_from(value, where)
        claims = self._tokens.claims(value)
        if claims.tag is None:
            raise Forbidden("a task token cannot subscribe to a tag")
        if claims.tag != tag:
            raise Forbidden("token is for another tag")
        return claims.exp

    def _no_api_key_from(self, value: str, where: str, *, callback: bool = False) -> None:
        """Refuse the API key where it is not taken: on a callback (``Forbidden``), or from ``where``."""
        if not self._is_api_key(value):
            return
        if callback:
            raise Forbidden("callbacks need the task's callback token, not the API key")
        # As on the management routes, callbacks included: a key in a URL authenticates nothing (URLs end up
        # in logs).
        raise Unauthorized(f"the API key is taken only from the Authorization header, never from {where}")
