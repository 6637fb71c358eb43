"""Who may call what (``gateway.web.auth.Guard``) for tag tokens, on values: a tag token reads a task only
if the task carries its tag, learns nothing of a task that does not exist, lists only with its tag among
the ``tag`` parameters, subscribes only to its own tag, and opens nothing else. The same rules through a
real server are tests/integration/test_security_matrix.py and test_tag_tokens.py."""

from __future__ import annotations

import time

import jwt
import pytest
from starlette.requests import Request

from gateway.errors import Forbidden, Unauthorized, UnknownTask
from gateway.machine import Task
from gateway.settings import Settings
from gateway.tokens import Tokens
from gateway.web.auth import NOT_CARRIED, WHOLE_TASK, Grant, Guard

SECRET = "unit-secret-0123456789abcdef0123456789"
API_KEY = "unit-api-key"
TOKENS = Tokens(SECRET)
TAG_TOKEN = TOKENS.issue_tag("owner:u42", 3600)[0]
OTHER_TAG_TOKEN = TOKENS.issue_tag("owner:u7", 3600)[0]
TASK_TOKEN = TOKENS.issue("t1", "subscribe", 60_000)
EXPIRED_TAG_TOKEN = jwt.encode(
    {"tag": "owner:u42", "scope": "subscribe", "exp": int(time.time()) - 5}, SECRET, algorithm="HS256"
)


def guard(*, api_key: str | None = API_KEY) -> Guard:
    settings = Settings(database_url="sqlite:///unused.db", secret=SECRET, api_key=api_key)
    return Guard(settings, TOKENS)


def task(*tags: str) -> Task:
    return Task("t1", "queued", 1e15, 0, 1, 0, 0, tags=tags)


def request(query: str = "", token: str | None = None) -> Request:
    headers = [] if token is None else [(b"authorization", f"Bearer {token}".encode())]
    return Request(
        {
            "type": "http",
            "method": "GET",
            "path": "/v1/tasks",
            "query_string": query.encode(),
            "headers": headers,
        }
    )


def test_a_tag_token_reads_a_task_that_carries_its_tag_and_no_other() -> None:
    grant = guard().task_credential(TAG_TOKEN, "t1", "subscribe")
    assert grant == Grant("owner:u42", TOKENS.claims(TAG_TOKEN).exp)
    carrying = task("owner:u42", "project:7")
    assert grant.check(carrying) is carrying
    for other in (task(), task("owner:u7"), task("owner:u420")):
        with pytest.raises(Forbidden, match=f"^{NOT_CARRIED}$"):
            grant.check(other)


def test_no_such_task_is_to_a_tag_token_what_a_task_without_its_tag_is() -> None:
    with pytest.raises(Forbidden, match=f"^{NOT_CARRIED}$"), Grant("owner:u42").reading():
        raise UnknownTask("ghost")
    # The task's own token (or the API key) learns that it does not exist, as before.
    with pytest.raises(UnknownTask), WHOLE_TASK.reading():
        raise UnknownTask("ghost")
    assert WHOLE_TASK.check(task()) == task()


def test_a_task_token_grants_its_whole_task_and_a_tag_token_no_callback() -> None:
    # The whole task, until the token's exp (a live subscription it authorized ends then).
    assert guard().task_credential(TASK_TOKEN, "t1", "subscribe") == Grant(
        None, TOKENS.claims(TASK_TOKEN).exp
    )
    assert guard().task_credential(API_KEY, "t1", "subscribe", api_key_allowed=True) is WHOLE_TASK  # no exp
    with pytest.raises(Forbidden, match="a tag token only reads tasks"):
        guard().task_credential(TAG_TOKEN, "t1", "callback")
    with pytest.raises(Unauthorized, match="expired"):
        guard().task_credential(EXPIRED_TAG_TOKEN, "t1", "subscribe")


@pytest.mark.parametrize("api_key", [API_KEY, None])
def test_subscribing_to_a_tag_takes_a_tag_token_for_that_tag(api_key: str | None) -> None:
    keyed = guard(api_key=api_key)
    exp = keyed.tag_credential(TAG_TOKEN, "owner:u42", where="a subscribe message")
    assert exp == TOKENS.claims(TAG_TOKEN).exp  # the subscription ends then
    with pytest.raises(Forbidden, match=r"^token is for another tag$"):
        keyed.tag_credential(OTHER_TAG_TOKEN, "owner:u42", where="a subscribe message")
    with pytest.raises(Forbidden, match=r"^a task token cannot subscribe to a tag$"):
        keyed.tag_credential(TASK_TOKEN, "owner:u42", where="a subscribe message")
    with pytest.raises(Unauthorized, match=r"^token has expired$"):
        keyed.tag_credential(EXPIRED_TAG_TOKEN, "owner:u42", where="a subscribe message")
    with pytest.raises(Unauthorized, match=r"^token is malformed"):
        keyed.tag_credential("not-a-jwt", "owner:u42", where="a subscribe message")


def test_subscribing_to_a_tag_without_a_token_passes_in_open_mode_only() -> None:
    assert guard(api_key=None).tag_credential(None, "owner:u42", where="a subscribe message") is None
    with pytest.raises(Unauthorized, match="missing subscribe token"):
        guard().tag_credential(None, "owner:u42", where="a subscribe message")
    with pytest.raises(Unauthorized, match=r"never from a subscribe message$"):
        guard().tag_credential(API_KEY, "owner:u42", where="a subscribe message")


def test_a_tag_token_lists_only_with_its_own_tag_among_the_tag_parameters() -> None:
    keyed = guard()
    keyed.task_list(request("tag=owner:u42", TAG_TOKEN))
    keyed.task_list(request("tag=project:7&tag=owner:u42&state=queued", TAG_TOKEN))  # others narrow it
    for query in ("", "tag=owner:u7", "tag=owner:u420", "state=queued"):
        with pytest.raises(Forbidden, match=r"lists only the tasks carrying its tag: add tag=owner:u42"):
            keyed.task_list(request(query, TAG_TOKEN))
    with pytest.raises(Forbidden, match="a task token cannot be used here"):
        keyed.task_list(request("tag=owner:u42", TASK_TOKEN))
    with pytest.raises(Unauthorized, match="invalid API key"):
        keyed.task_list(request("tag=owner:u42", EXPIRED_TAG_TOKEN))
    with pytest.raises(Unauthorized, match="needs the API key"):
        keyed.task_list(request("tag=owner:u42"))
    keyed.task_list(request("", API_KEY))


def test_a_tag_token_opens_no_management_route() -> None:
    with pytest.raises(Forbidden, match=r"^a tag token cannot be used here; this route needs the API key$"):
        guard().management(request("tag=owner:u42", TAG_TOKEN))
    with pytest.raises(Forbidden, match=r"^a task token cannot be used here"):
        guard().management(request("", TASK_TOKEN))
