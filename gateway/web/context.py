"""What the endpoints share, set once by ``create_app`` on the app: the :class:`~gateway.runtime.Gateway`
under them, the :class:`~gateway.web.auth.Guard`, the callbacks' rate limiter, the body limits and the
OpenAPI document. An endpoint reaches it in one step (:func:`context_of`), as it reached the variables of
the builder it was once a closure of.

It is an attribute of the app rather than an entry of Starlette's ``app.state``: a read of ``app.state``
goes through ``State.__getattr__`` after a failed attribute lookup (about 500 ns, against 70 ns here),
on every callback."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import HTTPConnection, Request

from gateway.live.feed import Feed
from gateway.runtime import Gateway
from gateway.web.auth import Guard
from gateway.web.rate import RateLimiter
from gateway.web.request_body import read_body


@dataclass(frozen=True, slots=True, eq=False)
class Context:
    gateway: Gateway
    guard: Guard
    # Callbacks and heartbeats per second per task, counted before a body is read.
    callback_rate: RateLimiter
    # What /openapi.json answers, made once for the gateway's mode.
    openapi: bytes
    body_limit: int
    body_timeout_s: float

    @classmethod
    def of(cls, gateway: Gateway, openapi: bytes) -> Context:
        settings = gateway.settings
        return cls(
            gateway,
            Guard(settings, gateway.tokens),
            RateLimiter(settings.callback_rate_per_s),
            openapi,
            settings.max_body_bytes,
            settings.body_timeout_ms / 1000,
        )

    async def body(self, request: Request) -> bytes:
        """The request's JSON body, within the size and time limits (``gateway.web.request_body``)."""
        return await read_body(request, self.body_limit, self.body_timeout_s)

    def new_feed(self) -> Feed:
        """A live connection's feed (a WebSocket's or an SSE stream's), bounded as the settings say."""
        gw = self.gateway
        return Feed(
            gw.hub,
            gw.book,
            backlog=gw.settings.subscription_backlog,
            max_subscriptions=gw.settings.max_subscriptions,
            stream_backlog=gw.settings.stream_backlog_bytes,
        )


def context_of(conn: HTTPConnection) -> Context:
    """The app's :class:`Context` (``gateway.web.app.GatewayApp.context``), for a request or a socket."""
    context: Context = conn.scope["app"].context
    return context
