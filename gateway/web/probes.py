"""What an operator's probes read: ``/healthz`` (the process answers), ``/readyz`` (it can serve: nothing
failed for good, the disk has room, the database answers) and ``/metrics`` (Prometheus)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import Unavailable
from gateway.store.database import DISK_FULL
from gateway.web import wire
from gateway.web.context import context_of


async def healthz(request: Request) -> Response:
    return wire.JSON({"status": "ok"})


async def readyz(request: Request) -> Response:
    gw = context_of(request).gateway
    if gw.fatal is not None:
        raise Unavailable("this process is stopping: a background part failed")
    if gw.db.disk_full():  # reads would pass; writes fail until space is freed
        raise Unavailable(f"{DISK_FULL}: writes fail until space is freed on it")
    await gw.db.ping()
    return wire.JSON({"status": "ready"})


async def metrics(request: Request) -> Response:
    text = context_of(request).gateway.metrics.render()
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")
