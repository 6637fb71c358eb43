"""A webhook receiver for the relay's tests, as a user would run one: a real HTTP server on loopback.

It verifies every request with the ``standardwebhooks`` package (the signature, the timestamp's age),
records every try (id, body, answer, whether the signature held, when it began and ended), and answers
as the test tells it: a status, or a hang. It notes when two tries of one ``webhook-id`` were under way at
the same time (the relay must never do that, even from several processes).

In the test's process (:func:`serving_receiver`) the test reads :class:`Receiver` directly; as a process
of its own (``python -m tests.support.receiver --port P --secret S --log F``), which a test kills and
restarts, it appends each try to the JSON-lines file ``F`` before it answers, so the test reads what it
received before it died.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import orjson
import uvicorn
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.support import running

# What the receiver does with a try: ``(webhook id, this id's try number from 1) -> status``; it may wait
# first (a slow or hanging receiver).
Behaviour = Callable[[str, int], Awaitable[int]]


async def always_ok(msg_id: str, attempt: int) -> int:
    return 200


@dataclass
class Try:
    msg_id: str
    timestamp: str
    signature: str
    body: dict[str, Any]
    verified: bool
    status: int
    began: float
    ended: float


class Receiver:
    def __init__(self, secret: str, behaviour: Behaviour = always_ok, *, log: Path | None = None) -> None:
        self.webhook = Webhook(secret)
        self.behaviour = behaviour
        self.log = log
        self.tries: list[Try] = []
        self.counts: Counter[str] = Counter()  # tries that arrived, by id
        self.active: Counter[str] = Counter()  # tries under way, by id
        self.overlaps: list[str] = []  # ids that had a try arrive while another was under way
        self._changed = anyio.Event()
        self.app = Starlette(routes=[Route("/hooks", self.hook, methods=["POST"])])

    @property
    def delivered(self) -> dict[str, dict[str, Any]]:
        """The body of each id answered 2xx at least once."""
        return {t.msg_id: t.body for t in self.tries if 200 <= t.status < 300}

    async def until(self, condition: Callable[[], bool], within_s: float = 30.0) -> None:
        """Wait until ``condition()`` holds (checked at each try's end); fail past ``within_s``."""
        with anyio.move_on_after(within_s):
            while not condition():
                changed = self._changed
                await changed.wait()
            return
        raise AssertionError(
            f"not within {within_s}s; {len(self.delivered)} delivered, {len(self.tries)} tries"
        )

    async def hook(self, request: Request) -> Response:
        began = time.monotonic()
        raw = await request.body()
        headers = dict(request.headers)
        msg_id = headers.get("webhook-id", "")
        self.counts[msg_id] += 1
        if self.active[msg_id]:
            self.overlaps.append(msg_id)
        self.active[msg_id] += 1
        status = 0
        try:
            try:
                self.webhook.verify(raw, headers)
                verified = True
            except WebhookVerificationError:
                verified = False
            status = await self.behaviour(msg_id, self.counts[msg_id])
            record = Try(
                msg_id,
                headers.get("webhook-timestamp", ""),
                headers.get("webhook-signature", ""),
                orjson.loads(raw),
                verified,
                status,
                began,
                time.monotonic(),
            )
            self.tries.append(record)
            if self.log is not None:  # on disk before the answer: a kill after this is a lost 2xx
                with self.log.open("ab") as out:
                    out.write(orjson.dumps(asdict(record)) + b"\n")
                    out.flush()
        finally:
            self.active[msg_id] -= 1
            self._changed.set()
            self._changed = anyio.Event()
        return Response(status_code=status)


def read_log(log: Path) -> list[Try]:
    """The tries a receiver process wrote to ``log`` (a line cut short by a kill is left out)."""
    found = []
    for line in log.read_bytes().splitlines():
        try:
            found.append(Try(**orjson.loads(line)))
        except orjson.JSONDecodeError:
            continue
    return found


@asynccontextmanager
async def serving_receiver(receiver: Receiver) -> AsyncIterator[str]:
    """Run the receiver under uvicorn on a free loopback port for the block; yields its URL."""
    config = uvicorn.Config(receiver.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    async with running(uvicorn.Server(config), "the receiver") as port:
        yield f"http://127.0.0.1:{port}/hooks"


def main() -> None:
    parser = argparse.ArgumentParser(description="a webhook receiver that logs every try")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--secret", required=True)
    parser.add_argument("--log", type=Path, required=True)
    args = parser.parse_args()
    receiver = Receiver(args.secret, log=args.log)
    uvicorn.run(receiver.app, host="127.0.0.1", port=args.port, log_level="info", lifespan="off")


if __name__ == "__main__":
    main()
