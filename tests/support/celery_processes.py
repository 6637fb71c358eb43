"""What the Celery tests run: a RabbitMQ vhost or a Redis queue of their own, ``celery worker`` processes
(prefork, 2 children) on it, a gateway process keyed with an API key.

Each is stopped and cleaned up when its block ends, failure or not (a worker's whole process group: its
prefork children die with it); a block that ends with an exception prints the worker's log tail.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import httpx
from celery import Celery
from redis import Redis
from redis.exceptions import RedisError

from tests.jobs.celery_tasks import make_app
from tests.support.processes import GatewayProcess, gateway_environ, print_tails, spawn_gateway, unavailable

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672"
# The Celery tests' own Redis database (queue-contract.md: one per helper, so no cleanup hurts another's).
REDIS = "redis://127.0.0.1:6379/11"
API_KEY = "celery-tests-api-key-0123456789"
# How long a worker may take to say it is ready on a busy machine, and to stop.
READY_S = 60.0
STOP_S = 15.0
CHECKOUT = Path(__file__).resolve().parents[2]  # where ``tests.jobs.celery_worker`` is imported from
READY = re.compile(rb"@\S+ ready\.")


@dataclass(frozen=True)
class Broker:
    """Where a test's Celery messages go and its results are kept, its own for the test."""

    url: str
    backend: str
    queue: str
    prefix: str  # of every Redis key Celery makes (results; messages on the Redis broker)


def _rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", "-q", *args], check=True, capture_output=True, timeout=60)


@contextmanager
def rabbitmq_broker() -> Iterator[Broker]:
    """A RabbitMQ vhost of the test's own (deleted at the end, queues and all); results in Redis db 11."""
    if shutil.which("rabbitmqctl") is None:
        unavailable("rabbitmqctl is not installed; RabbitMQ is needed for this test")
    vhost = f"tg-{uuid.uuid4().hex[:12]}"
    try:
        _rabbitmqctl("add_vhost", vhost)
        _rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        unavailable(f"RabbitMQ is not usable at 127.0.0.1:5672 ({exc})")
    try:
        with _redis_keys() as prefix:
            yield Broker(f"{RABBITMQ}/{vhost}", REDIS, f"tg-{uuid.uuid4().hex[:12]}", prefix)
    finally:
        _rabbitmqctl("delete_vhost", vhost)


@contextmanager
def redis_broker() -> Iterator[Broker]:
    """A queue of the test's own in Redis db 11, results in the same db, every key under a prefix of the
    test's own (deleted at the end)."""
    with _redis_keys() as prefix:
        yield Broker(REDIS, REDIS, f"tg-{uuid.uuid4().hex[:12]}", prefix)


@contextmanager
def _redis_keys() -> Iterator[str]:
    """A prefix for the Redis keys Celery makes in db 11, and their deletion at the end."""
    client = Redis.from_url(REDIS, socket_connect_timeout=2)
    try:
        client.ping()
    except (RedisError, OSError) as exc:
        unavailable(f"Redis is not reachable at {REDIS} ({exc})")
    prefix = f"tg-{uuid.uuid4().hex[:12]}-"
    try:
        yield prefix
    finally:
        for key in client.scan_iter(match=f"{prefix}*", count=500):
            client.delete(key)
        client.close()


@asynccontextmanager
async def keyed_gateway(directory: Path, *, port: int = 0, name: str = "gw") -> AsyncIterator[GatewayProcess]:
    """``gateway serve`` on a SQLite file in ``directory``, keyed with :data:`API_KEY`; stopped at the end."""
    gw = await spawn_gateway(
        name,
        f"sqlite:///{directory / 'gateway.db'}",
        directory / f"{name}.log",
        env={"GATEWAY_API_KEY": API_KEY},
        port=port,
    )
    failed = False
    try:
        await gw.serving()
        yield gw
    except BaseException:
        failed = True
        raise
    finally:
        await gw.stop()
        if failed:
            print_tails([gw])


class CeleryWorker:
    """One ``celery worker --pool prefork --concurrency 2`` process (its own session: its children are its
    process group)."""

    def __init__(self, name: str, process: anyio.abc.Process, log: Path) -> None:
        self.name = name
        self.process = process
        self.log = log

    def tail(self, lines: int = 80) -> str:
        return "\n".join(self.log.read_bytes().decode(errors="replace").splitlines()[-lines:])

    async def ready(self) -> None:
        with anyio.move_on_after(READY_S):
            while not READY.search(await anyio.Path(self.log).read_bytes()):
                if self.process.returncode is not None:
                    raise AssertionError(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")
                await anyio.sleep(0.05)  # a child's log has nothing to wait on but reading it again
            return
        raise AssertionError(f"{self.name} not ready within {READY_S}s:\n{self.tail()}")

    async def stop(self) -> None:
        """A warm shutdown (SIGTERM), then SIGKILL to the whole group past :data:`STOP_S`."""
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                self.process.send_signal(signal.SIGTERM)
                with anyio.move_on_after(STOP_S):
                    await self.process.wait()
            with contextlib.suppress(ProcessLookupError):  # what is left of its group (its children)
                os.killpg(self.process.pid, signal.SIGKILL)
            if self.process.returncode is None:
                await self.process.wait()
            await self.process.aclose()


@asynccontextmanager
async def celery_worker(
    broker: Broker,
    gateway_url: str,
    shared: Path,
    *,
    name: str = "w1",
    tags: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> AsyncIterator[CeleryWorker]:
    """A Celery worker process of ``tests.jobs.celery_worker``'s app, ready when the block begins."""
    environ = gateway_environ(
        {
            "TG_BROKER": broker.url,
            "TG_BACKEND": broker.backend,
            "TG_QUEUE": broker.queue,
            "TG_PREFIX": broker.prefix,
            "TG_GATEWAY": gateway_url,
            "TG_API_KEY": API_KEY,
            "TG_TAGS": ",".join(tags),
            "TG_DIR": str(shared),
            **(env or {}),
        }
    )
    command = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tests.jobs.celery_worker",
        "worker",
        "--pool",
        "prefork",
        "--concurrency",
        "2",
        "--hostname",
        f"{name}@%h",
        "--loglevel",
        "INFO",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "--queues",
        broker.queue,
    ]
    log = shared / f"{name}.log"
    with log.open("wb") as out:
        process = await anyio.open_process(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environ,
            cwd=CHECKOUT,
            start_new_session=True,
        )
    worker = CeleryWorker(name, process, log)
    try:
        await worker.ready()
        yield worker
    except BaseException:
        print(f"\n----- {name} (pid {process.pid}): {log} -----\n{worker.tail()}")
        raise
    finally:
        await worker.stop()


def publishing_app(broker: Broker, gateway_url: str, shared: Path, **options: Any) -> Celery:
    """The test process's own app of ``tests.jobs.celery_tasks``, to publish on ``broker`` (no result
    backend) with the gateway at ``gateway_url`` and the API key; ``options``: ``make_app``'s others."""
    return make_app(
        broker=broker.url,
        backend="disabled://",
        queue=broker.queue,
        prefix=broker.prefix,
        gateway=gateway_url,
        api_key=API_KEY,
        shared=shared,
        **options,
    )


async def read_task(client: httpx.AsyncClient, task_id: str) -> dict[str, Any]:
    answer = await client.get(f"/v1/tasks/{task_id}")
    assert answer.status_code == 200, answer.text
    task: dict[str, Any] = answer.json()
    return task


async def read_history(client: httpx.AsyncClient, task_id: str) -> dict[str, Any]:
    answer = await client.get(f"/v1/tasks/{task_id}/events", params={"cursor": 0})
    assert answer.status_code == 200, answer.text
    history: dict[str, Any] = answer.json()
    return history
