"""The management API on the wire, sans I/O: each of ``Backend``'s and ``AsyncBackend``'s methods is one
:class:`Call` built here (the request, and how its answer is read), so the two classes only send it, on
an ``httpx.Client`` or an ``httpx.AsyncClient`` (protocol.md: Create, Tag tokens, Cancel, List,
Deliveries, Notifications).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx

from gateway.client.errors import BackendError, TaskExists, UnknownTask
from gateway.client.exchange import problem

T = TypeVar("T")

# What a create takes (protocol.md, Create), stated on the client's side, which imports nothing of the server,
# so that a client can refuse at once what the gateway would refuse at every create;
# tests/unit/test_integrations_install.py holds them to the server's own.
MIN_TTL_MS = 1
MAX_TTL_MS = 2**52  # about 142,800 years
MIN_HEARTBEAT_MS = 1_000
MAX_HEARTBEAT_MS = MAX_TTL_MS
MAX_TAGS = 16
TAG_PATTERN = "^[A-Za-z0-9:._@-]{1,128}$"
TAG_RULE = "1 to 128 characters of A-Z, a-z, 0-9 and : . _ @ -"
MAX_TITLE_CHARS = 200  # a title is 1 to 200 characters, not blank, no control characters


@dataclass(frozen=True)
class Created:
    """A create's answer: the task, its two tokens, and whether this create made it (``201``) or found it
    made with the same parameters (``200``: a repeated create, or a retry whose first answer was lost)."""

    task: dict[str, Any]
    callback_token: str
    subscribe_token: str
    created: bool


@dataclass(frozen=True)
class TagToken:
    """A tag token (``POST /v1/tokens``) and when it expires, in epoch milliseconds."""

    token: str
    expires_at_ms: int


@dataclass(frozen=True)
class Page:
    """A page of ``GET /v1/tasks``; ``next_cursor`` is ``None`` on the last one."""

    tasks: list[dict[str, Any]]
    next_cursor: str | None


@dataclass(frozen=True)
class Drained:
    """A batch of terminal notifications, whether more were left (``Drain-More``), and the
    ``Idempotency-Key`` the batch is kept under for 24 h (a drain always sends one)."""

    notifications: list[dict[str, Any]]
    more: bool
    idempotency_key: str


def _json(response: httpx.Response) -> Any:
    return response.json()


@dataclass(frozen=True)
class Call(Generic[T]):
    """One management request, safe to send again (its retries send it whole, ``Idempotency-Key``
    included), and how to read its answer."""

    method: str
    url: str
    read: Callable[[httpx.Response], T]
    body: dict[str, Any] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    task_id: str | None = None  # the task it is about, named in its error

    def request(self, client: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        """The request, built by the client that sends it (so it carries that client's timeouts)."""
        return client.build_request(
            self.method, self.url, json=self.body, params=self.params, headers=self.headers
        )

    def answer(self, response: httpx.Response) -> T:
        """What the answer says; :class:`BackendError` (:class:`TaskExists`, :class:`UnknownTask`) for a
        refusal."""
        if response.status_code >= 300:
            raise refusal(response, self.task_id)
        return self.read(response)


def refusal(response: httpx.Response, task_id: str | None) -> BackendError:
    said = problem(response)
    kind = {(409, "task-exists"): TaskExists, (404, "unknown-task"): UnknownTask}.get(
        (response.status_code, said.code), BackendError
    )
    return kind(response.status_code, said.code, said.message, task_id=task_id)


def _created(response: httpx.Response) -> Created:
    body = response.json()
    return Created(body["task"], body["callbackToken"], body["subscribeToken"], response.status_code == 201)


def _task(response: httpx.Response) -> dict[str, Any]:
    task: dict[str, Any] = response.json()["task"]
    return task


def _tag_token(response: httpx.Response) -> TagToken:
    body = response.json()
    return TagToken(body["token"], int(body["expiresAtMs"]))


def _page(response: httpx.Response) -> Page:
    body = response.json()
    return Page(body["tasks"], body.get("nextCursor"))


class Wire:
    """Builds the calls of one gateway's management API, with the API key (``None``: open mode, no
    credential)."""

    def __init__(self, base_url: str, api_key: str | None) -> None:
        self.base_url = base_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}

    def _task_url(self, task_id: str, route: str = "") -> str:
        # An id may hold what a path cannot carry as it is (``?``, ``#``, ``%``, spaces): one segment, quoted.
        return f"{self.base_url}/v1/tasks/{quote(task_id, safe='')}{route}"

    def create(
        self,
        task_id: str | None,
        *,
        ttl_ms: int,
        max_attempts: int,
        heartbeat_ms: int | None,
        tags: Sequence[str],
        title: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        parent: str | None = None,
        progress_from_children: bool = False,
    ) -> Call[Created]:
        # Without an id the client names the task (a UUID, as the gateway would): a retry of a create whose
        # answer was lost then finds the task it made instead of making a second one.
        task_id = task_id if task_id is not None else str(uuid.uuid4())
        body: dict[str, Any] = {"id": task_id, "ttlMs": ttl_ms, "maxAttempts": max_attempts}
        if heartbeat_ms is not None:
            body["heartbeatMs"] = heartbeat_ms
        if tags:
            body["tags"] = list(tags)
        if title is not None:
            body["title"] = title
        if metadata is not None:
            body["metadata"] = dict(metadata)
        if parent is not None:
            body["parent"] = parent
        if progress_from_children:
            body["progressFromChildren"] = True
        url = f"{self.base_url}/v1/tasks"
        return Call("POST", url, _created, body, headers=self.headers, task_id=task_id)

    def patch_metadata(
        self, task_id: str, patch: Mapping[str, Any], attempt: int | None
    ) -> Call[dict[str, Any]]:
        """``POST /v1/tasks/{id}/metadata`` with the API key: the task's JSON after the merge patch (any
        task, ended ones included; fenced by ``attempt`` when given). A patch is idempotent: its retries
        after a lost answer change nothing more."""
        body: dict[str, Any] = {"patch": dict(patch)}
        if attempt is not None:
            body["attempt"] = attempt
        url = self._task_url(task_id, "/metadata")
        return Call("POST", url, _task, body, headers=self.headers, task_id=task_id)

    def callback(self, task_id: str, token: str, body: Mapping[str, Any]) -> Call[dict[str, Any]]:
        """A callback with the task's callback token, for a task no ``Worker`` runs (a queue's batch's
        parent, which the integrations start and end); safe to repeat when it carries a ``callbackId``."""
        headers = {"Authorization": f"Bearer {token}"}
        url = self._task_url(task_id, "/callbacks")
        return Call("POST", url, _json, dict(body), headers=headers, task_id=task_id)

    def tag_token(self, tag: str, *, ttl_s: int | None) -> Call[TagToken]:
        body: dict[str, Any] = {"tag": tag} if ttl_s is None else {"tag": tag, "ttlS": ttl_s}
        return Call("POST", f"{self.base_url}/v1/tokens", _tag_token, body, headers=self.headers)

    def cancel(self, task_id: str, reason: str | None) -> Call[dict[str, Any]]:
        body = {} if reason is None else {"reason": reason}
        url = self._task_url(task_id, "/cancel")
        return Call("POST", url, _json, body, headers=self.headers, task_id=task_id)

    def get(self, task_id: str) -> Call[dict[str, Any]]:
        return Call("GET", self._task_url(task_id), _json, headers=self.headers, task_id=task_id)

    def list(
        self, *, state: str | None, tags: Sequence[str], cursor: str | None, limit: int | None
    ) -> Call[Page]:
        given = {"state": state, "tag": list(tags), "cursor": cursor, "limit": limit}
        params = {name: value for name, value in given.items() if value not in (None, [])}
        return Call("GET", f"{self.base_url}/v1/tasks", _page, params=params, headers=self.headers)

    def deliver(self, task_id: str, idempotency_key: str) -> Call[dict[str, Any]]:
        headers = {**self.headers, "Idempotency-Key": idempotency_key}
        url = self._task_url(task_id, "/deliveries")
        return Call("POST", url, _json, headers=headers, task_id=task_id)

    def drain(self, *, limit: int | None, idempotency_key: str | None) -> Call[Drained]:
        """A drain under ``idempotency_key``, or a fresh UUID: always keyed, so its retries (and a caller's
        own, with the key of the answer it did not get) take the same batch, none lost (at least once)."""
        key = idempotency_key if idempotency_key is not None else str(uuid.uuid4())

        def drained(response: httpx.Response) -> Drained:
            more = response.headers.get("drain-more") == "true"
            return Drained(response.json(), more, key)

        params = {} if limit is None else {"limit": limit}
        headers = {**self.headers, "Idempotency-Key": key}
        return Call(
            "POST", f"{self.base_url}/v1/notifications/drain", drained, params=params, headers=headers
        )
