"""The streams workload's producers, in a process of their own (one core), so that they are not what is
measured: stream appends over keep-alive HTTP/1.1 connections (the raw-socket client of
bench/programs/callback_client.py), one connection per stream.

    python -m bench.programs.stream_client PORT SPEC

``SPEC`` (JSON): ``producers``: ``[{"task", "token", "attempt", "stream", "index"}, ...]``; ``chunks``: chunks
a batch; ``rate``: batches a second per producer (0: each sent once the previous one is answered);
``batches``: batches per producer (0: no bound but time); ``seconds``: no batch is sent once that long has
passed since the start (a server far behind ends the run there). A producer at a rate sends its batch
``seq`` when due (``seq / rate`` after its start, the producers' starts spread over one period) or, if the
previous one is still unanswered, as soon as it is answered. A batch answered 503 or 429 is sent again with
the same ``seq`` after 50 ms (a producer's retry). Each answer's ``offset`` must be the stream's next.

Prints one JSON line: ``{"taken": {task: batches}, "asked", "elapsed", "late", "retries", "errors",
"misplaced"}`` (``late``: batches sent more than one period after they were due; ``misplaced``: answers
whose offset was not the stream's next).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

from bench.programs.callback_client import exchange, request_bytes

CHUNK_BYTES = 20


def chunk(index: int, seq: int, i: int) -> str:
    """Chunk ``i`` of batch ``seq`` of producer ``index``: ``CHUNK_BYTES`` bytes, each chunk of a run its
    own (so that a chunk lost, repeated or misplaced shows in the text read back)."""
    return f"{index}:{seq}:{i} ".ljust(CHUNK_BYTES, "x")


def batch(index: int, seq: int, chunks: int) -> list[str]:
    return [chunk(index, seq, i) for i in range(chunks)]


async def produce(port: int, spec: dict[str, Any], producer: dict[str, Any], result: dict[str, Any]) -> None:
    rate, chunks, batches = spec["rate"], spec["chunks"], spec["batches"]
    path = f"/v1/tasks/{producer['task']}/streams/{producer['stream']}"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    period = 1 / rate if rate else 0.0
    start = result["start"] + period * producer["index"] / spec["spread"]
    seq = 0
    try:
        while (not batches or seq < batches) and time.monotonic() < result["stop_at"]:
            if rate:
                due = start + seq * period
                now = time.monotonic()
                if due > now:
                    await asyncio.sleep(due - now)
                elif now - due > period:
                    result["late"] += 1
            body = {
                "attempt": producer["attempt"],
                "seq": seq,
                "chunks": batch(producer["index"], seq, chunks),
            }
            request = request_bytes(path, body, producer["token"])
            while True:
                status, answer = await exchange(reader, writer, request)
                if status not in (429, 503):
                    break
                result["retries"] += 1
                await asyncio.sleep(0.05)
            if status != 200:
                result["errors"][str(status)] = result["errors"].get(str(status), 0) + 1
                return
            got = json.loads(answer)
            if (got["offset"], got["nextOffset"]) != (seq * chunks, (seq + 1) * chunks):
                result["misplaced"] += 1
            result["taken"][producer["task"]] = seq + 1
            seq += 1
    finally:
        writer.close()


async def client_main(port: int, spec: dict[str, Any]) -> None:
    producers = spec["producers"]
    spec["spread"] = len(producers)
    result: dict[str, Any] = {"taken": {}, "late": 0, "retries": 0, "errors": {}, "misplaced": 0}
    result["start"] = time.monotonic()
    result["stop_at"] = result["start"] + spec["seconds"]
    await asyncio.gather(*(produce(port, spec, p, result) for p in producers))
    result["elapsed"] = time.monotonic() - result["start"]
    result["asked"] = spec["batches"] * len(producers)
    del result["start"], result["stop_at"]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    asyncio.run(client_main(int(sys.argv[1]), json.loads(sys.argv[2])))
