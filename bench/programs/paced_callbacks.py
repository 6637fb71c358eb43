"""The batches workload's callback driver, in a process of its own, so that the client is not what limits the
rate (an httpx client in the bench process reached ~150 children/s of the 500/s asked): the raw-socket
HTTP/1.1 client of bench/programs/callback_client.py.

    python -m bench.programs.paced_callbacks PORT RATE CONNECTIONS < TASKS

``TASKS`` is one JSON object a line, ``{"id": ..., "token": ...}`` (a created task and its callback token).
Task ``i`` is due at ``i / RATE`` seconds from the start (or as soon as one of the ``CONNECTIONS`` keep-alive
connections is free): it is started and succeeded, two callbacks one after the other on one connection,
each with a callbackId of its own. Prints one JSON line: ``{"elapsed": s, "done": callbacks answered 200
with a change, "errors": {status or reason: count}}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

from bench.programs.callback_client import exchange, request_bytes

START = {"type": "start", "worker": "bench"}
SUCCEED = {"type": "succeed", "resultRef": "s3://bench/result", "resultHash": "sha256:b"}


async def drive(port: int, rate: float, connections: int, tasks: list[dict[str, str]]) -> None:
    done = [0]
    errors: dict[str, int] = {}
    due = iter(range(len(tasks)))
    started = time.perf_counter()

    async def connection() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for i in due:
                await asyncio.sleep(max(0.0, started + i / rate - time.perf_counter()))
                task = tasks[i]
                path = f"/v1/tasks/{task['id']}/callbacks"
                for n, event in enumerate((START, SUCCEED)):
                    body: dict[str, object] = {"callbackId": f"{task['id']}-{n}", "event": event}
                    status, answer = await exchange(reader, writer, request_bytes(path, body, task["token"]))
                    if status == 200 and json.loads(answer).get("changed"):
                        done[0] += 1
                    else:
                        errors[str(status)] = errors.get(str(status), 0) + 1
        finally:
            writer.close()

    await asyncio.gather(*(connection() for _ in range(connections)))
    elapsed = time.perf_counter() - started
    print(json.dumps({"elapsed": elapsed, "done": done[0], "errors": errors}), flush=True)


if __name__ == "__main__":
    lines = [json.loads(line) for line in sys.stdin if line.strip()]
    asyncio.run(drive(int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3]), lines))
