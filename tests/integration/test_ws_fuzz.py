"""A Hypothesis fuzzer for ``/v1/ws`` messages against a real server.

Each example opens a socket and sends a few generated messages: JSON of any shape, messages shaped like
the protocol's with wrong types and odd values (2**70, -2**70, floats, the string "NaN", escaped lone
surrogates, long strings, real and forged tokens), text that is not JSON, binary frames. After each message
the client sends a ``ping`` and reads up to its ``pong``: what came before it must be what the protocol
answers that message (docs/protocol.md, WebSocket): a ``pong`` for a ping, nothing for an unsubscribe,
the resume frame or an ``error`` frame for a subscribe, an ``error`` frame with one of the protocol's codes
for anything else, and the socket stays open. Meanwhile a well-behaved client subscribed to another task
gets every entry of it, checked every few examples and at the end; and the server logs no error (no
unhandled exception). A message over the size limit closes the socket with 1009. Derandomized, bounded.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import jwt
import orjson
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.support import SECRET, bearer
from tests.support.examples import examples
from tests.support.threaded import Threaded, threaded_gateway, until

API_KEY = "fuzz-api-key"
MAX_EXAMPLES = examples(150)
# The well-behaved client is checked after every this many examples.
CHECK_EVERY = 10
STEP_S = 10.0
# Codes an error frame on /v1/ws may carry (docs/protocol.md, Errors).
ERROR_CODES = {"invalid-request", "unauthorized", "forbidden", "unknown-task"}
RESUME = {"caught-up", "delta", "snapshot"}
# Over every limit on a message a socket can be under (uvicorn's own default is 16 MiB).
OVERSIZE = 16 * 1024 * 1024 + 1
# The fuzzed messages stay under the smallest limit (4 KiB until a subscription is authorized): past it the
# socket is closed (1009), which test_a_message_over_the_limit_closes_the_socket_with_1009 checks.
MAX_MESSAGE_BYTES = 4000

HUGE = [2**70, -(2**70), 2**64, -(2**64), 2**63, 2**63 - 1, -(2**63), -(2**63) - 1, 2**53 + 1, 10**400]


def _forged(sub: str, **changes: Any) -> str:
    claims = {"sub": sub, "scope": "subscribe", "exp": int(time.time()) + 3600}
    claims.update(changes.pop("claims", {}))
    secret = changes.pop("secret", SECRET)
    return jwt.encode(claims, secret, algorithm="HS256")


class Fuzzed:
    """The fuzz task (a task the fuzzer has tokens for) and the credentials the fuzzer draws from."""

    def __init__(self, created: dict[str, Any]) -> None:
        self.task_id: str = created["task"]["id"]
        self.tokens: list[Any] = [
            created["subscribeToken"],
            created["callbackToken"],
            API_KEY,
            "not-a-jwt",
            "",
            _forged(self.task_id, claims={"exp": int(time.time()) - 10}),
            _forged(self.task_id, secret="another-secret-0123456789abcdef0123"),
            jwt.encode({"sub": self.task_id, "scope": "subscribe", "exp": 2**40}, None, algorithm="none"),
            _forged("ghost"),
        ]


def _json_values() -> st.SearchStrategy[Any]:
    text = st.one_of(
        st.text(max_size=20),
        st.text(st.characters(codec=None, categories=["Cs", "Co", "Cc", "So"]), max_size=5),
        st.sampled_from(["NaN", "Infinity", "-0", "1e400", "subscribe", "ping", "\u0000", "../.."]),
        st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1000, max_size=2500),
    )
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.sampled_from(HUGE),
        st.floats(allow_nan=False, allow_infinity=False),
        text,
    )
    return st.recursive(
        scalars,
        lambda children: (
            st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
        ),
        max_leaves=8,
    )


@st.composite
def _protocol_shaped(draw: st.DrawFn, fuzzed: Fuzzed) -> dict[str, Any]:
    """A message shaped like the protocol's: each field mostly right, sometimes wrong, sometimes missing."""
    values = _json_values()
    message: dict[str, Any] = {}
    fields = {
        "type": st.sampled_from(["subscribe"] * 6 + ["unsubscribe", "ping", "PING", "Subscribe", ""]),
        "taskId": st.sampled_from([fuzzed.task_id, fuzzed.task_id, "ghost", "", ".", "..", "a/b"]),
        "token": st.sampled_from(fuzzed.tokens),
        "cursor": st.integers(min_value=-3, max_value=3) | st.sampled_from(HUGE),
    }
    for name, right in fields.items():
        choice = draw(st.integers(0, 5))
        if choice == 0:
            continue  # missing
        message[name] = draw(values if choice == 1 else right)
    if draw(st.integers(0, 3)) == 0:
        message.update(draw(st.dictionaries(st.text(max_size=8), values, max_size=2)))
    return message


def _encode(draw: st.DrawFn, value: Any) -> str | bytes:
    """As JSON: ASCII-escaped (lone surrogates as ``\\udXXX``) or raw UTF-8 (a lone surrogate then makes
    invalid UTF-8, sent as a binary frame); as a text or a binary frame; ``NaN`` where a float is one."""
    text = json.dumps(value, ensure_ascii=draw(st.booleans()))
    as_bytes = draw(st.booleans())
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode(errors="surrogatepass")
    return text.encode() if as_bytes else text


def messages(fuzzed: Fuzzed) -> st.SearchStrategy[str | bytes]:
    return _messages(fuzzed).filter(
        lambda raw: len(raw.encode() if isinstance(raw, str) else raw) <= MAX_MESSAGE_BYTES
    )


@st.composite
def _messages(draw: st.DrawFn, fuzzed: Fuzzed) -> str | bytes:
    kind = draw(st.sampled_from(["protocol"] * 6 + ["json", "text", "binary", "nan"]))
    if kind == "protocol":
        return _encode(draw, draw(_protocol_shaped(fuzzed)))
    if kind == "json":
        return _encode(draw, draw(_json_values()))
    if kind == "text":
        return draw(
            st.text(max_size=200) | st.sampled_from(["{", '{"type": "ping"', "NaN", '"\\ud800"', "[1,]"])
        )
    if kind == "binary":
        return draw(st.binary(max_size=200))
    return draw(
        st.sampled_from(['{"type": "subscribe", "taskId": "x", "cursor": NaN}', '{"cursor": Infinity}'])
    )


def expected(raw: str | bytes) -> str:
    """What the protocol answers this message with: ``pong``, ``nothing``, ``subscribe`` (the resume frame
    or an error frame for that task) or ``error``."""
    try:
        message = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return "error"
    if not isinstance(message, dict):
        return "error"
    kind, task_id = message.get("type"), message.get("taskId")
    if kind == "ping":
        return "pong"
    if not isinstance(task_id, str):
        return "error"
    if kind == "unsubscribe":
        return "nothing"
    token, cursor = message.get("token"), message.get("cursor", 0)
    well_typed = (token is None or isinstance(token, str)) and type(cursor) is int
    return "subscribe" if kind == "subscribe" and well_typed else "error"


def answers_to(ws: ClientConnection, raw: str | bytes) -> list[dict[str, Any]]:
    """Send ``raw`` then a ping; every frame up to that ping's pong."""
    ws.send(raw)
    ws.send('{"type": "ping"}')
    pongs = 2 if expected(raw) == "pong" else 1
    frames: list[dict[str, Any]] = []
    while pongs:
        frame = orjson.loads(ws.recv(timeout=STEP_S))
        frames.append(frame)
        pongs -= frame.get("type") == "pong"
    return frames[:-1]


def check_answer(raw: str | bytes, frames: list[dict[str, Any]]) -> None:
    outcome = expected(raw)
    if outcome == "nothing":
        assert frames == [], (raw, frames)
        return
    assert len(frames) == 1, (raw, frames)
    frame = frames[0]
    if outcome == "pong":
        assert frame == {"type": "pong"}, (raw, frame)
        return
    task_id = orjson.loads(raw)["taskId"] if outcome == "subscribe" else None
    if outcome == "subscribe" and frame["type"] in RESUME:
        assert frame["taskId"] == task_id, (raw, frame)
        return
    assert frame["type"] == "error", (raw, frame)
    assert frame["code"] in ERROR_CODES, (raw, frame)
    assert isinstance(frame["message"], str) and frame["message"], (raw, frame)
    if task_id is not None:
        assert frame.get("taskId") == task_id, (raw, frame)


class Watcher:
    """A well-behaved client on a socket of its own, subscribed to a task of its own; ``check`` moves the
    task one entry on (a progress; a new task once progress is at 99) and waits for that entry's frame."""

    def __init__(self, server: Threaded, ws: ClientConnection) -> None:
        self.client = server.client
        self.ws = ws
        self.tasks = 0
        self._watch_a_new_task()

    def _watch_a_new_task(self) -> None:
        self.tasks += 1
        self.task_id = f"watched-{self.tasks}"
        body = {"id": self.task_id, "ttlMs": 3_600_000, "maxAttempts": 1}
        created = self.client.post("/v1/tasks", json=body, headers=bearer(API_KEY)).json()
        self.callback = bearer(created["callbackToken"])
        subscribe = {"type": "subscribe", "taskId": self.task_id, "token": created["subscribeToken"]}
        self.ws.send(json.dumps(subscribe))
        assert orjson.loads(self.ws.recv(timeout=STEP_S))["type"] == "caught-up"
        self.version = self.progress = 0
        self._post({"type": "start", "worker": "w"})

    def _post(self, event: dict[str, Any]) -> None:
        path = f"/v1/tasks/{self.task_id}/callbacks"
        answer = self.client.post(path, json={"event": event}, headers=self.callback)
        assert answer.status_code == 200 and answer.json()["changed"], answer.text
        frame = orjson.loads(self.ws.recv(timeout=STEP_S))
        assert frame["type"] == "event" and frame["taskId"] == self.task_id, frame
        assert frame["version"] == self.version + 1, frame
        self.version += 1

    def check(self) -> None:
        if self.progress >= 99:
            self._watch_a_new_task()
            return
        self.progress += 1
        self._post({"type": "progress", "progress": self.progress, "cursor": str(self.progress)})


def let_go(server: Threaded, left: int) -> None:
    """Until the gateway holds ``left`` sockets: each one the test closed is let go, its handling over and
    whatever it logs logged (its close frame reaches the client first: the server's errors read then would
    miss what the handling logs at its end)."""
    feeds = server.gw.gateway.hub.feeds
    until(lambda: len(feeds) == left, f"the gateway down to {left} socket(s), those closed let go")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Threaded]:
    database = tmp_path_factory.mktemp("ws-fuzz") / "gateway.db"
    with threaded_gateway(f"sqlite:///{database}", api_key=API_KEY, sweep_interval_ms=0) as running:
        yield running


def test_every_message_is_answered_as_the_protocol_says_and_others_are_served(server: Threaded) -> None:
    created = server.client.post(
        "/v1/tasks", json={"id": "fuzzed", "ttlMs": 3_600_000, "maxAttempts": 3}, headers=bearer(API_KEY)
    ).json()
    fuzzed = Fuzzed(created)
    with connect(f"{server.ws_url}/v1/ws", open_timeout=STEP_S) as ws:
        watcher = Watcher(server, ws)
        run_fuzzer(server, fuzzed, watcher)
        watcher.check()
    let_go(server, 0)
    assert not (logged := server.errors.take()), logged


def run_fuzzer(server: Threaded, fuzzed: Fuzzed, watcher: Watcher) -> None:
    examples = 0

    @settings(
        max_examples=MAX_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(messages(fuzzed), min_size=1, max_size=4))
    def fuzz(sent: list[str | bytes]) -> None:
        nonlocal examples
        with connect(f"{server.ws_url}/v1/ws", open_timeout=STEP_S, max_size=None) as ws:
            for raw in sent:
                check_answer(raw, answers_to(ws, raw))
        let_go(server, 1)  # the watcher's socket stays
        assert not (logged := server.errors.take()), logged
        examples += 1
        if examples % CHECK_EVERY == 0:
            watcher.check()

    # Beside what Hypothesis draws, every credential and every huge cursor on a subscribe to the fuzzed task
    # (and to one that does not exist), each on a socket of its own.
    for token in fuzzed.tokens:
        for task_id in (fuzzed.task_id, "ghost"):
            fuzz = example([_subscribe(task_id, token, 0)])(fuzz)
    for cursor in HUGE:
        fuzz = example([_subscribe(fuzzed.task_id, fuzzed.tokens[0], cursor)])(fuzz)
    fuzz()


def _subscribe(task_id: str, token: str, cursor: int) -> str:
    return json.dumps({"type": "subscribe", "taskId": task_id, "token": token, "cursor": cursor})


def test_a_message_over_the_limit_closes_the_socket_with_1009(server: Threaded) -> None:
    """The server closes the socket (it does not buffer the message whole). Its close frame says 1009
    when it reaches the client: a server that closes while the rest of a message is still arriving may
    have the connection reset under that frame, a race of TCP, not of the gateway."""
    with connect(f"{server.ws_url}/v1/ws", open_timeout=STEP_S, max_size=None) as ws:
        with pytest.raises(ConnectionClosed):
            ws.send(b"x" * OVERSIZE)
            ws.recv(timeout=STEP_S)
        close = ws.protocol.close_rcvd
        assert close is None or close.code == 1009, close
    let_go(server, 0)
    assert not (logged := server.errors.take()), logged
