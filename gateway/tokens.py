"""Tokens: JWT HS256, signed with ``GATEWAY_SECRET`` (protocol.md, Tokens).

Two kinds, never taken for each other: a **task token** has ``sub`` (the task id), ``scope`` (callback |
subscribe) and ``exp``; a **tag token** has ``tag``, ``scope: "subscribe"`` and ``exp``, and reads every task
carrying its tag. A token with both ``sub`` and ``tag``, or neither, is malformed.

A backend holding ``GATEWAY_SECRET`` can mint the same tokens itself. ``exp`` is wall-clock seconds,
whatever clock the gateway was given for task time.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Literal, NamedTuple

import jwt
from jwt.types import Options

from gateway.errors import Forbidden, Unauthorized
from gateway.tag_names import tag_problem

Scope = Literal["callback", "subscribe"]
ALGORITHM = "HS256"
# The longest a tag token may last: a year (POST /v1/tokens' ttlS, gateway token --tag's --ttl).
MAX_TAG_TOKEN_TTL_S = 365 * 86_400


# Verified tokens remembered, most recent last: a worker posts many callbacks with one token, and checking
# an HS256 signature through PyJWT costs more than the rest of a callback's HTTP handling. Only tokens that
# verified are kept, with their expiry, which is checked again on every use.
VERIFIED_CACHE_SIZE = 10_000


class Claims(NamedTuple):
    """What a verified token grants: one task (``task_id``) or the tasks carrying ``tag``, in ``scope``,
    until ``exp`` (seconds since the epoch): a live subscription it authorized ends then."""

    task_id: str | None
    tag: str | None
    scope: str
    exp: float


class Tokens:
    def __init__(self, secret: str, *, grace_s: int = 24 * 3600, wall: Callable[[], float] = time.time):
        self._secret = secret
        self._grace_s = grace_s
        self._wall = wall
        self._verified: OrderedDict[str, tuple[Claims, float]] = OrderedDict()

    def issue(self, task_id: str, scope: Scope, ttl_ms: float) -> str:
        exp = int(self._wall() + ttl_ms / 1000 + self._grace_s)
        return jwt.encode({"sub": task_id, "scope": scope, "exp": exp}, self._secret, algorithm=ALGORITHM)

    def issue_tag(self, tag: str, ttl_s: int) -> tuple[str, int]:
        """A tag token valid for ``ttl_s`` seconds from now (no grace: the caller chose its life), and its
        ``exp`` (epoch seconds)."""
        exp = int(self._wall() + ttl_s)
        claims = {"tag": tag, "scope": "subscribe", "exp": exp}
        return jwt.encode(claims, self._secret, algorithm=ALGORITHM), exp

    def claims(self, token: str) -> Claims:
        """The claims of a well-formed, well-signed, unexpired token, or ``Unauthorized``."""
        known = self._verified.get(token)
        if known is not None:
            claims, exp = known
            if self._wall() < exp:  # PyJWT's rule: expired once now >= exp
                self._verified.move_to_end(token)
                return claims
            del self._verified[token]
            raise Unauthorized(EXPIRED)
        try:
            decoded = jwt.decode(token, self._secret, algorithms=[ALGORITHM], options=_SIGNATURE_AND_CLAIMS)
        except jwt.InvalidTokenError as exc:
            raise Unauthorized(_what_is_wrong(exc)) from None
        exp = _valid_now(decoded, self._wall())
        claims = _claims(decoded, exp)
        self._verified[token] = (claims, exp)
        if len(self._verified) > VERIFIED_CACHE_SIZE:
            self._verified.popitem(last=False)
        return claims

    def check(self, token: str, task_id: str, scope: Scope) -> Claims:
        """Pass a valid token for this task and scope; a tag token where a read is asked for (``subscribe``)
        passes too, its claims naming the tag, which the task must carry (the caller checks it on the task
        it reads); ``Unauthorized`` or ``Forbidden`` otherwise.

        A valid token for another task is ``Forbidden`` whether or not the task exists, so ids cannot be
        probed (authentication is checked before existence).
        """
        claims = self.claims(token)
        if claims.tag is not None:
            if scope != "subscribe":
                raise Forbidden(f"a tag token only reads tasks; this needs the task's {scope} token")
            return claims
        if claims.task_id != task_id:
            raise Forbidden("token is for another task")
        if claims.scope != scope:
            raise Forbidden(f"token has the {claims.scope} scope; this needs a {scope} token")
        return claims


EXPIRED = "token has expired"
# RFC 7519's NumericDate claims: JSON numbers of seconds since the epoch.
NUMERIC_DATES = ("exp", "nbf", "iat")
# PyJWT checks the signature and that the claims are there; the times are checked here (PyJWT would take a
# NumericDate sent as a numeric string, converted).
_SIGNATURE_AND_CLAIMS: Options = {
    "require": ["exp", "scope"],
    "verify_exp": False,
    "verify_nbf": False,
    "verify_iat": False,
}


def _valid_now(decoded: dict[str, object], now: float) -> float:
    """The token's ``exp``, once its NumericDate claims are finite JSON numbers that hold at ``now``
    (expired once ``now >= exp``; not valid yet before ``nbf`` or ``iat``, as PyJWT has it); ``Unauthorized``
    otherwise."""
    dates: dict[str, float] = {}
    for claim in NUMERIC_DATES:
        if claim in decoded:
            value = decoded[claim]
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise Unauthorized(f"token is malformed: its {claim} claim must be a number")
            dates[claim] = value
    if now >= dates["exp"]:
        raise Unauthorized(EXPIRED)
    if now < dates.get("nbf", now) or now < dates.get("iat", now):
        raise Unauthorized("token is not valid yet")
    return float(dates["exp"])


def _claims(decoded: dict[str, object], exp: float) -> Claims:
    """A verified token's claims, a task token or a tag token and never both (``Unauthorized`` else)."""
    sub, tag, scope = decoded.get("sub"), decoded.get("tag"), decoded["scope"]
    if ("sub" in decoded) == ("tag" in decoded):
        raise Unauthorized("token is malformed: it must have a sub claim (a task) or a tag claim, not both")
    if not isinstance(scope, str):
        raise Unauthorized("token is malformed: its scope must be a string")
    if "tag" in decoded:
        if tag_problem(tag) is not None:
            raise Unauthorized("token is malformed: its tag claim is not a tag")
        if scope != "subscribe":
            raise Unauthorized("token is malformed: a tag token's scope must be subscribe")
        assert isinstance(tag, str)
        return Claims(None, tag, scope, exp)
    if not isinstance(sub, str):
        raise Unauthorized("token is malformed: its sub and scope must be strings")
    return Claims(sub, None, scope, exp)


def _what_is_wrong(exc: jwt.InvalidTokenError) -> str:
    """PyJWT's refusal in the protocol's words ("Not enough segments" says nothing to a token's holder)."""
    if isinstance(exc, jwt.InvalidSignatureError):  # before DecodeError, which it extends
        return "token signature is invalid (signed with another secret)"
    if isinstance(exc, jwt.InvalidAlgorithmError):
        return f"token is not signed with {ALGORITHM}"
    if isinstance(exc, jwt.MissingRequiredClaimError):
        return f"token is malformed: it has no {exc.claim} claim"
    if isinstance(exc, jwt.DecodeError):
        return "token is malformed (not a signed JWT)"
    return "token is invalid"
