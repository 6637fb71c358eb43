"""The floor of workload 10 (bench/workloads/hundredk.py): one raw ``websockets`` process of several serving
the same sockets, keeping task -> set of sockets (not run by hand).

    python -m bench.programs.sharded_floor PORT BACKLOG

Every process listens on PORT with ``SO_REUSEPORT`` (the kernel spreads the connections over them) and on
a port of its own for the publisher, which it prints (``ready PUBLISH_PORT``). A subscriber connects to
``/t/TASK``, gets a hello (its "resume frame", version 0) and then every frame the publisher sends for
TASK (a message ``TASK\\nFRAME``), sent with ``broadcast()`` to that task's sockets in this process. The
publisher sends each message to every process, as the gateway's bus tells every worker of a commit.
"""

from __future__ import annotations

import asyncio
import sys

from websockets.asyncio.server import ServerConnection, broadcast, serve

HELLO = '{"type":"hello","version":0}'
tasks: dict[str, set[ServerConnection]] = {}


async def subscriber(ws: ServerConnection) -> None:
    assert ws.request is not None
    task = ws.request.path.rsplit("/", 1)[-1]
    await ws.send(HELLO)
    sockets = tasks.setdefault(task, set())
    sockets.add(ws)
    try:
        await ws.wait_closed()
    finally:
        sockets.discard(ws)
        if not sockets:
            tasks.pop(task, None)


async def publisher(ws: ServerConnection) -> None:
    async for message in ws:
        task, _, frame = str(message).partition("\n")
        sockets = tasks.get(task)
        if sockets:
            broadcast(sockets, frame)


async def main(port: int, backlog: int) -> None:
    async with (
        serve(
            subscriber,
            "127.0.0.1",
            port,
            reuse_port=True,
            ping_interval=20,
            compression=None,
            backlog=backlog,
        ),
        serve(publisher, "127.0.0.1", 0, ping_interval=20, compression=None, backlog=backlog) as publish,
    ):
        publish_port = next(iter(publish.sockets)).getsockname()[1]
        print(f"ready {publish_port}", flush=True)
        await asyncio.Future()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
