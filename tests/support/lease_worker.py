"""A worker as a process of its own, for the tests that kill or stop it:
``python -m tests.support.lease_worker URL TASK_ID CALLBACK_TOKEN NAME MODE``.

It runs the task's job with the Python ``Worker`` (which heartbeats in the background while the task has
a lease): ``start``, print ``started ATTEMPT LEASE_UNTIL_MS HEARTBEAT_MS``, then the job, for as long as it
is let run:

- ``progress``: a progress callback every 100 ms (each renews the lease too);
- ``idle``: no callback at all; only the Worker's own heartbeats hold the task.

When the Worker raises ``AttemptOver`` (the gateway said its attempt is over) it prints ``attempt over
CODE`` and exits 3.
"""

from __future__ import annotations

import sys
from itertools import count

import anyio

from gateway.client import AttemptOver, Worker

PROGRESS_EVERY_S = 0.1


async def main(url: str, task_id: str, token: str, name: str, mode: str) -> None:
    try:
        async with Worker(url, task_id, token) as worker:
            answer = await worker.start(name)
            print(
                f"started {worker.attempt} {answer.get('leaseUntilMs')} {answer.get('heartbeatMs')}",
                flush=True,
            )
            if mode == "idle":
                await anyio.sleep_forever()
            for done in count(1):
                await worker.progress(min(done, 99), cursor=f"row-{done}")
                await anyio.sleep(PROGRESS_EVERY_S)
    except AttemptOver as over:
        print(f"attempt over {over.code}", flush=True)
        sys.exit(3)


if __name__ == "__main__":
    url, task_id, token, name, mode = sys.argv[1:6]
    anyio.run(main, url, task_id, token, name, mode)
