"""The floor of the fan-out workloads: a raw ``websockets`` server, in a process of its own.

    python -m bench.programs.floor PORT BACKLOG

A subscriber gets a hello on connecting (its "resume frame"), then every message of the publisher
connection (path /publish), sent with ``broadcast()``. Prints ``ready`` once it listens.
"""

from __future__ import annotations

import asyncio
import sys

from websockets.asyncio.server import ServerConnection, broadcast, serve

HELLO = '{"type":"hello","version":0}'


async def main(port: int, backlog: int) -> None:
    subscribers: set[ServerConnection] = set()

    async def handler(ws: ServerConnection) -> None:
        assert ws.request is not None
        if ws.request.path == "/publish":
            async for message in ws:
                broadcast(subscribers, message)
            return
        await ws.send(HELLO)
        subscribers.add(ws)
        try:
            await ws.wait_closed()
        finally:
            subscribers.discard(ws)

    async with serve(handler, "127.0.0.1", port, ping_interval=20, compression=None, backlog=backlog):
        print("ready", flush=True)
        await asyncio.Future()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
