"""What a browser opens: the dashboard (``/``) and its demo tasks (``/v1/demo``), the API page (``/docs``)
over the OpenAPI document (``/openapi.json``), and ``static/`` (the pages' scripts, gateway-client.js)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

from gateway.errors import NotFound, Unavailable
from gateway.jobs.demo import DEMO_MAX_ATTEMPTS, DEMO_TTL_MS
from gateway.machine import task_to_json
from gateway.web import wire
from gateway.web.context import context_of


def _static_dir() -> Path:
    """``static/`` of the checkout (an editable install), else where a wheel installs it."""
    checkout = Path(__file__).resolve().parents[2] / "static"
    if checkout.is_dir():
        return checkout
    return Path(sys.prefix) / "share" / "task-gateway" / "static"


STATIC_DIR = _static_dir()


class Static(StaticFiles):
    """``static/``, with TypeScript declarations (``gateway-client.d.ts``) as text rather than what the
    platform's MIME table says of ``.ts`` (an MPEG transport stream)."""

    def __init__(self) -> None:
        super().__init__(directory=STATIC_DIR, check_dir=False)

    def file_response(self, full_path: Any, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(full_path, *args, **kwargs)
        if str(full_path).endswith(".ts"):
            response.headers["content-type"] = "application/typescript; charset=utf-8"
        return response


async def index(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "index.html")


async def api_page(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "api.html")


async def openapi_json(request: Request) -> Response:
    return wire.JSON(context_of(request).openapi)


async def demo_status(request: Request) -> Response:
    return wire.JSON({"enabled": context_of(request).gateway.settings.demo_enabled})


async def start_demo(request: Request) -> Response:
    gw = context_of(request).gateway
    if not gw.settings.demo_enabled:
        raise NotFound(f"no route {request.url.path}")
    if not gw.can_spawn_demo():
        raise Unavailable("too many demo tasks are running; try again in a moment")
    task, _ = await gw.book.create(f"demo-{uuid.uuid4().hex[:12]}", DEMO_TTL_MS, DEMO_MAX_ATTEMPTS)
    # The simulated worker reports through the public callback API, like any worker.
    gw.spawn_demo(task.id, gw.tokens.issue(task.id, "callback", DEMO_TTL_MS))
    answer = {
        "task": task_to_json(task),
        "subscribeToken": gw.tokens.issue(task.id, "subscribe", DEMO_TTL_MS),
    }
    return wire.JSON(answer, status_code=201)
