"""The security matrix: every route and socket of the app x every kind of credential, one table.

Rows are the app's routes, read from the app itself (a route added without a row fails the test); columns are
credentials: none, malformed, another scheme, expired, signed with another secret, ``alg: none``, an ``exp``
that is a numeric string (RFC 7519: a JSON number), a token for another task, a token of the other scope, the
API key and a task token, each in the ``Authorization`` header and in ``?token=``; and tag tokens: for a tag
the task carries, for another tag, on a task without tags, on no such task (each in the header, the first two
in ``?token=`` too), expired, signed with another secret, with an ``exp`` that is a string, naming a task as
well. Each cell is what
docs/protocol.md (Errors, Credentials) says: ``401 unauthorized`` for a credential that proves nothing,
``403 forbidden`` for a valid one that is not for this task, scope or route (a tag token on a task without
its tag, or on no task at all: no probing), the route's own answer for the right one; on the single-task
socket the
matching ``error`` frame and close code (4401, 4403, 4404), on ``/v1/ws`` the ``error`` frame of the
subscribe. Run with an API key configured, and again in open mode (no API key), where the management
routes and reads take no credential but a credential that is sent must still hold.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import jwt
import orjson
import pytest
from starlette.routing import Mount, Route, WebSocketRoute
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.support import (
    SECRET,
    Running,
    bearer,
    create_task,
    issue_tag_token,
    mint,
    mint_tag,
    post_callback,
    running_gateway,
)

pytestmark = pytest.mark.anyio

API_KEY = "matrix-api-key"
OTHER_SECRET = "another-secret-0123456789abcdef0123456789"
STEP_S = 10.0
MINE = "mine"  # a task that has succeeded: every read ends, a delivery is possible
THEIRS = "theirs"
BARE = "bare"  # a task that has succeeded too, created without tags
GHOST = "ghost"  # no such task
MY_TAG = "owner:mine"  # MINE carries it (and the task list's query names it)
THEIR_TAG = "owner:theirs"  # THEIRS carries it

# What each route takes (docs/protocol.md, HTTP routes and WebSocket): the API key, a task's subscribe or
# callback token, a subscribe token inside a /v1/ws message, or nothing.
ROUTES: dict[tuple[str, str], str] = {
    ("POST", "/v1/tasks"): "api-key",
    ("GET", "/v1/tasks"): "api-key",
    ("GET", "/v1/tasks/{task_id}"): "subscribe",
    ("GET", "/v1/tasks/{task_id}/events"): "subscribe",
    ("GET", "/v1/tasks/{task_id}/stream"): "subscribe",
    ("POST", "/v1/tasks/{task_id}/callbacks"): "callback",
    ("POST", "/v1/tasks/{task_id}/cancel"): "api-key",  # MINE has succeeded: terminal-conflict, a 200
    ("POST", "/v1/tasks/{task_id}/heartbeat"): "callback",
    ("POST", "/v1/tasks/{task_id}/metadata"): "producer",  # a metadata patch: its worker's, or a backend's
    ("POST", "/v1/tasks/{task_id}/streams/{name}"): "producer",  # a stream append
    ("GET", "/v1/tasks/{task_id}/streams/{name}"): "subscribe",
    ("GET", "/v1/tasks/{task_id}/streams/{name}/text"): "subscribe",
    ("GET", "/v1/tasks/{task_id}/streams"): "subscribe",
    ("POST", "/v1/tasks/{task_id}/deliveries"): "api-key",
    ("POST", "/v1/notifications/drain"): "api-key",
    ("POST", "/v1/tokens"): "api-key",
    ("WS", "/v1/tasks/{task_id}/ws"): "subscribe",
    ("WS", "/v1/ws"): "subscribe-message",
    ("GET", "/v1/demo"): "public",
    ("POST", "/v1/demo/tasks"): "public",
    ("GET", "/healthz"): "public",
    ("GET", "/readyz"): "public",
    ("GET", "/metrics"): "public",
    ("GET", "/"): "public",
    ("GET", "/openapi.json"): "public",
    ("GET", "/docs"): "public",
    ("GET", "/static"): "public",
}


def _in_an_hour() -> str:
    return str(int(time.time()) + 3600)


def _alg_none(sub: str, scope: str) -> str:
    return jwt.encode({"sub": sub, "scope": scope, "exp": int(time.time()) + 3600}, None, algorithm="none")


@dataclass(frozen=True)
class Credential:
    """One column: how a credential is made for a route taking ``scope`` (``subscribe``, ``callback``, or
    ``None`` for the API key routes) and where it is sent."""

    name: str
    make: Callable[[str | None, dict[str, str]], str | None]
    where: str = "header"  # "header" | "query" | "raw-header" (the whole Authorization value)
    task: str = MINE


def _scope(scope: str | None) -> str:
    return scope or "subscribe"


def _other(scope: str | None) -> str:
    return "subscribe" if scope == "callback" else "callback"


COLUMNS = (
    Credential("none", lambda scope, t: None),
    Credential("malformed", lambda scope, t: "not-a-jwt"),
    Credential("another scheme", lambda scope, t: "Basic dXNlcjpwYXNz", where="raw-header"),
    Credential("expired", lambda scope, t: mint(MINE, _scope(scope), exp_in_s=-3600)),
    Credential("other secret", lambda scope, t: mint(MINE, _scope(scope), secret=OTHER_SECRET)),
    Credential("alg none", lambda scope, t: _alg_none(MINE, _scope(scope))),
    # RFC 7519: exp is a JSON number; PyJWT would convert a numeric string (an hour ahead: unexpired).
    Credential("exp a string", lambda scope, t: mint(MINE, _scope(scope), exp=_in_an_hour())),
    Credential("other task", lambda scope, t: t[f"{THEIRS}:{_scope(scope)}"]),
    Credential("other scope", lambda scope, t: t[f"{MINE}:{_other(scope)}"]),
    Credential("API key", lambda scope, t: API_KEY),
    Credential("API key in URL", lambda scope, t: API_KEY, where="query"),
    Credential("task token", lambda scope, t: t[f"{MINE}:{_scope(scope)}"]),
    Credential("task token in URL", lambda scope, t: t[f"{MINE}:{_scope(scope)}"], where="query"),
    # Authentication before existence: another task's token on a task that does not exist is 403, and only
    # a valid token for it learns that it does not exist.
    Credential("other task, no such task", lambda scope, t: t[f"{THEIRS}:{_scope(scope)}"], task=GHOST),
    Credential("valid, no such task", lambda scope, t: mint(GHOST, _scope(scope)), task=GHOST),
    # Tag tokens: for MINE's tag (it reads MINE as MINE's subscribe token does, and lists with its tag among
    # tag=), for THEIRS's tag (MINE does not carry it), on a task without tags, on no task at all (the same
    # 403: a tag token cannot probe ids), and ones that prove nothing.
    Credential("tag token", lambda scope, t: t[f"tag:{MY_TAG}"]),
    Credential("tag token in URL", lambda scope, t: t[f"tag:{MY_TAG}"], where="query"),
    Credential("tag token, task of another tag", lambda scope, t: t[f"tag:{THEIR_TAG}"]),
    Credential("tag token in URL, another tag", lambda scope, t: t[f"tag:{THEIR_TAG}"], where="query"),
    Credential("tag token, task without tags", lambda scope, t: t[f"tag:{MY_TAG}"], task=BARE),
    Credential("tag token, no such task", lambda scope, t: t[f"tag:{MY_TAG}"], task=GHOST),
    Credential("tag token, expired", lambda scope, t: mint_tag(MY_TAG, exp_in_s=-3600)),
    Credential("tag token, other secret", lambda scope, t: mint_tag(MY_TAG, secret=OTHER_SECRET)),
    Credential("tag token, exp a string", lambda scope, t: mint_tag(MY_TAG, exp=_in_an_hour())),
    # Both kinds at once: malformed, never read as the task token (or the tag token) it also looks like.
    Credential("tag token with a sub", lambda scope, t: mint_tag(MY_TAG, sub=MINE)),
)

OK = "ok"
NOT_FOUND = "unknown-task"
U, F = "unauthorized", "forbidden"
# The expected cell per kind of route and column, with an API key configured. OK: the route's own answer.
WITH_API_KEY: dict[str, dict[str, str | None]] = {
    "api-key": {
        "none": U,
        "malformed": U,
        "another scheme": U,
        "expired": U,
        "other secret": U,
        "alg none": U,
        "exp a string": U,
        "other task": F,  # a valid task token, where the API key belongs
        "other scope": F,
        "API key": OK,
        "API key in URL": U,  # the API key is read from the header only
        "task token": F,
        "task token in URL": U,  # nothing in the header
        "other task, no such task": F,
        "valid, no such task": F,
        # A tag token, where the API key belongs (GET /v1/tasks?tag=owner:mine: SPECIAL, below).
        "tag token": F,
        "tag token in URL": U,  # nothing in the header
        "tag token, task of another tag": F,
        "tag token in URL, another tag": U,
        "tag token, task without tags": F,
        "tag token, no such task": F,
        "tag token, expired": U,
        "tag token, other secret": U,
        "tag token, exp a string": U,
        "tag token with a sub": U,
    },
    "subscribe": {
        "none": U,
        "malformed": U,
        "another scheme": U,
        "expired": U,
        "other secret": U,
        "alg none": U,
        "exp a string": U,
        "other task": F,
        "other scope": F,
        "API key": OK,
        "API key in URL": U,
        "task token": OK,
        "task token in URL": OK,
        "other task, no such task": F,
        "valid, no such task": NOT_FOUND,
        "tag token": OK,  # MINE carries its tag
        "tag token in URL": OK,
        "tag token, task of another tag": F,
        "tag token in URL, another tag": F,
        "tag token, task without tags": F,
        "tag token, no such task": F,  # not unknown-task: a tag token learns nothing of other tasks
        "tag token, expired": U,
        "tag token, other secret": U,
        "tag token, exp a string": U,
        "tag token with a sub": U,
    },
    "callback": {
        "none": U,
        "malformed": U,
        "another scheme": U,
        "expired": U,
        "other secret": U,
        "alg none": U,
        "exp a string": U,
        "other task": F,
        "other scope": F,
        "API key": F,  # callbacks take only the task's callback token
        "API key in URL": U,
        "task token": OK,
        "task token in URL": OK,
        "other task, no such task": F,
        "valid, no such task": NOT_FOUND,
        "tag token": F,  # a tag token only reads
        "tag token in URL": F,
        "tag token, task of another tag": F,
        "tag token in URL, another tag": F,
        "tag token, task without tags": F,
        "tag token, no such task": F,
        "tag token, expired": U,
        "tag token, other secret": U,
        "tag token, exp a string": U,
        "tag token with a sub": U,
    },
}
# A stream append takes the task's callback token or the API key (from the header only).
WITH_API_KEY["producer"] = {**WITH_API_KEY["callback"], "API key": OK}
# On /v1/ws the credential is the subscribe message's token: there is no header, URL or scheme for it. The
# API key is not taken there (it is taken only from the Authorization header: a key has no business in a
# browser's socket message).
WITH_API_KEY["subscribe-message"] = {
    **{
        name: cell
        for name, cell in WITH_API_KEY["subscribe"].items()
        if name not in ("another scheme", "API key in URL", "task token in URL")
        and not name.startswith("tag token in URL")
    },
    "API key": U,
}

# Open mode: the API key routes and reads take no credential; a credential that is sent must still be
# valid, for this task and scope, on reads; callbacks are as with an API key.
OPEN_MODE: dict[str, dict[str, str | None]] = {
    "api-key": {
        **{name: OK for name in WITH_API_KEY["api-key"] if "API key" not in name},
        "other task, no such task": NOT_FOUND,
        "valid, no such task": NOT_FOUND,
        "tag token, no such task": NOT_FOUND,
    },
    "subscribe": {
        **{n: c for n, c in WITH_API_KEY["subscribe"].items() if "API key" not in n},
        "none": OK,
    },
    "callback": {n: c for n, c in WITH_API_KEY["callback"].items() if "API key" not in n},
    # As the management routes: none taken; a token that is sent must be the task's callback token.
    "producer": {
        **{n: c for n, c in WITH_API_KEY["producer"].items() if "API key" not in n},
        "none": OK,
    },
    "subscribe-message": {
        **{n: c for n, c in WITH_API_KEY["subscribe-message"].items() if "API key" not in n},
        "none": OK,
    },
}


# Cells that differ from their kind's row, by (open mode, method, path, column).
SPECIAL: dict[tuple[bool, str, str, str], str] = {
    # The task list's query takes state, cursor and limit only, the drain's limit only; with nothing to
    # authenticate, ?token= is one more unknown parameter.
    (True, "GET", "/v1/tasks", "task token in URL"): "invalid-request",
    (True, "POST", "/v1/notifications/drain", "task token in URL"): "invalid-request",
    **{
        (True, method, path, column): "invalid-request"
        for method, path in (("GET", "/v1/tasks"), ("POST", "/v1/notifications/drain"))
        for column in ("tag token in URL", "tag token in URL, another tag")
    },
    # The task list's query names MINE's tag: its tag token lists (and only it, of the tag tokens).
    (False, "GET", "/v1/tasks", "tag token"): OK,
    # The right credential reaches the heartbeat route, which says the task (succeeded) is not running.
    **{
        (open_mode, "POST", "/v1/tasks/{task_id}/heartbeat", column): "not-running"
        for open_mode in (False, True)
        for column in ("task token", "task token in URL")
    },
    # And the metadata patch's, as its worker's (a backend's, the API key or none in open mode, is taken).
    **{
        (open_mode, "POST", "/v1/tasks/{task_id}/metadata", column): "not-running"
        for open_mode in (False, True)
        for column in ("task token", "task token in URL")
    },
    # And the stream append's, with the API key and (open mode) none among them.
    **{
        (open_mode, "POST", "/v1/tasks/{task_id}/streams/{name}", column): "not-running"
        for open_mode, column in (
            *((mode, column) for mode in (False, True) for column in ("task token", "task token in URL")),
            (False, "API key"),
            (True, "none"),
        )
    },
}


def app_routes(gw: Running) -> set[tuple[str, str]]:
    found: set[tuple[str, str]] = set()
    for route in gw.app.routes:
        if isinstance(route, WebSocketRoute):
            found.add(("WS", route.path))
        elif isinstance(route, Route):
            assert route.methods is not None
            found |= {(method, route.path) for method in route.methods if method != "HEAD"}
        else:
            assert isinstance(route, Mount), route
            found.add(("GET", route.path))
    return found


async def _tokens(gw: Running, headers: dict[str, str] | None) -> dict[str, str]:
    tokens = {f"tag:{tag}": await issue_tag_token(gw, tag, headers=headers) for tag in (MY_TAG, THEIR_TAG)}
    for task_id, tags in ((MINE, [MY_TAG, "project:7"]), (THEIRS, [THEIR_TAG]), (BARE, None)):
        created = await create_task(gw, task_id, tags=tags, headers=headers)
        tokens[f"{task_id}:subscribe"] = created.subscribe_token
        tokens[f"{task_id}:callback"] = created.callback_token
    for task_id in (MINE, BARE):
        await post_callback(gw, task_id, tokens[f"{task_id}:callback"], {"type": "start", "worker": "w"})
        done = {"type": "succeed", "resultRef": "r", "resultHash": "h"}
        await post_callback(gw, task_id, tokens[f"{task_id}:callback"], done)
    return tokens


def _request(method: str, path: str, task_id: str) -> tuple[str, str, dict[str, Any]]:
    url = path.replace("{task_id}", task_id).replace("{name}", "output")
    if path == "/static":
        url = "/static/gateway-client.js"
    kwargs: dict[str, Any] = {}
    if path == "/v1/tasks" and method == "GET":
        kwargs["params"] = {"tag": MY_TAG}
    elif path == "/v1/tasks" and method == "POST":
        kwargs["json"] = {"ttlMs": 60_000, "maxAttempts": 1}
    elif path.endswith("/callbacks"):
        kwargs["json"] = {"event": {"type": "progress", "progress": 50, "cursor": "c"}}
    elif path.endswith("/heartbeat"):
        kwargs["json"] = {"attempt": 1}
    elif path.endswith("/metadata"):
        kwargs["json"] = {"attempt": 1, "patch": {"seen": True}}
    elif path.endswith("/{name}") and method == "POST":
        kwargs["json"] = {"attempt": 1, "seq": 0, "chunks": ["x"]}
    elif path == "/v1/tokens":
        kwargs["json"] = {"tag": "owner:u42"}
    elif path.endswith("/deliveries"):
        kwargs["headers"] = {"Idempotency-Key": uuid.uuid4().hex}  # a key of its own: never reused
    return method, url, kwargs


async def http_cell(gw: Running, method: str, path: str, column: Credential, value: str | None) -> str:
    """What the route answered: ``ok`` (2xx), the error code (with its status checked), or ``status N``."""
    method, url, kwargs = _request(method, path, column.task)
    headers = dict(kwargs.pop("headers", {}))
    params: dict[str, str] = dict(kwargs.pop("params", {}))
    if value is not None:
        if column.where == "query":
            params["token"] = value
        elif column.where == "raw-header":
            headers["Authorization"] = value
        else:
            headers.update(bearer(value))
    answer = await gw.client.request(method, url, headers=headers, params=params, **kwargs)
    if answer.is_success:
        return OK
    try:
        code = answer.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return f"status {answer.status_code}"
    status = {U: 401, F: 403, NOT_FOUND: 404}.get(code)
    return str(code) if status in (None, answer.status_code) else f"{code} with status {answer.status_code}"


async def socket_cell(gw: Running, path: str, column: Credential, value: str | None) -> str:
    """The single-task socket: ``ok`` (the resume frame, then 1000 for a finished task), or the error
    frame's code, checked against its close code."""
    url = gw.url.replace("http://", "ws://", 1) + path.replace("{task_id}", column.task)
    headers: dict[str, str] = {}
    if value is not None:
        if column.where == "query":
            url += f"?{httpx.QueryParams({'token': value})}"
        elif column.where == "raw-header":
            headers["Authorization"] = value
        else:
            headers.update(bearer(value))
    frames: list[dict[str, Any]] = []
    async with connect(url, additional_headers=headers, open_timeout=STEP_S, close_timeout=2) as ws:
        with anyio.fail_after(STEP_S):
            try:
                async for raw in ws:
                    frames.append(orjson.loads(raw))
            except ConnectionClosed:
                pass
        close = ws.close_code
    if close == 1000 and frames and frames[0]["type"] in ("caught-up", "delta", "snapshot"):
        return OK
    codes = {4401: U, 4403: F, 4404: NOT_FOUND}
    if len(frames) == 1 and frames[0]["type"] == "error" and codes.get(close or 0) == frames[0]["code"]:
        return str(frames[0]["code"])
    return f"frames {frames}, close {close}"


async def message_cell(gw: Running, column: Credential, value: str | None) -> str:
    """``/v1/ws``: the answer to one subscribe carrying the credential: ``ok`` (its resume frame) or the
    error frame's code; the socket stays open either way (a ping is still answered)."""
    url = gw.url.replace("http://", "ws://", 1) + "/v1/ws"
    message: dict[str, Any] = {"type": "subscribe", "taskId": column.task, "cursor": 0}
    if value is not None:
        message["token"] = value
    async with connect(url, open_timeout=STEP_S, close_timeout=2) as ws:
        with anyio.fail_after(STEP_S):
            await ws.send(orjson.dumps(message).decode())
            frame = orjson.loads(await ws.recv())
            await ws.send('{"type": "ping"}')
            assert orjson.loads(await ws.recv()) == {"type": "pong"}
    if frame["type"] in ("caught-up", "delta", "snapshot") and frame["taskId"] == column.task:
        return OK
    if frame["type"] == "error" and frame.get("taskId") == column.task:
        return str(frame["code"])
    return f"frame {frame}"


async def run_matrix(
    gw: Running, expected: dict[str, dict[str, str | None]], tokens: dict[str, str], *, open_mode: bool
) -> None:
    assert app_routes(gw) == set(ROUTES), "every route and socket of the app has a row here"
    wrong: list[str] = []
    for (method, path), kind in ROUTES.items():
        public_baseline: str | None = None
        for column in COLUMNS:
            if kind == "public":
                # Public routes ignore credentials: every cell answers as with none.
                if column.task != MINE or column.where == "query":
                    continue
                got = await http_cell(gw, method, path, column, column.make(None, tokens))
                public_baseline = public_baseline or got
                want: str | None = public_baseline
            else:
                # A column on another task than MINE (none, or one without tags): on the routes naming a
                # task, in the path or (/v1/ws) in the subscribe.
                names_a_task = "{task_id}" in path or kind == "subscribe-message"
                if column.name not in expected[kind] or (column.task != MINE and not names_a_task):
                    continue
                want = SPECIAL.get((open_mode, method, path, column.name), expected[kind][column.name])
                scope = (
                    None
                    if kind == "api-key"
                    else ("callback" if kind in ("callback", "producer") else "subscribe")
                )
                value = column.make(scope, tokens)
                if method == "WS" and kind == "subscribe-message":
                    got = await message_cell(gw, column, value)
                elif method == "WS":
                    got = await socket_cell(gw, path, column, value)
                else:
                    got = await http_cell(gw, method, path, column, value)
            if got != want:
                wrong.append(f"{method} {path} x {column.name}: expected {want}, got {got}")
    assert not wrong, "\n".join(wrong)


async def test_the_security_matrix_with_an_api_key(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, api_key=API_KEY, sweep_interval_ms=0) as gw:
        tokens = await _tokens(gw, bearer(API_KEY))
        await run_matrix(gw, WITH_API_KEY, tokens, open_mode=False)


async def test_the_security_matrix_in_open_mode(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, sweep_interval_ms=0) as gw:
        assert gw.gateway.settings.open_mode
        tokens = await _tokens(gw, None)
        await run_matrix(gw, OPEN_MODE, tokens, open_mode=True)


def test_the_forged_tokens_are_what_their_names_say() -> None:
    """The columns forge what they claim: right claims, wrong in one way only."""
    good = jwt.decode(mint(MINE), SECRET, algorithms=["HS256"])
    assert good["sub"] == MINE and good["scope"] == "subscribe"
    with pytest.raises(jwt.ExpiredSignatureError):
        jwt.decode(mint(MINE, exp_in_s=-3600), SECRET, algorithms=["HS256"])
    with pytest.raises(jwt.InvalidSignatureError):
        jwt.decode(mint(MINE, secret=OTHER_SECRET), SECRET, algorithms=["HS256"])
    # A string exp, an hour ahead, that PyJWT itself takes (it converts it): only the gateway refuses it.
    loose = jwt.decode(mint(MINE, exp=_in_an_hour()), SECRET, algorithms=["HS256"])
    assert isinstance(loose["exp"], str) and loose["sub"] == MINE
    none = _alg_none(MINE, "subscribe")
    assert jwt.get_unverified_header(none)["alg"] == "none"
    assert jwt.decode(none, options={"verify_signature": False})["sub"] == MINE
