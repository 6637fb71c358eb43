"""Task tokens (``gateway.tokens``): a verified token is remembered, but never past its expiry, and a
remembered token still only opens its own task and scope."""

from __future__ import annotations

import time

import jwt
import pytest

from gateway.errors import Forbidden, Unauthorized
from gateway.tokens import VERIFIED_CACHE_SIZE, Tokens

SECRET = "unit-secret-0123456789abcdef0123456789"


def mint(sub: str, scope: str, exp: float, secret: str = SECRET) -> str:
    return jwt.encode({"sub": sub, "scope": scope, "exp": int(exp)}, secret, algorithm="HS256")


def test_a_remembered_token_expires_on_time() -> None:
    now = [time.time()]
    tokens = Tokens(SECRET, wall=lambda: now[0])
    token = mint("t1", "callback", now[0] + 60)
    tokens.check(token, "t1", "callback")
    tokens.check(token, "t1", "callback")  # remembered
    now[0] += 61
    with pytest.raises(Unauthorized, match="expired"):
        tokens.check(token, "t1", "callback")


def test_a_remembered_token_opens_only_its_task_and_scope() -> None:
    tokens = Tokens(SECRET)
    token = mint("t1", "callback", time.time() + 60)
    tokens.check(token, "t1", "callback")
    with pytest.raises(Forbidden, match="another task"):
        tokens.check(token, "t2", "callback")
    with pytest.raises(Forbidden, match="scope"):
        tokens.check(token, "t1", "subscribe")


def test_only_verified_tokens_are_remembered_and_the_memory_is_bounded() -> None:
    tokens = Tokens(SECRET)
    forged = mint("t1", "callback", time.time() + 60, secret="another-secret-0123456789abcdef01234")
    for _ in range(2):
        with pytest.raises(Unauthorized, match="signature is invalid"):
            tokens.check(forged, "t1", "callback")
    for i in range(VERIFIED_CACHE_SIZE + 50):
        tokens.check(mint(f"t{i}", "subscribe", time.time() + 60), f"t{i}", "subscribe")
    assert len(tokens._verified) == VERIFIED_CACHE_SIZE


# Tokens made when the tests are collected, which may be minutes before they run.
LATER = time.time() + 86_400


@pytest.mark.parametrize(
    ("token", "words"),
    [
        ("abc", "token is malformed"),
        ("a.b.c", "token is malformed"),
        (mint("t1", "callback", time.time() - 5), "token has expired"),
        (mint("t1", "callback", LATER, secret="x" * 40), "token signature is invalid"),
        (jwt.encode({"sub": "t1", "scope": "callback"}, SECRET, algorithm="HS256"), "no exp claim"),
        (jwt.encode({"sub": "t1", "scope": 7, "exp": LATER}, SECRET), "token is malformed"),
        (jwt.encode({"sub": "t1", "scope": "callback", "exp": LATER}, SECRET * 2, "HS512"), "HS256"),
    ],
)
def test_a_refused_token_is_described_in_the_protocols_words(token: str, words: str) -> None:
    with pytest.raises(Unauthorized) as refused:
        Tokens(SECRET).check(token, "t1", "callback")
    assert refused.value.code == "unauthorized"
    assert words in refused.value.message
    for pyjwt in ("segments", "Signature verification failed", "Token is missing", "Signature has expired"):
        assert pyjwt not in refused.value.message


def test_a_token_for_another_task_or_scope_is_described_in_the_protocols_words() -> None:
    token = mint("t1", "callback", time.time() + 60)
    with pytest.raises(Forbidden, match=r"^token is for another task$"):
        Tokens(SECRET).check(token, "t2", "callback")
    with pytest.raises(Forbidden, match=r"^token has the callback scope; this needs a subscribe token$"):
        Tokens(SECRET).check(token, "t1", "subscribe")
