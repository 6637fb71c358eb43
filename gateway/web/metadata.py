"""``POST /v1/tasks/{task_id}/metadata`` (protocol.md, Metadata): a merge patch on a task's metadata, from its
worker (the callback token: fenced by ``attempt``, counted against the task's callback rate, renewing its
lease) or from a backend (the API key: any task, ended ones too, fenced only when it gives ``attempt``)."""

from __future__ import annotations

from pydantic import Field
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import InvalidRequest
from gateway.machine import task_to_json
from gateway.web import wire
from gateway.web.context import context_of
from gateway.web.task_fields import MetadataObject


class PatchBody(wire._Body):
    attempt: wire.Attempt | None = Field(
        default=None,
        description="the attempt the worker is running (required with the callback token; with the API key "
        "the patch is fenced by it only when given)",
    )
    patch: MetadataObject = Field(
        description="an RFC 7396 merge patch on the task's metadata: null removes a key, objects merge"
    )


async def patch_metadata(request: Request) -> Response:
    context = context_of(request)
    gw = context.gateway
    task_id = request.path_params["task_id"]
    worker = context.guard.patcher(request, task_id)
    if worker:
        context.callback_rate.take(task_id)  # before the body is read, as a callback's
    body = wire._validate(PatchBody, wire.parse_json(await context.body(request)))
    if worker and body.attempt is None:
        raise InvalidRequest("attempt: required with the callback token (the attempt the worker runs)")
    patched = await gw.metadata.patch(task_id, body.patch, attempt=body.attempt, worker=worker)
    if patched.changed:
        gw.metrics.metadata_patches.inc()
    return wire.JSON({"task": task_to_json(patched.task)})
