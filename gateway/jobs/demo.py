"""Demo tasks: a simulated worker that drives a task through the public callback API, so a newcomer sees
live progress at once. On only where the management API is open (loopback, no API key) or when
``GATEWAY_DEMO`` enables it.
"""

from __future__ import annotations

import logging
import random

import anyio
import httpx

from gateway.client.errors import WorkerError
from gateway.client.worker import Worker

log = logging.getLogger("gateway.demo")

# Each demo task: ticks of progress, sometimes a retryable failure and a retry, then success or, now and
# then, a final failure.
TICK_S = 0.4
DEMO_TTL_MS = 120_000
DEMO_MAX_ATTEMPTS = 2


async def run_demo_worker(
    client: httpx.AsyncClient, task_id: str, callback_token: str, *, seed: int | None = None
) -> None:
    """Drive a demo task through the callback API with ``client`` (an httpx client on the gateway)."""
    rng = random.Random(seed)
    try:
        async with Worker(str(client.base_url), task_id, callback_token, client=client) as worker:
            retried = False
            attempt = 0
            while True:
                attempt += 1
                await worker.start(f"demo-worker-{attempt}")
                progress = 0
                fail_at = rng.randint(30, 70) if not retried and rng.random() < 0.3 else None
                while progress < 100:
                    await anyio.sleep(TICK_S)
                    progress = min(100, progress + rng.randint(5, 15))
                    if fail_at is not None and progress >= fail_at:
                        await worker.fail("demo: the worker lost its lease", retryable=True)
                        retried = True
                        break
                    if progress < 100:
                        await worker.progress(progress, f"step-{progress}")
                else:
                    if rng.random() < 0.1:
                        await worker.fail("demo: the input was malformed", retryable=False)
                    else:
                        await worker.succeed(
                            f"demo://results/{task_id}", f"sha256:{rng.getrandbits(64):016x}"
                        )
                    return
    except (WorkerError, httpx.HTTPError, OSError) as exc:  # the task expired, the gateway stops, ...
        log.info("demo worker for %s stopped: %s", task_id, exc)
