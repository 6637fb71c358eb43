"""A loopback HTTP proxy that loses answers after the server wrote them, as a proxy's timeout or a backend
restarted mid-read does: the server has done the work and sent its answer; the client sees its connection
closed with no answer at all.

One request per connection (the client opens a new one each time:
``httpx.Limits(max_keepalive_connections=0)``). Each answer the server wrote is read whole, recorded (with
the request's ``Idempotency-Key``), then passed on or dropped by a seeded random, so a run loses the same
answers every time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Carried:
    """One answer the server wrote."""

    idempotency_key: str | None
    status: int
    body: bytes
    # Passed on to the client (else the client saw its connection closed without an answer).
    delivered: bool


def _headers(head: bytes) -> tuple[str, dict[str, str]]:
    """The first line and the headers (names in lower case) of a message's head."""
    first, *lines = head.decode("latin-1").split("\r\n")
    fields = {}
    for line in lines:
        if line:
            name, _, value = line.partition(":")
            fields[name.strip().lower()] = value.strip()
    return first, fields


class LossyProxy:
    def __init__(self, target_port: int, *, loss: float, seed: int) -> None:
        self.target_port = target_port
        self.loss = loss
        self._random = random.Random(seed)
        self.carried: list[Carried] = []
        # What went wrong in a pipe (the test asserts there is nothing).
        self.errors: list[BaseException] = []

    def check_appends(self, chunks: int) -> int:
        """For a producer of a task's streams through this proxy: ``chunks`` chunks appended, each once; some
        answers of the appends lost, and each lost one followed by a retry of the same batch (its ``seq``),
        answered as a duplicate. Returns how many were lost."""
        assert not self.errors
        answers = [(json.loads(carried.body), carried.delivered) for carried in self.carried]
        appends: list[tuple[dict[str, Any], bool]] = [(a, d) for a, d in answers if "nextOffset" in a]
        lost = sum(not delivered for _, delivered in appends)
        assert lost > 0, "no append's answer was lost: the test proves nothing"
        assert sum(bool(answer["duplicate"]) for answer, _ in appends) == lost
        assert sum(a["nextOffset"] - a["offset"] for a, _ in appends if not a["duplicate"]) == chunks
        return lost

    @asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        """Serve until the block ends; yields the proxy's URL."""
        server = await asyncio.start_server(self._carry, "127.0.0.1", 0)
        try:
            yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        finally:
            server.close()
            await server.wait_closed()

    async def _carry(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            head = await client_r.readuntil(b"\r\n\r\n")
            _, fields = _headers(head)
            request = head + await client_r.readexactly(int(fields.get("content-length", "0")))
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
            try:
                server_w.write(request)
                await server_w.drain()
                answer_head = await server_r.readuntil(b"\r\n\r\n")
                status_line, answer_fields = _headers(answer_head)
                body = await server_r.readexactly(int(answer_fields["content-length"]))
            finally:
                server_w.close()
                await server_w.wait_closed()
            delivered = self._random.random() >= self.loss
            status = int(status_line.split()[1])
            self.carried.append(Carried(fields.get("idempotency-key"), status, body, delivered))
            if delivered:
                client_w.write(answer_head + body)
                await client_w.drain()
        except Exception as exc:
            self.errors.append(exc)
        finally:
            client_w.close()
            with contextlib.suppress(ConnectionError):  # the client went first
                await client_w.wait_closed()
