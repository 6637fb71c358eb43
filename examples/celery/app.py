"""The example's web app: a page where a user starts reports and watches all of them live.

Every report is a Celery task (tasks.py) published with the tag ``owner:<user>``; the page gets one tag
token for that tag (``GET /api/session``, minted by the gateway's ``POST /v1/tokens`` through
``gateway.client.AsyncBackend``) and follows every task carrying it with gateway-client.js's
``subscribeTag``, those started later included: one socket, straight to the gateway, with no polling of
this app and no result backend.

The user is named by the page's address (``/?user=alice``) to keep the example short; a real app takes it
from its session, never from the request.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from tasks import API_KEY, GATEWAY_URL, answer, report

from gateway.client import AsyncBackend, ClientError

HERE = Path(__file__).resolve().parent
# Where browsers reach the gateway (the page imports gateway-client.js from it and opens its socket there).
PUBLIC_GATEWAY_URL = os.environ.get("GATEWAY_PUBLIC_URL", GATEWAY_URL)
# A user name the tag can carry (tags take A-Z a-z 0-9 : . _ @ -, at most 128 characters).
USER = re.compile(r"[A-Za-z0-9._@-]{1,64}")
TOKEN_TTL_S = 3600
# A report's rows unless the request says (the page does not), and the most it may ask for.
ROWS = 40
MAX_ROWS = 1000
# A report's lease: a worker that dies mid-report is noticed within this, and the report runs again.
HEARTBEAT_MS = 10_000


def owner_tag(user: str) -> str:
    return f"owner:{user}"


def _user(value: Any) -> str | None:
    return value if isinstance(value, str) and USER.fullmatch(value) else None


def _refused(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


async def page(request: Request) -> FileResponse:
    return FileResponse(HERE / "static" / "index.html")


async def session(request: Request) -> JSONResponse:
    """What the page needs to follow the user's reports: the gateway's address and a tag token."""
    user = _user(request.query_params.get("user"))
    if user is None:
        return _refused("user: 1 to 64 of A-Z a-z 0-9 . _ @ -")
    backend: AsyncBackend = request.app.state.backend
    try:
        token = await backend.tag_token(owner_tag(user), ttl_s=TOKEN_TTL_S)
    except ClientError as exc:
        return _refused(f"the gateway at {GATEWAY_URL} did not give a token: {exc}", 503)
    return JSONResponse(
        {
            "user": user,
            "tag": owner_tag(user),
            "token": token.token,
            "expiresAtMs": token.expires_at_ms,
            "gatewayUrl": PUBLIC_GATEWAY_URL,
        }
    )


def publish_report(user: str, rows: int) -> str:
    """Publish one report for ``user``; returns its id (the Celery task id, which is the gateway's)."""
    headers = {"gateway": {"tags": [owner_tag(user)], "heartbeatMs": HEARTBEAT_MS}}
    return str(report.apply_async(args=(user, rows), headers=headers).id)


async def start_report(request: Request) -> JSONResponse:
    """``{"user", "rows"?}``: start a report of ``rows`` rows (40 by default, at most 1,000)."""
    body = await request.json()
    if not isinstance(body, dict):
        return _refused("the body is a JSON object")
    user, rows = _user(body.get("user")), body.get("rows", ROWS)
    if user is None:
        return _refused("user: 1 to 64 of A-Z a-z 0-9 . _ @ -")
    if not isinstance(rows, int) or isinstance(rows, bool) or not 1 <= rows <= MAX_ROWS:
        return _refused(f"rows: an integer from 1 to {MAX_ROWS}")
    # apply_async blocks (the broker; the gateway's create, bounded by install's timeout): off the loop.
    task_id = await run_in_threadpool(publish_report, user, rows)
    return JSONResponse({"taskId": task_id}, status_code=201)


def publish_answer(user: str, question: str, flaky: bool) -> str:
    """Publish one answer for ``user``; returns its id."""
    headers = {"gateway": {"tags": [owner_tag(user)], "heartbeatMs": HEARTBEAT_MS}}
    return str(answer.apply_async(args=(user, question), kwargs={"flaky": flaky}, headers=headers).id)


async def ask(request: Request) -> JSONResponse:
    """``{"user", "question", "flaky"?}``: start an answer, written word by word to its stream ``output``
    (``flaky``: its first attempt stops half-way and is retried, to see a retry's answer replace it)."""
    body = await request.json()
    if not isinstance(body, dict):
        return _refused("the body is a JSON object")
    user, question, flaky = _user(body.get("user")), body.get("question"), body.get("flaky", False)
    if user is None:
        return _refused("user: 1 to 64 of A-Z a-z 0-9 . _ @ -")
    if not isinstance(question, str) or not 1 <= len(question) <= 500:
        return _refused("question: 1 to 500 characters")
    if not isinstance(flaky, bool):
        return _refused("flaky: true or false")
    task_id = await run_in_threadpool(publish_answer, user, question, flaky)
    return JSONResponse({"taskId": task_id}, status_code=201)


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    async with AsyncBackend(GATEWAY_URL, API_KEY) as backend:
        app.state.backend = backend
        yield


app = Starlette(
    routes=[
        Route("/", page),
        Route("/api/session", session),
        Route("/api/reports", start_report, methods=["POST"]),
        Route("/api/answers", ask, methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ],
    lifespan=lifespan,
)
