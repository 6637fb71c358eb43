"""Who may call what (protocol.md, Tokens): the API key for management routes, a task's callback token
for its callbacks, its subscribe token (or the API key) for reads; open mode on loopback only; health,
readiness and metrics.

Authentication is HTTP-layer behaviour, so these run on SQLite only.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import jwt
import pytest

from gateway.errors import ConfigError
from gateway.settings import Settings
from tests.support import (
    GATEWAY_CLI,
    SECRET,
    FakeClock,
    Running,
    bearer,
    create_task,
    error,
    mint,
    running_gateway,
)

API_KEY = "k3y"
KEY = {"Authorization": f"Bearer {API_KEY}"}
TTL_MS = 60_000
START = {"event": {"type": "start", "worker": "w1"}}
SUCCEED = {"event": {"type": "succeed", "resultRef": "r", "resultHash": "h"}}


@asynccontextmanager
async def gateway(url: str, clock: FakeClock, **overrides: Any) -> AsyncIterator[Running]:
    # The background sweeper is off: nothing here needs it.
    async with running_gateway(url, clock=clock, **{"sweep_interval_ms": 0, **overrides}) as gw:
        yield gw


async def version(gw: Running, task_id: str) -> int:
    answer = await gw.client.get(f"/v1/tasks/{task_id}", headers=KEY)
    assert answer.status_code == 200, answer.text
    return answer.json()["version"]  # type: ignore[no-any-return]


# --- the API key on management routes ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_create_needs_the_api_key(sqlite_url: str, clock: FakeClock) -> None:
    async with gateway(sqlite_url, clock, api_key=API_KEY) as gw:
        body = {"id": "a-1", "ttlMs": 60_000, "maxAttempts": 1}
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": f"Bearer {API_KEY}x"},
            {"Authorization": f"Basic {API_KEY}"},
            {"Authorization": API_KEY},
            {"Authorization": "Bearer"},
            bearer(mint("a-1", "callback", secret="another-secret-0123456789abcdef0123")),
        ):
            error(await gw.client.post("/v1/tasks", json=body, headers=headers), 401, "unauthorized")
        # Nothing was created.
        error(await gw.client.get("/v1/tasks/a-1", headers=KEY), 404, "unknown-task")
        answer = await gw.client.post("/v1/tasks", json=body, headers=KEY)
        assert answer.status_code == 201, answer.text
        # The scheme is case-insensitive.
        answer = await gw.client.post("/v1/tasks", json=body, headers={"Authorization": f"bearer {API_KEY}"})
        assert answer.status_code == 200, answer.text


@pytest.mark.anyio
async def test_task_tokens_cannot_manage(sqlite_url: str, clock: FakeClock) -> None:
    async with gateway(sqlite_url, clock, api_key=API_KEY) as gw:
        made = await create_task(gw, "a-2", ttl_ms=TTL_MS, max_attempts=2, headers=KEY)
        cb, sub = made.callback_token, made.subscribe_token
        assert (
            await gw.client.post("/v1/tasks/a-2/callbacks", json=START, headers=bearer(cb))
        ).status_code == 200
        assert (
            await gw.client.post("/v1/tasks/a-2/callbacks", json=SUCCEED, headers=bearer(cb))
        ).status_code == 200
        for token in (sub, cb):
            headers = bearer(token)
            create_body = {"id": "a-2b", "ttlMs": 1_000, "maxAttempts": 1}
            error(await gw.client.post("/v1/tasks", json=create_body, headers=headers), 403, "forbidden")
            error(await gw.client.post("/v1/notifications/drain", headers=headers), 403, "forbidden")
            answer = await gw.client.post(
                "/v1/tasks/a-2/deliveries", headers={**headers, "Idempotency-Key": "k"}
            )
            error(answer, 403, "forbidden")
        # None of them did anything: the notification is still there, the key still free.
        drained = await gw.client.post("/v1/notifications/drain", headers=KEY)
        assert [n["taskId"] for n in drained.json()] == ["a-2"]
        delivered = await gw.client.post("/v1/tasks/a-2/deliveries", headers={**KEY, "Idempotency-Key": "k"})
        assert delivered.status_code == 200 and delivered.json()["reason"] == "delivered", delivered.text
        error(await gw.client.get("/v1/tasks/a-2b", headers=KEY), 404, "unknown-task")
        # Without any credential: 401 on each management route.
        error(await gw.client.post("/v1/notifications/drain"), 401, "unauthorized")
        error(
            await gw.client.post("/v1/tasks/a-2/deliveries", headers={"Idempotency-Key": "k2"}),
            401,
            "unauthorized",
        )


# --- callback tokens ---------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_callbacks_need_the_tasks_callback_token(sqlite_url: str, clock: FakeClock) -> None:
    async with gateway(sqlite_url, clock, api_key=API_KEY) as gw:
        made = await create_task(gw, "a-3", ttl_ms=TTL_MS, max_attempts=2, headers=KEY)
        cb, sub = made.callback_token, made.subscribe_token
        other = await create_task(gw, "a-3-other", ttl_ms=TTL_MS, max_attempts=2, headers=KEY)
        other_cb = other.callback_token
        url = "/v1/tasks/a-3/callbacks"
        for headers in (
            {},
            {"Authorization": "Bearer not-a-jwt"},
            {"Authorization": "Bearer a.b.c"},
            {"Authorization": f"Basic {cb}"},
            {"Authorization": "Bearer"},
            bearer(mint("a-3", "callback", exp_in_s=-60)),  # expired
            bearer(mint("a-3", "callback", secret="another-secret-0123456789abcdef0123")),
            bearer(jwt.encode({"sub": "a-3", "exp": int(time.time()) + 60}, SECRET, algorithm="HS256")),
            bearer(jwt.encode({"sub": "a-3", "scope": "callback"}, SECRET, algorithm="HS256")),
            bearer(mint("a-3", "callback")[:-2]),  # a broken signature
        ):
            error(await gw.client.post(url, json=START, headers=headers), 401, "unauthorized")
        # Authentication comes before the body: a bad body without a token is still a 401.
        error(await gw.client.post(url, content=b"{", headers={}), 401, "unauthorized")
        for headers in (
            bearer(sub),  # another scope
            bearer(other_cb),  # another task
            bearer(mint("a-3", "subscribe")),
            bearer(mint("a-3", "admin")),
            KEY,  # the API key is not a callback token
        ):
            error(await gw.client.post(url, json=START, headers=headers), 403, "forbidden")
        error(await gw.client.post(url, content=b"{", headers=bearer(sub)), 403, "forbidden")
        assert await version(gw, "a-3") == 0

        # The task's own token, as issued or as minted by a backend holding the secret.
        answer = await gw.client.post(url, json=START, headers=bearer(cb))
        assert answer.status_code == 200 and answer.json()["reason"] == "started", answer.text
        answer = await gw.client.post(url, json=SUCCEED, headers=bearer(mint("a-3", "callback")))
        assert answer.status_code == 200 and answer.json()["reason"] == "succeeded", answer.text


@pytest.mark.anyio
async def test_authentication_comes_before_existence(sqlite_url: str, clock: FakeClock) -> None:
    async with gateway(sqlite_url, clock, api_key=API_KEY) as gw:
        made = await create_task(gw, "a-4", ttl_ms=TTL_MS, max_attempts=2, headers=KEY)
        cb, sub = made.callback_token, made.subscribe_token
        # A valid token for another task, on a task that does not exist: 403, so ids cannot be probed.
        answer = await gw.client.post("/v1/tasks/never-made/callbacks", json=START, headers=bearer(cb))
        error(answer, 403, "forbidden")
        error(await gw.client.get("/v1/tasks/never-made", headers=bearer(sub)), 403, "forbidden")
        error(await gw.client.get("/v1/tasks/never-made/events", headers=bearer(sub)), 403, "forbidden")
        # No or bad credentials: 401 whether or not the task exists.
        error(await gw.client.post("/v1/tasks/never-made/callbacks", json=START), 401, "unauthorized")
        error(await gw.client.get("/v1/tasks/never-made"), 401, "unauthorized")
        # Its own valid token (minted for an id that was never created): now existence, 404.
        own = mint("never-made", "callback")
        answer = await gw.client.post("/v1/tasks/never-made/callbacks", json=START, headers=bearer(own))
        error(answer, 404, "unknown-task")
        own_sub = mint("never-made", "subscribe")
        error(await gw.client.get("/v1/tasks/never-made", headers=bearer(own_sub)), 404, "unknown-task")
        error(await gw.client.get("/v1/tasks/never-made", headers=KEY), 404, "unknown-task")
        error(await gw.client.get("/v1/tasks/never-made/events", headers=KEY), 404, "unknown-task")


@pytest.mark.anyio
async def test_tokens_are_jwts_for_the_task_with_a_wall_clock_expiry(sqlite_url: str) -> None:
    # The gateway's task clock says 1970; tokens still expire by the wall clock: TTL plus 24 hours.
    async with gateway(sqlite_url, FakeClock(now=5_000), api_key=API_KEY) as gw:
        before = time.time()
        answer = await gw.client.post(
            "/v1/tasks", json={"id": "a-6", "ttlMs": 600_000, "maxAttempts": 1}, headers=KEY
        )
        after = time.time()
        assert answer.status_code == 201, answer.text
        assert answer.json()["task"]["expiresAtMs"] == 605_000
        for scope in ("callback", "subscribe"):
            token = answer.json()[f"{scope}Token"]
            assert jwt.get_unverified_header(token)["alg"] == "HS256"
            claims = jwt.decode(token, SECRET, algorithms=["HS256"])
            assert (claims["sub"], claims["scope"]) == ("a-6", scope)
            assert int(before) + 600 + 86_400 - 1 <= claims["exp"] <= after + 600 + 86_400 + 1
        cb = answer.json()["callbackToken"]
        started = await gw.client.post("/v1/tasks/a-6/callbacks", json=START, headers=bearer(cb))
        assert started.status_code == 200 and started.json()["reason"] == "started", started.text


# --- reads --------------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_reads_take_the_api_key_or_the_subscribe_token(sqlite_url: str, clock: FakeClock) -> None:
    async with gateway(sqlite_url, clock, api_key=API_KEY) as gw:
        made = await create_task(gw, "a-5", ttl_ms=TTL_MS, max_attempts=2, headers=KEY)
        cb, sub = made.callback_token, made.subscribe_token
        other = await create_task(gw, "a-5-other", ttl_ms=TTL_MS, max_attempts=2, headers=KEY)
        other_sub = other.subscribe_token
        for path in ("/v1/tasks/a-5", "/v1/tasks/a-5/events"):
            for ok in (
                gw.client.get(path, headers=KEY),
                gw.client.get(path, headers=bearer(sub)),
                gw.client.get(path, params={"token": sub}),
                gw.client.get(path, headers=bearer(mint("a-5", "subscribe"))),
            ):
                answer = await ok
                assert answer.status_code == 200, answer.text
            error(await gw.client.get(path), 401, "unauthorized")
            error(await gw.client.get(path, headers={"Authorization": "Bearer wrong"}), 401, "unauthorized")
            error(await gw.client.get(path, params={"token": "wrong"}), 401, "unauthorized")
            expired = mint("a-5", "subscribe", exp_in_s=-60)
            error(await gw.client.get(path, headers=bearer(expired)), 401, "unauthorized")
            error(await gw.client.get(path, headers=bearer(cb)), 403, "forbidden")
            error(await gw.client.get(path, params={"token": cb}), 403, "forbidden")
            error(await gw.client.get(path, headers=bearer(other_sub)), 403, "forbidden")
        answer = await gw.client.get("/v1/tasks/a-5", headers=bearer(sub))
        assert answer.json()["id"] == "a-5"


# --- open mode ----------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_open_mode(sqlite_url: str, clock: FakeClock) -> None:
    async with gateway(sqlite_url, clock) as gw:  # no api_key: open mode on loopback
        answer = await gw.client.post("/v1/tasks", json={"id": "o-1", "ttlMs": 60_000, "maxAttempts": 1})
        assert answer.status_code == 201, answer.text
        cb, sub = answer.json()["callbackToken"], answer.json()["subscribeToken"]
        other = await gw.client.post("/v1/tasks", json={"id": "o-2", "ttlMs": 60_000, "maxAttempts": 1})
        other_cb = other.json()["callbackToken"]
        assert (await gw.client.get("/v1/tasks/o-1")).status_code == 200
        assert (await gw.client.get("/v1/tasks/o-1/events")).json()["mode"] == "caught-up"
        assert (await gw.client.post("/v1/notifications/drain")).json() == []
        error(
            await gw.client.post("/v1/tasks/o-1/deliveries", headers={"Idempotency-Key": "k"}),
            409,
            "not-succeeded",
        )

        # Callbacks still need the task's callback token.
        url = "/v1/tasks/o-1/callbacks"
        error(await gw.client.post(url, json=START), 401, "unauthorized")
        error(
            await gw.client.post(url, json=START, headers={"Authorization": "Bearer junk"}),
            401,
            "unauthorized",
        )
        error(
            await gw.client.post(url, json=START, headers=bearer(mint("o-1", "callback", exp_in_s=-60))),
            401,
            "unauthorized",
        )
        error(await gw.client.post(url, json=START, headers=bearer(sub)), 403, "forbidden")
        error(await gw.client.post(url, json=START, headers=bearer(other_cb)), 403, "forbidden")
        error(
            await gw.client.post("/v1/tasks/never-made/callbacks", json=START, headers=bearer(cb)),
            403,
            "forbidden",
        )
        assert (await gw.client.get("/v1/tasks/o-1")).json()["version"] == 0
        answer = await gw.client.post(url, json=START, headers=bearer(cb))
        assert answer.status_code == 200 and answer.json()["reason"] == "started", answer.text
        answer = await gw.client.post(url, json=SUCCEED, headers=bearer(cb))
        assert answer.status_code == 200 and answer.json()["reason"] == "succeeded", answer.text
        delivered = await gw.client.post("/v1/tasks/o-1/deliveries", headers={"Idempotency-Key": "k"})
        assert delivered.status_code == 200, delivered.text
        assert [n["taskId"] for n in (await gw.client.post("/v1/notifications/drain")).json()] == ["o-1"]


def test_open_mode_binds_loopback_only() -> None:
    for host in ("0.0.0.0", "::", "192.168.1.10", "example.com"):
        with pytest.raises(ConfigError, match="GATEWAY_API_KEY"):
            Settings(host=host).check_bind()
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        Settings(host=host).check_bind()
    Settings(host="0.0.0.0", api_key="k3y").check_bind()


def test_serve_refuses_a_public_address_without_an_api_key(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env["GATEWAY_DATABASE_URL"] = f"sqlite:///{tmp_path / 'gateway.db'}"
    result = subprocess.run(
        [*GATEWAY_CLI, "serve", "--host", "0.0.0.0", "--port", "0"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode != 0, (result.stdout, result.stderr)
    assert "GATEWAY_API_KEY" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


# --- health, readiness, metrics -----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_health_readiness_and_metrics(sqlite_url: str, clock: FakeClock) -> None:
    async with gateway(sqlite_url, clock, api_key=API_KEY) as gw:
        healthz = await gw.client.get("/healthz")
        assert healthz.status_code == 200, healthz.text
        readyz = await gw.client.get("/readyz")
        assert readyz.status_code == 200, readyz.text
        cb = (await create_task(gw, "m-1", ttl_ms=TTL_MS, max_attempts=2, headers=KEY)).callback_token
        answer = await gw.client.post("/v1/tasks/m-1/callbacks", json=START, headers=bearer(cb))
        assert answer.status_code == 200, answer.text
        metrics = await gw.client.get("/metrics")
        assert metrics.status_code == 200, metrics.text
        assert metrics.headers["content-type"].startswith("text/plain")
        lines = metrics.text.splitlines()
        assert any(line.startswith("gateway_callbacks_total") for line in lines), metrics.text
        assert 'gateway_callbacks_total{reason="started"} 1.0' in lines, metrics.text
