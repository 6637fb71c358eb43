"""Busy workers, as a process of their own:
``python -m tests.support.busy_workers URL COUNT CURSOR_BYTES [READY_AFTER]``.

Each of ``COUNT`` workers runs tasks back to back as fast as the gateway answers: it creates a task (an hour
to live), starts it, reports progress 1..100 one callback at a time (each with a ``callbackId`` and a
``cursor`` of ``CURSOR_BYTES``, the bookmark of a worker that keeps its state there), succeeds it, and
takes the next. A subscriber on one ``/v1/ws`` socket follows every task the workers run, so the
gateway fans out every entry as it commits it. It prints ``ready`` once the workers have had
``READY_AFTER`` callbacks answered (200), runs until its standard input closes, then prints ``callbacks N``
(answered 2xx) and exits.

Run apart from what measures the gateway (bench/checks/under_load.py, and the tests that run it small), so
that the load's own client work does not delay what that observes.
"""

from __future__ import annotations

import json
import sys
from itertools import count
from typing import Any

import anyio
import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

READY_AFTER = 200


class Load:
    def __init__(self, base: str, workers: int, cursor_bytes: int, ready_after: int = READY_AFTER) -> None:
        self.base = base
        self.workers = workers
        self.cursor_bytes = cursor_bytes
        self.ready_after = ready_after
        self.answered = 0
        self.refused: list[str] = []
        self.ready = anyio.Event()
        self.task_numbers = count()

    async def worker(self, n: int, client: httpx.AsyncClient, watcher: ClientConnection) -> None:
        while True:
            task_id = f"busy-{n:02d}-{next(self.task_numbers):06d}"
            made = await client.post("/v1/tasks", json={"id": task_id, "ttlMs": 3_600_000, "maxAttempts": 1})
            made.raise_for_status()
            token = made.json()["callbackToken"]
            await watcher.send(json.dumps({"type": "subscribe", "taskId": task_id, "cursor": 0}))
            events: list[dict[str, Any]] = [{"type": "start", "worker": f"w{n}"}]
            events += [
                {"type": "progress", "progress": p, "cursor": f"row-{p}-".ljust(self.cursor_bytes, "x")}
                for p in range(1, 101)
            ]
            events.append({"type": "succeed", "resultRef": f"s3://r/{task_id}", "resultHash": "sha256:0"})
            for i, event in enumerate(events):
                answer = await client.post(
                    f"/v1/tasks/{task_id}/callbacks",
                    json={"callbackId": f"{task_id}/{i}", "event": event},
                    headers={"Authorization": f"Bearer {token}"},
                )
                if answer.status_code >= 300:
                    self.refused.append(f"{answer.status_code} {answer.text}")
                    continue
                self.answered += 1
                if self.answered == self.ready_after:
                    self.ready.set()

    async def watch(self, watcher: ClientConnection) -> None:
        try:
            async for _ in watcher:
                pass
        except ConnectionClosed:
            pass

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.workers, max_keepalive_connections=self.workers)
        ws_base = "ws" + self.base.removeprefix("http")
        async with (
            httpx.AsyncClient(base_url=self.base, timeout=30, limits=limits) as client,
            connect(f"{ws_base}/v1/ws", max_size=None) as watcher,
            anyio.create_task_group() as tg,
        ):
            tg.start_soon(self.watch, watcher)
            for n in range(self.workers):
                tg.start_soon(self.worker, n, client, watcher)
            await self.ready.wait()
            print("ready", flush=True)
            await anyio.to_thread.run_sync(sys.stdin.read)  # until the test closes our standard input
            tg.cancel_scope.cancel()
        print(f"callbacks {self.answered} refused {len(self.refused)} {self.refused[:3]}", flush=True)


def main() -> None:
    base, workers, cursor_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    ready_after = int(sys.argv[4]) if len(sys.argv) > 4 else READY_AFTER
    anyio.run(Load(base, workers, cursor_bytes, ready_after).run)


if __name__ == "__main__":
    main()
