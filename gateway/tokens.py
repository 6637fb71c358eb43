"""Task tokens: JWT HS256 with claims ``sub`` (task id), ``scope`` (callback | subscribe) and ``exp``.

A backend holding ``GATEWAY_SECRET`` can mint the same tokens itself. ``exp`` is wall-clock seconds,
whatever clock the gateway was given for task time.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

import jwt

from gateway.errors import Forbidden, Unauthorized

Scope = Literal["callback", "subscribe"]
ALGORITHM = "HS256"


# Verified tokens remembered, most recent last: a worker posts many callbacks with one token, and checking
# an HS256 signature through PyJWT costs more than the rest of a callback's HTTP handling. Only tokens that
# verified are kept, with their expiry, which is checked again on every use.
VERIFIED_CACHE_SIZE = 10_000


class Tokens:
    def __init__(self, secret: str, *, grace_s: int = 24 * 3600, wall: Callable[[], float] = time.time):
        self._secret = secret
        self._grace_s = grace_s
        self._wall = wall
        self._verified: OrderedDict[str, tuple[str, str, float]] = OrderedDict()

    def issue(self, task_id: str, scope: Scope, ttl_ms: float) -> str:
        exp = int(self._wall() + ttl_ms / 1000 + self._grace_s)
        return jwt.encode({"sub": task_id, "scope": scope, "exp": exp}, self._secret, algorithm=ALGORITHM)

    def claims(self, token: str) -> tuple[str, str]:
        """``(sub, scope)`` of a well-formed, well-signed, unexpired token, or ``Unauthorized``."""
        known = self._verified.get(token)
        if known is not None:
            sub, scope, exp = known
            if self._wall() < exp:  # PyJWT's rule: expired once now >= exp
                self._verified.move_to_end(token)
                return sub, scope
            del self._verified[token]
            raise Unauthorized(EXPIRED)
        try:
            claims = jwt.decode(
                token, self._secret, algorithms=[ALGORITHM], options={"require": ["exp", "sub", "scope"]}
            )
        except jwt.InvalidTokenError as exc:
            raise Unauthorized(_what_is_wrong(exc)) from None
        sub, scope = claims["sub"], claims["scope"]
        if not isinstance(sub, str) or not isinstance(scope, str):
            raise Unauthorized("token is malformed: its sub and scope must be strings")
        exp = claims["exp"]
        if isinstance(exp, int | float) and not isinstance(exp, bool):
            self._verified[token] = (sub, scope, float(exp))
            if len(self._verified) > VERIFIED_CACHE_SIZE:
                self._verified.popitem(last=False)
        return sub, scope

    def check(self, token: str, task_id: str, scope: Scope) -> None:
        """Pass a valid token for this task and scope; ``Unauthorized`` or ``Forbidden`` otherwise.

        A valid token for another task is ``Forbidden`` whether or not the task exists, so ids cannot be
        probed (authentication is checked before existence).
        """
        sub, granted = self.claims(token)
        if sub != task_id:
            raise Forbidden("token is for another task")
        if granted != scope:
            raise Forbidden(f"token has the {granted} scope; this needs a {scope} token")


EXPIRED = "token has expired"


def _what_is_wrong(exc: jwt.InvalidTokenError) -> str:
    """PyJWT's refusal in the protocol's words ("Not enough segments" says nothing to a token's holder)."""
    if isinstance(exc, jwt.ExpiredSignatureError):
        return EXPIRED
    if isinstance(exc, jwt.InvalidSignatureError):  # before DecodeError, which it extends
        return "token signature is invalid (signed with another secret)"
    if isinstance(exc, jwt.InvalidAlgorithmError):
        return f"token is not signed with {ALGORITHM}"
    if isinstance(exc, jwt.MissingRequiredClaimError):
        return f"token is malformed: it has no {exc.claim} claim"
    if isinstance(exc, jwt.ImmatureSignatureError):
        return "token is not valid yet"
    if isinstance(exc, jwt.DecodeError):
        return "token is malformed (not a signed JWT)"
    return "token is invalid"
