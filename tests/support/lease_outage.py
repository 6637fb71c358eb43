"""A gateway outage that outlives a heartbeat lease (issue 32's defect 6), made of real processes and waited
for by its events, never for a fixed time.

:func:`restartable_gateway` runs ``gateway serve`` on a SQLite file, keyed with the Celery tests' API key,
on a fixed port, and a :class:`~tests.support.TcpProxy` in front of it: workers are given the proxy's
``url``, the test reads the gateway directly. :meth:`RestartableGateway.outlive_lease` is the outage: the
workers' way in refuses every connection, the gateway is stopped with SIGTERM and started again on the same
database and port, and the way in opens again only once the restarted gateway's sweeper has ended the
task's lease (its ``fail``, ``heartbeat-timeout``): what a gateway down for longer than the lease does, with
no race between the sweeper and a worker's retry (a retry that came first would renew the lease, and the
outage would not have outlived it).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

from tests.support import TcpProxy, bearer, eventually, http_client
from tests.support.celery_processes import API_KEY
from tests.support.processes import GatewayProcess, free_port, print_tails, spawn_gateway

# The task a lease left: the gateway's own fail, the task no longer running.
TIMED_OUT = "heartbeat-timeout"
# The lease's end and a loaded machine's restart and sweep, at most.
LEASE_ENDED_S = 30.0


class RestartableGateway:
    """A keyed gateway process on ``port`` and the proxy the workers reach it through."""

    def __init__(self, directory: Path, port: int, proxy: TcpProxy) -> None:
        self.directory = directory
        self.port = port
        self.proxy = proxy
        self.gateways: list[GatewayProcess] = []

    @property
    def url(self) -> str:
        """The gateway itself (the test's reads)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def workers_url(self) -> str:
        """The gateway as the workers reach it (through the proxy)."""
        return self.proxy.url

    async def start(self) -> None:
        n = len(self.gateways)
        gw = await spawn_gateway(
            f"gw-{n}",
            f"sqlite:///{self.directory / 'gateway.db'}",
            self.directory / f"gw-{n}.log",
            # Every entry of a history answers a read from version 0 (the tests check the whole of it).
            env={"GATEWAY_API_KEY": API_KEY, "GATEWAY_RETENTION_VERSIONS": "1000"},
            port=self.port,
        )
        self.gateways.append(gw)
        await gw.serving()

    async def task(self, task_id: str) -> dict[str, Any]:
        """The task as the gateway has it (a client of its own: the one before may have seen it stop)."""
        async with http_client(base_url=self.url, headers=bearer(API_KEY)) as client:
            answer = await client.get(f"/v1/tasks/{quote(task_id, safe='')}")
        assert answer.status_code == 200, answer.text
        task: dict[str, Any] = answer.json()
        return task

    async def history(self, task_id: str) -> list[dict[str, Any]]:
        """The task's events, from its first."""
        async with http_client(base_url=self.url, headers=bearer(API_KEY)) as client:
            answer = await client.get(f"/v1/tasks/{quote(task_id, safe='')}/events", params={"cursor": 0})
        assert answer.status_code == 200, answer.text
        return [entry["event"] for entry in answer.json()["events"]]

    async def until(
        self, task_id: str, what: str, accept: Callable[[dict[str, Any]], bool], within_s: float = 30.0
    ) -> dict[str, Any]:
        task: dict[str, Any] = await eventually(
            lambda: self.task(task_id), accept, f"{task_id}: {what}", within_s
        )
        return task

    def cut_off(self) -> None:
        """The workers cannot reach the gateway: every connection refused, those open dropped."""
        self.proxy.refuse = True
        self.proxy.cut()

    def let_through(self) -> None:
        self.proxy.refuse = False

    async def stop(self) -> None:
        """SIGTERM (a deployment's stop)."""
        await self.gateways[-1].stop()

    async def restart_past_the_lease(self, task_id: str) -> dict[str, Any]:
        """Start the gateway again on the same database, the workers still cut off, and wait until its
        sweeper has ended ``task_id``'s lease; then let the workers through. The task as the lease left it."""
        await self.start()
        task = await self.until(
            task_id,
            "its lease ended by the restarted gateway",
            lambda t: t["state"] != "running" and t.get("error") == TIMED_OUT,
            LEASE_ENDED_S,
        )
        self.let_through()
        return task

    async def outlive_lease(self, task_id: str) -> dict[str, Any]:
        """The whole outage: cut off, stopped, restarted past the task's lease, let through."""
        self.cut_off()
        await self.stop()
        return await self.restart_past_the_lease(task_id)


@asynccontextmanager
async def restartable_gateway(directory: Path) -> AsyncIterator[RestartableGateway]:
    """A :class:`RestartableGateway`, serving when the block begins; every gateway process it started is
    stopped at the end (their logs' tails printed when the block failed)."""
    port = free_port()
    async with TcpProxy(port) as proxy:
        place = RestartableGateway(directory, port, proxy)
        failed = False
        try:
            await place.start()
            yield place
        except BaseException:
            failed = True
            raise
        finally:
            for gw in place.gateways:
                with contextlib.suppress(Exception):
                    await gw.stop()
            if failed:
                print_tails(place.gateways)
