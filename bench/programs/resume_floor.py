"""The floor of the streams' resume (bench/workloads/stream_live.py): a raw ``websockets`` server that answers
a subscriber with a bare ``SELECT`` of a stream's rows and one send, in a process of its own.

    python -m bench.programs.resume_floor PORT DATABASE_FILE

A subscriber at ``/TASK_ID/STREAM`` gets a hello (its "resume frame"), then one ``chunks`` frame holding
every chunk of the stream: its rows of the gateway's own SQLite file (``stream_batches``, read-only),
selected in offset order, their JSON arrays spliced into the frame as stored (nothing decoded). Prints
``ready`` once it listens.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys

from websockets.asyncio.server import ServerConnection, serve

from bench.programs.floor import HELLO

SELECT = "SELECT chunks FROM stream_batches WHERE task_id = ? AND stream = ? ORDER BY first_offset"


async def main(port: int, database: str) -> None:
    db = sqlite3.connect(f"file:{database}?mode=ro", uri=True, check_same_thread=False)

    async def handler(ws: ServerConnection) -> None:
        assert ws.request is not None
        _, task_id, stream = ws.request.path.split("/")
        await ws.send(HELLO)
        rows = db.execute(SELECT, (task_id, stream)).fetchall()
        head = f'{{"type":"chunks","taskId":"{task_id}","stream":"{stream}","attempt":1,"offset":0,"chunks":['
        body = b",".join(bytes(chunks)[1:-1] for (chunks,) in rows)
        await ws.send(head.encode() + body + b"]}", text=True)
        await ws.wait_closed()

    async with serve(handler, "127.0.0.1", port, compression=None, max_size=2**22):
        print("ready", flush=True)
        await asyncio.Future()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]), sys.argv[2]))
