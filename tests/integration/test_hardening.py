"""What a hostile page, a careless deployment or an odd client could do, and what the gateway answers."""

from __future__ import annotations

from pathlib import Path

import anyio
import httpx
import pytest

from tests.support import SECRET, Running, error, eventually, post_callback, running_gateway


async def state_of(gw: Running, task_id: str) -> str:
    answer = await gw.client.get(f"/v1/tasks/{task_id}")
    assert answer.status_code == 200, answer.text
    return str(answer.json()["state"])


@pytest.mark.anyio
async def test_open_mode_refuses_cross_site_writes_and_foreign_host_names(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        await gw.client.post("/v1/tasks", json={"id": "t", "ttlMs": 60_000, "maxAttempts": 1})
        # A page elsewhere posting a simple (preflight-free) request to the open management API.
        evil = {"Origin": "http://evil.example", "Content-Type": "text/plain"}
        answer = await gw.client.post("/v1/notifications/drain", headers=evil)
        assert (answer.status_code, answer.json()["error"]["code"]) == (403, "forbidden")
        answer = await gw.client.post("/v1/tasks", content=b'{"ttlMs": 1000, "maxAttempts": 1}', headers=evil)
        assert answer.status_code == 403
        # DNS rebinding: a foreign name that resolves to loopback.
        answer = await gw.client.get("/v1/tasks/t", headers={"Host": "evil.example:80"})
        assert (answer.status_code, answer.json()["error"]["code"]) == (403, "forbidden")
        # The dashboard's own origin, and clients that send no Origin, are served.
        own = await gw.client.post("/v1/notifications/drain", headers={"Origin": gw.url})
        assert own.status_code == 200
        assert (
            await gw.client.get("/v1/tasks/t", headers={"Origin": "http://evil.example"})
        ).status_code == 200


@pytest.mark.anyio
async def test_the_api_key_is_never_taken_from_a_url(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url, api_key="k3y-in-header-only") as gw:
        key = {"Authorization": "Bearer k3y-in-header-only"}
        await gw.client.post("/v1/tasks", json={"id": "t", "ttlMs": 60_000, "maxAttempts": 1}, headers=key)
        assert (await gw.client.get("/v1/tasks/t", headers=key)).status_code == 200
        # The same answer on read routes and management routes: a key in a URL authenticates nothing.
        in_url = {"token": "k3y-in-header-only"}
        error(await gw.client.get("/v1/tasks/t", params=in_url), 401, "unauthorized")
        error(await gw.client.get("/v1/tasks/t/events", params=in_url), 401, "unauthorized")
        error(await gw.client.get("/v1/tasks/t/stream", params=in_url), 401, "unauthorized")
        error(await gw.client.post("/v1/notifications/drain", params=in_url), 401, "unauthorized")
        error(await gw.client.post("/v1/tasks/t/deliveries", params=in_url), 401, "unauthorized")


@pytest.mark.anyio
async def test_an_overlong_idempotency_key_is_a_bad_request(database_url: str) -> None:
    async with running_gateway(database_url) as gw:
        await gw.client.post("/v1/tasks", json={"id": "t", "ttlMs": 60_000, "maxAttempts": 1})
        answer = await gw.client.post("/v1/tasks/t/deliveries", headers={"Idempotency-Key": "k" * 257})
        assert (answer.status_code, answer.json()["error"]["code"]) == (400, "invalid-request")
        assert "Idempotency-Key" in answer.json()["error"]["message"]


@pytest.mark.anyio
async def test_a_demo_worker_reports_in_process_whatever_the_host_header(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        # A Host naming a port where nothing listens: the worker must not use it as its address.
        answer = await gw.client.post("/v1/demo/tasks", headers={"Host": "127.0.0.1:1"})
        assert answer.status_code == 201, answer.text
        task_id = answer.json()["task"]["id"]
        await eventually(
            lambda: state_of(gw, task_id),
            lambda state: state in ("succeeded", "failed"),
            f"the demo task {task_id} at its end, reported by its worker",
            within_s=30,
            poll_s=0.1,
        )


@pytest.mark.anyio
async def test_a_finished_sse_stream_is_not_reopened(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        made = (await gw.client.post("/v1/tasks", json={"id": "t", "ttlMs": 60_000, "maxAttempts": 1})).json()
        cb = {"Authorization": f"Bearer {made['callbackToken']}"}
        await gw.client.post(
            "/v1/tasks/t/callbacks", json={"event": {"type": "start", "worker": "w"}}, headers=cb
        )
        done = {"type": "fail", "error": "e", "retryable": False}
        await gw.client.post("/v1/tasks/t/callbacks", json={"event": done}, headers=cb)
        # An EventSource reconnecting after the terminal frame (id 2 of the task's epoch) is told to stop
        # (204).
        epoch = made["task"]["epoch"]
        answer = await gw.client.get("/v1/tasks/t/stream", headers={"Last-Event-ID": f"2:{epoch}"})
        assert answer.status_code == 204
        # One still behind gets the rest.
        behind = {"Last-Event-ID": f"1:{epoch}"}
        async with gw.client.stream("GET", "/v1/tasks/t/stream", headers=behind) as stream:
            assert stream.status_code == 200
            body = b"".join([chunk async for chunk in stream.aiter_bytes()]).decode()
        assert f"event: delta\nid: 2:{epoch}\n" in body


@pytest.mark.anyio
async def test_create_app_without_settings_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # `uvicorn --factory gateway:create_app` must not drop GATEWAY_API_KEY on the floor.
    from gateway import create_app

    monkeypatch.chdir(tmp_path)  # the relative database's secret file is made there, not in the checkout
    monkeypatch.setenv("GATEWAY_API_KEY", "from-the-environment")
    monkeypatch.setenv("GATEWAY_DATABASE_URL", "sqlite:///unused.db")
    app = create_app()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        answer = await client.post("/v1/notifications/drain")
    assert answer.status_code == 401


@pytest.mark.anyio
async def test_a_failing_demo_worker_does_not_stop_expiry(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gateway.runtime as runtime_module  # where the gateway starts its demo workers

    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a demo worker that breaks in an unforeseen way")

    monkeypatch.setattr(runtime_module, "run_demo_worker", broken)
    async with running_gateway(sqlite_url) as gw:
        assert (await gw.client.post("/v1/demo/tasks")).status_code == 201
        await gw.client.post("/v1/tasks", json={"id": "short", "ttlMs": 300, "maxAttempts": 1})
        await eventually(
            lambda: state_of(gw, "short"),
            lambda state: state == "expired",
            "the 300 ms task expired",
            poll_s=0.05,
        )
        # And demos still start.
        assert (await gw.client.post("/v1/demo/tasks")).status_code == 201


@pytest.mark.anyio
async def test_metrics_show_the_hub_and_405_names_the_allowed_methods(sqlite_url: str) -> None:
    from websockets.asyncio.client import connect

    async with running_gateway(sqlite_url) as gw:
        await gw.client.post("/v1/tasks", json={"id": "t", "ttlMs": 60_000, "maxAttempts": 1})
        async with connect(gw.url.replace("http", "ws", 1) + "/v1/tasks/t/ws") as ws:
            assert '"caught-up"' in await ws.recv()
            text = (await gw.client.get("/metrics")).text
            assert "gateway_hub_subscriptions 1.0" in text
            assert "gateway_hub_connections 1.0" in text
            assert "gateway_hub_direct_writes 0.0" in text
            made = await gw.client.post("/v1/tasks", json={"id": "t", "ttlMs": 60_000, "maxAttempts": 1})
            await post_callback(gw, "t", made.json()["callbackToken"], {"type": "start", "worker": "w"})
            assert '"event"' in await ws.recv()
            # The entry went straight to the socket, which had room: no writer task woken for it.
            assert "gateway_hub_direct_writes 1.0" in (await gw.client.get("/metrics")).text
        wrong = await gw.client.delete("/v1/tasks/t")
        assert (wrong.status_code, wrong.json()["error"]["code"]) == (405, "method-not-allowed")
        assert set(wrong.headers["allow"].split(", ")) == {"GET", "HEAD"}  # Starlette orders them as a set


@pytest.mark.anyio
async def test_a_background_part_that_fails_stops_the_process(sqlite_url: str) -> None:
    """The hub's catch-up loop dies of an unexpected error: the process must not go on answering while it
    no longer pushes entries. It stops by itself, marked failed (``gateway serve`` then exits 1, so that
    its supervisor restarts it whole)."""
    from gateway import Settings, create_app
    from gateway.server.serve import GatewayServer, server_config

    app = create_app(Settings(database_url=sqlite_url, secret=SECRET))
    gw = app.state.gateway

    async def run(reconcile_s: float | None) -> None:
        raise RuntimeError("a bug in the catch-up loop")

    gw.hub.run = run
    server = GatewayServer(server_config(app, "127.0.0.1", 0, log_level="critical"), app)
    with anyio.fail_after(20):
        await server.serve()  # returns by itself
    assert server.started and server.failed
    assert isinstance(gw.fatal, RuntimeError)


@pytest.mark.anyio
async def test_readiness_fails_once_a_background_part_has_failed(sqlite_url: str) -> None:
    async with running_gateway(sqlite_url) as gw:
        assert (await gw.client.get("/readyz")).status_code == 200
        gw.gateway.fatal = RuntimeError("the sweeper died")
        error(await gw.client.get("/readyz"), 503, "unavailable")
