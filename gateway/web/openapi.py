"""The OpenAPI 3.1 document of the HTTP routes, built from the wire models (``gateway.web.wire``).

One table (``gateway.web.operations``) says for each route what it takes and answers; the schemas come
from pydantic's ``model_json_schema`` of the same models that validate requests, so the document cannot
drift from the checks. The tests hold the table to the app's routes (every route documented, every
documented path a route) and every answer of a real server to its model. WebSocket routes have no place
in OpenAPI 3.1: they are listed under ``x-websockets``, and ``docs/protocol.md`` describes their frames.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
from typing import Any

import orjson
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from gateway.streams import NAME_PATTERN
from gateway.web import answers
from gateway.web.operations import (
    API_KEY,
    ERRORS,
    LIST_OF,
    OPEN_SUBSCRIBE,
    OPERATIONS,
    REF,
    SECURITY_SCHEMES,
    SSE_EVENT,
    SUBSCRIBE,
    WEBSOCKETS,
    Operation,
)
from gateway.web.stream_wire import STREAM_OPERATIONS

# Every route the document states: the table's, and the streams'.
ALL_OPERATIONS = (*OPERATIONS, *STREAM_OPERATIONS)


def _models() -> list[type[BaseModel]]:
    found: list[type[BaseModel]] = [answers.ErrorAnswer, *LIST_OF.values()]
    for op in ALL_OPERATIONS:
        found += [m for m in op.answers.values() if m is not None]
        if op.body is not None:
            found.append(op.body)
    return list(dict.fromkeys(found))


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _parameters(op: Operation) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if "{task_id}" in op.path:
        out.append(
            {
                "name": "task_id",
                "in": "path",
                "required": True,
                "schema": {"type": "string", "maxLength": 128},
            }
        )
    if "{name}" in op.path:  # a task's stream (protocol.md, Streams)
        name = {"type": "string", "pattern": NAME_PATTERN}
        out.append({"name": "name", "in": "path", "required": True, "schema": name})
    if op.query is not None:
        schema = op.query.model_json_schema()
        required = set(schema.get("required", ()))
        for name, prop in schema["properties"].items():
            prop = dict(prop)
            description = prop.pop("description", "")
            prop.pop("title", None)
            out.append(
                {
                    "name": name,
                    "in": "query",
                    "required": name in required,
                    "description": description,
                    "schema": prop,
                }
            )
    for p in op.params:
        item: dict[str, Any] = {"name": p.name, "in": p.where, "description": p.description}
        item["schema"] = p.schema
        if p.required:
            item["required"] = True
        out.append(item)
    return out


def _responses(op: Operation) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for status, model in op.answers.items():
        answer: dict[str, Any] = {"description": "OK" if status < 300 else ""}
        if status == 201:
            answer["description"] = "created"
        elif status == 204:
            answer["description"] = "no content"
        list_of = LIST_OF.get((op.path, op.method))
        if model is not None:
            answer["content"] = {op.media_type: {"schema": _ref(model)}}
        elif list_of is not None:
            answer["content"] = {op.media_type: {"schema": {"type": "array", "items": _ref(list_of)}}}
        elif op.media_type == "text/event-stream" and status != 204:
            answer["content"] = {op.media_type: {"schema": SSE_EVENT}}
        elif status != 204:
            answer["content"] = {op.media_type: {"schema": {"type": "string"}}}
        if status in op.answer_headers:
            answer["headers"] = op.answer_headers[status]
        out[str(status)] = answer
    for status, codes in sorted({**op.errors, 405: ""}.items()):
        if not codes:
            description = ERRORS[status]
        else:  # a 409's codes are all it can be; elsewhere they add to the status's usual meaning
            description = codes if status == 409 else f"{ERRORS[status]}; {codes}"
        answer = {
            "description": description,
            "content": {"application/json": {"schema": _ref(answers.ErrorAnswer)}},
        }
        if status in (429, 503):
            answer["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
        out[str(status)] = answer
    return out


def _security(op: Operation, open_mode: bool) -> list[dict[str, list[str]]]:
    """Any one of the schemes will do; none listed is a route anyone may call. In open mode there is no API
    key: the management routes (the task list included) take no credential, and reads take none or a task's
    token (which must then be right); a callback still takes its task's callback token."""
    if not open_mode:
        return [{name: []} for name in op.security]
    if API_KEY in op.security and SUBSCRIBE not in op.security:
        return []
    schemes = [name for name in op.security if name != API_KEY]
    if not schemes:
        return []
    optional: list[dict[str, list[str]]] = [{}] if SUBSCRIBE in schemes else []
    return optional + [{name: []} for name in schemes]


def _operation(op: Operation, open_mode: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "operationId": f"{op.method}{op.path}".replace("/", "_").replace("{", "").replace("}", ""),
        "summary": op.summary,
        "tags": list(op.tags),
        "responses": _responses(op),
    }
    if op.description:
        out["description"] = op.description
    parameters = _parameters(op)
    if parameters:
        out["parameters"] = parameters
    if op.body is not None:
        out["requestBody"] = {
            "required": op.body_required,
            "content": {"application/json": {"schema": _ref(op.body)}},
        }
    out["security"] = _security(op, open_mode)
    return out


@functools.cache
def _schemas() -> dict[str, Any]:
    """The JSON schemas of every model the operations name: the same for every app of a process, and the
    dearest part of the document to make (pydantic walks every model), so made once."""
    _, schemas = models_json_schema([(m, "validation") for m in _models()], ref_template=REF)
    return schemas


def package_version() -> str:
    """The installed gateway's version, which the document states."""
    try:
        return importlib.metadata.version("task-gateway")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "0+unknown"


@functools.lru_cache(maxsize=4)
def openapi_bytes(version: str, *, open_mode: bool = False) -> bytes:
    """:func:`openapi_document` as the bytes ``/openapi.json`` answers: the same for every app of a process
    with the same version and mode, so made once."""
    return orjson.dumps(openapi_document(version, open_mode=open_mode))


def openapi_document(version: str, *, open_mode: bool = False) -> dict[str, Any]:
    """The whole document: every operation, and the schemas of every model they name; ``open_mode``: as a
    gateway with no API key serves it (its routes' credentials are not those of a keyed one)."""
    schemas = copy.deepcopy(_schemas())
    paths: dict[str, dict[str, Any]] = {}
    for op in ALL_OPERATIONS:
        paths.setdefault(op.path, {})[op.method] = _operation(op, open_mode)
    schemes = dict(SECURITY_SCHEMES)
    if open_mode:
        del schemes[API_KEY]
        schemes[SUBSCRIBE] = {**schemes[SUBSCRIBE], "description": OPEN_SUBSCRIBE}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "task-gateway",
            "version": version,
            "description": "HTTP callbacks in, live task state out. Every error is "
            '`{"error": {"code", "message"}}`. The protocol, WebSocket frames and close codes included, is '
            "docs/protocol.md in the repository.",
            "license": {"name": "MIT", "identifier": "MIT"},
        },
        "paths": paths,
        "components": {"schemas": schemas.get("$defs", {}), "securitySchemes": schemes},
        "x-websockets": list(WEBSOCKETS),
    }
