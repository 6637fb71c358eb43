"""Task tokens (``gateway.tokens``): a verified token is remembered, but never past its expiry, and a
remembered token still only opens its own task and scope."""

from __future__ import annotations

import time

import jwt
import pytest

from gateway.errors import Forbidden, Unauthorized
from gateway.tokens import VERIFIED_CACHE_SIZE, Claims, Scope, Tokens

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
        (
            jwt.encode({"sub": "t1", "scope": "callback", "exp": LATER, "nbf": LATER - 1}, SECRET),
            "not valid yet",
        ),
        (
            jwt.encode({"sub": "t1", "scope": "callback", "exp": LATER, "iat": LATER - 1}, SECRET),
            "not valid yet",
        ),
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


# --- tag tokens ----------------------------------------------------------------------------------------


def mint_claims(exp: float = LATER, secret: str = SECRET, **claims: object) -> str:
    return jwt.encode({**claims, "exp": int(exp)}, secret, algorithm="HS256")


def test_a_tag_token_carries_its_tag_subscribe_and_exp_and_no_sub() -> None:
    now = 1_800_000_000.5
    token, exp = Tokens(SECRET, grace_s=86_400, wall=lambda: now).issue_tag("owner:u42", 3600)
    claims = jwt.decode(token, SECRET, algorithms=["HS256"])
    assert claims == {"tag": "owner:u42", "scope": "subscribe", "exp": 1_800_003_600}  # no grace added
    assert exp == 1_800_003_600
    verified = Tokens(SECRET, wall=lambda: now).claims(token)
    assert verified == Claims(None, "owner:u42", "subscribe", 1_800_003_600)


def test_a_tag_token_reads_only_and_a_remembered_one_still_expires_on_time() -> None:
    now = [time.time()]
    tokens = Tokens(SECRET, wall=lambda: now[0])
    token, _ = tokens.issue_tag("owner:u42", 60)
    for _ in range(2):  # verified, then remembered: the same answers
        assert tokens.check(token, "any-task", "subscribe").tag == "owner:u42"  # the task must carry it
        with pytest.raises(Forbidden, match=r"^a tag token only reads tasks; this needs the task's callback"):
            tokens.check(token, "any-task", "callback")
    assert token in tokens._verified
    now[0] += 61
    with pytest.raises(Unauthorized, match=r"^token has expired$"):
        tokens.check(token, "any-task", "subscribe")


def test_a_task_token_passes_with_no_tag_to_check() -> None:
    tokens = Tokens(SECRET)
    assert tokens.check(mint("t1", "subscribe", LATER), "t1", "subscribe").tag is None
    assert tokens.claims(mint("t1", "callback", LATER)) == Claims("t1", None, "callback", int(LATER))


@pytest.mark.parametrize(
    ("token", "words"),
    [
        # Never taken for each other: a token naming a task and a tag, or neither, is malformed.
        (mint_claims(sub="t1", tag="owner:u42", scope="subscribe"), "a sub claim (a task) or a tag claim"),
        (mint_claims(scope="subscribe"), "a sub claim (a task) or a tag claim"),
        (mint_claims(sub="t1", tag=None, scope="subscribe"), "a sub claim (a task) or a tag claim"),
        (mint_claims(tag="owner:u42", scope="callback"), "a tag token's scope must be subscribe"),
        (mint_claims(tag="owner u42", scope="subscribe"), "its tag claim is not a tag"),
        (mint_claims(tag=42, scope="subscribe"), "its tag claim is not a tag"),
        (mint_claims(tag="owner:u42", scope=["subscribe"]), "its scope must be a string"),
        (mint_claims(tag="owner:u42"), "no scope claim"),
        (jwt.encode({"tag": "owner:u42", "scope": "subscribe"}, SECRET, algorithm="HS256"), "no exp claim"),
        (mint_claims(tag="owner:u42", scope="subscribe", exp=time.time() - 5), "token has expired"),
        (mint_claims(tag="owner:u42", scope="subscribe", secret="y" * 40), "signature is invalid"),
    ],
)
def test_a_malformed_or_forged_tag_token_is_refused_in_the_protocols_words(token: str, words: str) -> None:
    tokens = Tokens(SECRET)
    scopes: tuple[Scope, ...] = ("subscribe", "callback")
    for scope in scopes:
        with pytest.raises(Unauthorized) as refused:
            tokens.check(token, "t1", scope)
        assert words in refused.value.message
    assert tokens._verified == {}  # nothing refused is remembered


# --- NumericDate claims ------------------------------------------------------------------------------------

TASK_CLAIMS = {"sub": "t1", "scope": "subscribe"}
TAG_CLAIMS = {"tag": "owner:u42", "scope": "subscribe"}


@pytest.mark.parametrize("kind", [TASK_CLAIMS, TAG_CLAIMS], ids=["task token", "tag token"])
@pytest.mark.parametrize(
    ("claim", "value"),
    [
        ("exp", str(int(LATER))),  # PyJWT would take it, converted: a JSON string is not a NumericDate
        ("exp", f"{LATER:.1f}"),
        ("exp", True),
        ("exp", [int(LATER)]),
        ("exp", float("inf")),
        ("exp", float("nan")),
        ("nbf", "0"),
        ("iat", str(int(time.time()))),
        ("nbf", None),
    ],
    # Named for what they are, not their values: a time in an id differs between xdist's processes.
    ids=[
        "exp-numeric-string",
        "exp-decimal-string",
        "exp-bool",
        "exp-list",
        "exp-inf",
        "exp-nan",
        "nbf-string",
        "iat-string",
        "nbf-null",
    ],
)
def test_a_numericdate_claim_that_is_not_a_json_number_is_malformed(
    kind: dict[str, str], claim: str, value: object
) -> None:
    """RFC 7519: ``exp``, ``nbf`` and ``iat`` are NumericDates, JSON numbers; anything else is malformed."""
    token = jwt.encode({**kind, "exp": int(LATER), claim: value}, SECRET, algorithm="HS256")
    tokens = Tokens(SECRET)
    with pytest.raises(Unauthorized) as refused:
        tokens.check(token, "t1", "subscribe")
    assert refused.value.message == f"token is malformed: its {claim} claim must be a number"
    assert tokens._verified == {}


@pytest.mark.parametrize("value", [int(LATER), LATER], ids=["whole", "fraction"])
def test_an_exp_that_is_a_json_number_whole_or_not_is_taken(value: float) -> None:
    token = jwt.encode({**TASK_CLAIMS, "exp": value, "iat": 1_700_000_000.25}, SECRET, algorithm="HS256")
    assert Tokens(SECRET).check(token, "t1", "subscribe").exp == value
