"""A request's JSON body, read within its limits: refused with 415 when declared as something else, 413 past
the size limit without reading the rest, 408 when it has not all arrived in time."""

from __future__ import annotations

import anyio
from starlette.requests import ClientDisconnect, Request

from gateway.errors import InvalidRequest, PayloadTooLarge, RequestTimeout, UnsupportedMediaType


def check_json_type(request: Request) -> None:
    """A body is JSON: ``application/json`` (or a ``+json`` type), or no ``Content-Type`` at all; anything
    else is 415. (A form or text/plain body is what a cross-site page can post without a preflight.)"""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not (
        media_type.startswith("application/") and media_type.endswith("+json")
    ):
        raise UnsupportedMediaType(
            f"Content-Type {media_type or declared!r}: the body must be JSON; send "
            "'Content-Type: application/json' (curl: -H 'Content-Type: application/json', or --json)"
        )


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The JSON request body, refused with 415 when declared as something else, with 413 past ``limit``
    bytes without reading the rest, and with 408 when it has not all arrived within ``timeout_s``."""
    check_json_type(request)
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes is over the limit of {limit} bytes")
    chunks: list[bytes] = []
    size = 0
    with anyio.move_on_after(timeout_s) as scope:
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise PayloadTooLarge(f"body is over the limit of {limit} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            # Nobody is left to read the answer: one access line, not a traceback.
            raise InvalidRequest("the client closed the connection before the body was complete") from None
    if scope.cancelled_caught:
        raise RequestTimeout(f"the request body did not arrive within {timeout_s:g} s")
    return b"".join(chunks)
