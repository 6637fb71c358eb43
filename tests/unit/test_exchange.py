"""The clients' retry decisions (``gateway.client.exchange.tries``) and the management API's requests
(``gateway.client.backend_wire``), sans I/O: answers and transport errors are fed in by hand, requests are
built and read without a socket."""

from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import httpx
import pytest

from gateway.client import BackendError, TaskExists, UnknownTask
from gateway.client.backend_wire import Wire
from gateway.client.backoff import Backoff
from gateway.client.exchange import Pause, Steps, problem, tries

URL = "http://gw.example/v1/tasks"


def steps(retries: int = 3) -> Steps:
    backoff = Backoff(base_s=0.05, cap_s=2.0, rng=random.Random(7))
    return tries(httpx.Request("POST", URL, json={}), retries=retries, backoff=backoff)


def answer(status: int, headers: dict[str, str] | None = None, **body: object) -> httpx.Response:
    return httpx.Response(status, json=body, headers=headers, request=httpx.Request("POST", URL))


def returned(run: Steps, response: httpx.Response) -> httpx.Response:
    with pytest.raises(StopIteration) as done:
        run.send(response)
    result: httpx.Response = done.value.value
    return result


def test_an_answer_below_500_is_returned_at_once_a_refusal_included() -> None:
    for status in (200, 201, 400, 404, 409):
        run = steps()
        assert isinstance(next(run), httpx.Request)
        assert returned(run, answer(status)).status_code == status


def test_a_5xx_and_a_lost_connection_are_retried_with_the_same_request_after_a_pause() -> None:
    run = steps()
    first = next(run)
    assert isinstance(first, httpx.Request)
    assert isinstance(run.send(answer(503)), Pause)
    assert run.send(None) is first  # the same request: the same callback id or Idempotency-Key
    assert isinstance(run.throw(httpx.ConnectError("refused")), Pause)
    assert run.send(None) is first
    assert returned(run, answer(200)).status_code == 200


def test_retry_after_is_waited_at_least() -> None:
    run = steps()
    next(run)
    pause = run.send(answer(429, headers={"Retry-After": "3"}))
    assert isinstance(pause, Pause) and pause.seconds >= 3


def test_past_its_retries_the_last_failure_is_raised() -> None:
    run = steps(retries=1)
    next(run)
    run.send(answer(502))
    run.send(None)
    with pytest.raises(httpx.HTTPStatusError):
        run.send(answer(502))

    run = steps(retries=1)
    next(run)
    run.throw(httpx.ReadTimeout("no answer"))
    run.send(None)
    with pytest.raises(httpx.ReadTimeout):
        run.throw(httpx.ReadTimeout("no answer"))


def test_an_error_that_is_not_the_gateways_json_is_named_by_its_status() -> None:
    page = httpx.Response(502, text="<html>Bad Gateway</html>")
    assert problem(page).code == "http-502" and "Bad Gateway" in problem(page).message
    said = problem(answer(409, error={"code": "not-running", "message": "ended"}, task={"id": "t"}))
    assert (said.code, said.message, said.task) == ("not-running", "ended", {"id": "t"})


def test_a_refusal_raises_the_error_of_its_code() -> None:
    wire = Wire("http://gw.example/", "key")
    refusals = {
        (409, "task-exists"): TaskExists,
        (404, "unknown-task"): UnknownTask,
        (409, "not-succeeded"): BackendError,
        (400, "invalid-request"): BackendError,
    }
    for (status, code), kind in refusals.items():
        with pytest.raises(kind) as raised:
            wire.get("t-1").answer(answer(status, error={"code": code, "message": "why"}))
        assert type(raised.value) is kind
        assert (raised.value.status, raised.value.code, raised.value.message) == (status, code, "why")
        assert raised.value.task_id == "t-1" and "t-1" in str(raised.value)


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    """Builds requests (it sends none)."""
    with httpx.Client() as client:
        yield client


def test_the_requests_carry_the_key_a_quoted_id_and_only_the_parameters_given(client: httpx.Client) -> None:
    wire = Wire("http://gw.example/", "key")
    request = wire.get("a b?c#d%").request(client)
    assert request.url.raw_path == b"/v1/tasks/a%20b%3Fc%23d%25"
    assert request.headers["authorization"] == "Bearer key"

    listed = wire.list(state=None, tags=["owner:u1", "p:7"], cursor=None, limit=10).request(client)
    assert listed.url.params.multi_items() == [("tag", "owner:u1"), ("tag", "p:7"), ("limit", "10")]

    open_mode = Wire("http://gw.example", None).create(
        None, ttl_ms=1, max_attempts=1, heartbeat_ms=None, tags=()
    )
    assert "authorization" not in open_mode.request(client).headers
    assert open_mode.body is not None and set(open_mode.body) == {"id", "ttlMs", "maxAttempts"}
    # Named here, so its retries (the same request) name the same task; each create another one.
    again = Wire("http://gw.example", None).create(None, ttl_ms=1, max_attempts=1, heartbeat_ms=None, tags=())
    assert again.body is not None and str(uuid.UUID(again.body["id"])) != open_mode.body["id"]


def test_a_drain_always_carries_a_key_its_retries_reuse(client: httpx.Client) -> None:
    wire = Wire("http://gw.example", "key")
    call = wire.drain(limit=None, idempotency_key=None)
    key = call.request(client).headers["idempotency-key"]
    assert key and call.request(client).headers["idempotency-key"] == key  # what a retry sends
    assert wire.drain(limit=None, idempotency_key=None).headers["Idempotency-Key"] != key  # a new drain
    given = wire.drain(limit=5, idempotency_key="batch-1")
    drained = given.answer(httpx.Response(200, json=[], headers={"Drain-More": "true"}))
    assert (drained.notifications, drained.more, drained.idempotency_key) == ([], True, "batch-1")
