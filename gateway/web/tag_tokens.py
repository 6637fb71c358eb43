"""``POST /v1/tokens``: its endpoint, and its body, validated as the other wire models are
(``gateway.web.wire``; its tag as every tag, ``gateway.web.tags``)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError
from starlette.requests import Request
from starlette.responses import Response

from gateway.tokens import MAX_TAG_TOKEN_TTL_S
from gateway.web.context import context_of
from gateway.web.tags import Tag
from gateway.web.wire import JSON, _Body, _validate, parse_json

DEFAULT_TTL_S = 3600


def _ttl_s(value: Any) -> int:
    """A whole number of seconds (3600 or 3600.0: one JSON number), from 1 to a year."""
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or not 1 <= value <= MAX_TAG_TOKEN_TTL_S:
        raise PydanticCustomError(
            "ttl_range", f"must be a whole number of seconds from 1 to {MAX_TAG_TOKEN_TTL_S} (a year)"
        )
    return int(value)


TtlS = Annotated[
    int,
    PlainValidator(_ttl_s),
    WithJsonSchema(
        {"type": "integer", "minimum": 1, "maximum": MAX_TAG_TOKEN_TTL_S, "default": DEFAULT_TTL_S}
    ),
]


class TokenBody(_Body):
    """A tag token's request: the tag it reads, and how long it lasts."""

    tag: Tag = Field(description="the token reads the tasks carrying this tag, and lists them")
    ttlS: TtlS = Field(default=DEFAULT_TTL_S, description="seconds the token is valid for, from now")


def parse_token_body(raw: bytes) -> TokenBody:
    return _validate(TokenBody, parse_json(raw))


async def tag_token(request: Request) -> Response:
    """``POST /v1/tokens``: a tag token, issued with the API key (or none in open mode)."""
    context = context_of(request)
    context.guard.management(request)
    asked = parse_token_body(await context.body(request))
    token, exp_s = context.gateway.tokens.issue_tag(asked.tag, asked.ttlS)
    return JSON({"token": token, "expiresAtMs": exp_s * 1000}, status_code=201)
