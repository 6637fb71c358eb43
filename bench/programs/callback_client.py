"""The callbacks workload's client, in a process of its own (one core), so that it is not what is measured:
a small raw-socket HTTP/1.1 client.

    python -m bench.programs.callback_client PORT CONNECTIONS SECONDS

``CONNECTIONS`` keep-alive connections each drive tasks of their own through start and progress 1..100
(every callback a real change, each with a unique callbackId) for ``SECONDS``; prints one JSON line:
``{"per_s": ..., "done": ..., "errors": {status: count}}``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid


def request_bytes(path: str, body: dict[str, object], token: str) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {token}\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> tuple[int, bytes]:
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    return status, await reader.readexactly(length)


async def client_main(port: int, connections: int, seconds: float) -> None:
    run = uuid.uuid4().hex[:8]
    done = [0]
    errors: dict[int, int] = {}
    stop_at = 0.0

    async def one(c: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        k = 0
        while True:
            task_id = f"b-{run}-{c}-{k}"
            status, body = await exchange(
                reader,
                writer,
                request_bytes("/v1/tasks", {"id": task_id, "ttlMs": 3_600_000, "maxAttempts": 1}, "none"),
            )
            token = json.loads(body)["callbackToken"]
            path = f"/v1/tasks/{task_id}/callbacks"
            steps = [{"type": "start", "worker": "w"}] + [
                {"type": "progress", "progress": p, "cursor": "c"} for p in range(1, 101)
            ]
            for i, event in enumerate(steps):
                if time.monotonic() >= stop_at:
                    writer.close()
                    return
                status, _ = await exchange(
                    reader,
                    writer,
                    request_bytes(path, {"callbackId": f"{task_id}-{i}", "event": event}, token),
                )
                if status == 200:
                    done[0] += 1
                else:
                    errors[status] = errors.get(status, 0) + 1
            k += 1

    stop_at = time.monotonic() + seconds
    started = time.monotonic()
    await asyncio.gather(*(one(c) for c in range(connections)))
    elapsed = time.monotonic() - started
    print(json.dumps({"per_s": done[0] / elapsed, "done": done[0], "errors": errors}), flush=True)


if __name__ == "__main__":
    asyncio.run(client_main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])))
