"""schemathesis against the app's own ``/openapi.json``, served by a real uvicorn server on loopback.

Every operation of the document is called with generated requests: with no credential and with the API
key (valid and invalid parameters and bodies; a task's callback token where only that is taken), and,
with valid requests, holding task tokens (the path's task id swapped for a task of ours, its subscribe or
callback token in the header, or the subscribe token in ``?token=``); once more in open mode. Every answer
must be no 5xx, a status the document lists for that operation, with a body (SSE events included) that
matches the schema it names; schemathesis also replays a request that had a credential without it and
with a bad one, expecting 401 or 403; and the server logs no error. The run is derandomized and bounded
(``MAX_EXAMPLES`` per operation and run), so CI sends the same requests every time.
"""

from __future__ import annotations

import json
import re
import unicodedata
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import jsonschema
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis.checks import CheckContext
from schemathesis.config import SchemathesisConfig
from schemathesis.core.parameters import ParameterLocation
from schemathesis.generation.meta import FuzzingPhaseData
from schemathesis.specs.openapi.checks import negative_data_rejection

from gateway.web import task_ids
from gateway.web.openapi import openapi_document, package_version
from tests.support import bearer
from tests.support.examples import every_example, examples
from tests.support.threaded import ErrorLog, threaded_gateway

API_KEY = "schemathesis-api-key"
MAX_EXAMPLES = examples(40)

# The documents the app serves, with an API key and in open mode (built by the same function;
# test_the_served_documents_are_these checks it): loaded at collection, since schemathesis makes its tests
# before any fixture runs.
DOCUMENT = openapi_document(package_version())
OPEN_DOCUMENT = openapi_document(package_version(), open_mode=True)
# Schemathesis's coverage phase (every boundary case the document defines, as explicit examples made at
# collection, by each of the suite's processes, whether it runs these tests or not) in CI's profile; a
# developer's default run fuzzes each operation with its share of the examples (tests/support/examples.py).
PHASES = {"phases": {"coverage": {"enabled": every_example()}}}
schema = schemathesis.openapi.from_dict(DOCUMENT, config=SchemathesisConfig.from_dict(PHASES))
POSITIVE = SchemathesisConfig.from_dict({"generation": {"mode": "positive"}, **PHASES})
# Valid requests only, for the runs that put one of our tasks in the path: a generated request made invalid
# there (a task id over maxLength, say) would no longer be invalid once the id is ours.
valid_only = schemathesis.openapi.from_dict(DOCUMENT, config=POSITIVE)
open_schema = schemathesis.openapi.from_dict(OPEN_DOCUMENT, config=SchemathesisConfig.from_dict(PHASES))
open_valid_only = schemathesis.openapi.from_dict(OPEN_DOCUMENT, config=POSITIVE)


def _a_task_id(text: str) -> bool:
    return 0 < len(text) <= 128 and re.fullmatch(task_ids.PATTERN, text) is not None and text.isprintable()


# The format "task-id" of the document: its pattern, and Unicode NFC, which no pattern can say.
schemathesis.openapi.format(
    "task-id",
    st.from_regex(task_ids.PATTERN, fullmatch=True)
    .map(lambda t: unicodedata.normalize("NFC", t))
    .filter(_a_task_id),
)


@dataclass
class Server:
    url: str
    client: httpx.Client
    errors: ErrorLog

    def new_task(self, *, finished: bool = False) -> dict[str, Any]:
        """A task of ours (a new one each time, so that callbacks on one do not end the next case's);
        ``finished``: it has succeeded (its SSE stream ends after the resume frame)."""
        answer = self.client.post(
            "/v1/tasks",
            json={"id": f"st-{uuid.uuid4().hex[:12]}", "ttlMs": 600_000, "maxAttempts": 3},
            headers=bearer(API_KEY),
        )
        assert answer.status_code == 201, answer.text
        created: dict[str, Any] = answer.json()
        events = [{"type": "start", "worker": "w"}, {"type": "succeed", "resultRef": "r", "resultHash": "h"}]
        for event in events if finished else []:
            path = f"/v1/tasks/{created['task']['id']}/callbacks"
            done = self.client.post(path, json={"event": event}, headers=bearer(created["callbackToken"]))
            assert done.status_code == 200 and done.json()["changed"], done.text
        return created


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real gateway (SQLite, an API key, demo tasks on)."""
    database = tmp_path_factory.mktemp("schemathesis") / "gateway.db"
    with threaded_gateway(f"sqlite:///{database}", api_key=API_KEY, demo=True) as running:
        yield Server(running.url, running.client, running.errors)


@pytest.fixture(scope="module")
def open_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A real gateway in open mode (no API key; demo tasks on, as by default there)."""
    database = tmp_path_factory.mktemp("schemathesis-open") / "gateway.db"
    with threaded_gateway(f"sqlite:///{database}") as running:
        assert running.gw.gateway.settings.open_mode
        yield Server(running.url, running.client, running.errors)


def test_the_served_documents_are_these(server: Server, open_server: Server) -> None:
    assert server.client.get("/openapi.json").json() == DOCUMENT
    assert open_server.client.get("/openapi.json").json() == OPEN_DOCUMENT


def test_in_open_mode_the_served_document_asks_for_no_credential_where_none_is_taken(
    open_server: Server,
) -> None:
    """Open mode: the management routes take no credential and reads need none (a token that is sent must
    still be right); only a worker's routes, a callback and a heartbeat, need the task's callback token."""
    document = open_server.client.get("/openapi.json").json()
    assert "apiKey" not in document["components"]["securitySchemes"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            security = operation["security"]
            if path.endswith(("/callbacks", "/heartbeat")):
                assert security == [{"callbackToken": []}], (method, path, security)
            else:
                assert security == [] or {} in security, (method, path, security)


def _drops_the_credential(case: Any) -> bool:
    """Whether this case is schemathesis leaving a credential out on purpose (and expecting a 401)."""
    data = getattr(getattr(case.meta, "phase", None), "data", None)
    return str(getattr(data, "parameter", "")).lower() in ("authorization", "token")


def _credentials(case: Any, server: Server, mode: str) -> dict[str, Any]:
    """This run's credential for the case, as ``call_and_validate`` arguments: schemathesis then knows it
    as given (not generated), and also probes the request without it and with a bad one, expecting 401 or
    403 there. Task tokens come with the task they are for, put in the case's path.

    ``api-key``: the API key wherever it is taken (a task's callback token on the callback route).
    ``task-token``: a task's subscribe or callback token in the header wherever one is taken (the API key
    on the management routes). ``task-token-in-query``: the same, with the subscribe token in ``?token=``.
    ``open`` (open mode): one of our tasks in the path, and only the callback token (reads take none).
    """
    security = {name for requirement in case.operation.definition.raw["security"] for name in requirement}
    if mode == "none" or not security or _drops_the_credential(case):
        return {}
    if "apiKey" in security and (mode == "api-key" or not security & {"callbackToken", "subscribeToken"}):
        return {"headers": bearer(API_KEY)}
    # A live task's stream never ends: the stream is read from a finished task.
    task = server.new_task(finished=case.operation.path.endswith("/stream"))
    case.path_parameters = {**(case.path_parameters or {}), "task_id": task["task"]["id"]}
    token = task["callbackToken" if "callbackToken" in security else "subscribeToken"]
    if mode == "open" and "callbackToken" not in security:
        return {}  # open mode: reads take no credential
    if mode == "task-token-in-query" and "subscribeTokenQuery" in security:
        return {"params": {**(case.query or {}), "token": token}}
    return {"headers": bearer(token)}


SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)


def _only_an_unknown_header(case: Any) -> bool:
    """Whether the one thing wrong with this negative case is a header the document does not name: HTTP
    ignores a header it does not know (RFC 9110, 5.1), and OpenAPI has no way to say otherwise."""
    data = case.meta.phase.data
    return (
        isinstance(data, FuzzingPhaseData)
        and data.parameter_location == ParameterLocation.HEADER
        and data.description == "object with unexpected properties"
    )


def _a_valid_query_value_in_another_type(case: Any) -> bool:
    """Whether this negative case sends, where the document names an array of query values (``tag``), a
    scalar whose text is a valid item: a query string has no types, so ``tag=false`` (the boolean) is on the
    wire the one-value array ``["false"]``, a valid tag, which no server can tell apart."""
    data = case.meta.phase.data
    if not isinstance(data, FuzzingPhaseData) or data.parameter_location != ParameterLocation.QUERY:
        return False
    value = (case.query or {}).get(data.parameter)
    if value is None or isinstance(value, (list, dict)):
        return False
    text = str(value).lower() if isinstance(value, bool) else str(value)
    for parameter in case.operation.definition.raw.get("parameters", ()):
        if parameter["name"] == data.parameter and parameter["in"] == "query":
            schema = parameter["schema"]
            arrays = [s for s in schema.get("anyOf", [schema]) if s.get("type") == "array"]
            return any(jsonschema.Draft202012Validator(a["items"]).is_valid(text) for a in arrays)
    return False


def _a_task_id_the_protocol_takes(case: Any) -> bool:
    """Whether this negative case's one fault is the format of its body's task id, and that id, as the
    server reads it, is one the protocol takes: the format's strategy above makes printable ids, but an id
    of other characters (private use, two lone surrogates that JSON sends as the escapes of one pair) is as
    good (protocol.md, Create)."""
    data = case.meta.phase.data
    if not (
        isinstance(data, FuzzingPhaseData)
        and data.parameter_location == ParameterLocation.BODY
        and "`format`" in (data.description or "")
        and "/properties/id/" in (data.description or "")
    ):
        return False
    sent = case.body.get("id") if isinstance(case.body, dict) else None
    if not isinstance(sent, str):
        return False
    read = orjson.loads(json.dumps(sent))
    return (
        0 < len(read) <= task_ids.MAX_LENGTH
        and re.fullmatch(task_ids.PATTERN, read) is not None
        and task_ids.task_id_problem(read) is None
    )


def rejects_negative_data(ctx: CheckContext, response: Any, case: Any) -> bool | None:
    """schemathesis's own check, but for a request whose only fault is a header nobody declared, a query
    value whose type the wire does not carry, or a task id the protocol takes that the format's strategy would
    not make; and a body refused for its size (413: a stream append's chunks past maxItems, megabytes of
    them), which rejects it as surely as a 400, though schemathesis does not list it."""
    if (
        _only_an_unknown_header(case)
        or _a_valid_query_value_in_another_type(case)
        or _a_task_id_the_protocol_takes(case)
        or response.status_code == 413
    ):
        return None
    return negative_data_rejection(ctx, response, case)


def check(case: Any, server: Server, mode: str) -> None:
    """Every check schemathesis has, that one included: a request the schema calls valid is not refused
    (the schema says what the server takes: ttlMs above 0, a cursor the server can have given out)."""
    given = _credentials(case, server, mode)
    case.call_and_validate(
        base_url=server.url,
        excluded_checks=[negative_data_rejection],
        additional_checks=[rejects_negative_data],
        **given,
    )
    assert not (logged := server.errors.take()), logged


@schema.parametrize()
@SETTINGS
def test_no_credential(case: Any, server: Server) -> None:
    check(case, server, "none")


@schema.parametrize()
@SETTINGS
def test_the_api_key(case: Any, server: Server) -> None:
    check(case, server, "api-key")


@valid_only.parametrize()
@SETTINGS
def test_task_tokens(case: Any, server: Server) -> None:
    check(case, server, "task-token")


@valid_only.parametrize()
@SETTINGS
def test_task_tokens_in_the_query(case: Any, server: Server) -> None:
    check(case, server, "task-token-in-query")


@open_schema.parametrize()
@SETTINGS
def test_open_mode_no_credential(case: Any, open_server: Server) -> None:
    check(case, open_server, "none")


@open_valid_only.parametrize()
@SETTINGS
def test_open_mode(case: Any, open_server: Server) -> None:
    check(case, open_server, "open")
