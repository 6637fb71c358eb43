"""Python clients of the gateway: ``watch`` and ``watch_tag`` for subscribers, ``Worker`` (async) and
``SyncWorker`` for the jobs that report, ``AsyncBackend`` and ``Backend`` (sync) for the backend that
creates, cancels, lists and drains tasks with the API key.

They import nothing of the server (no Starlette, SQLAlchemy, uvicorn, ...): ``from gateway.client import
watch`` loads httpx/websockets and these modules only.
"""

from gateway.client.backend import AsyncBackend, Backend
from gateway.client.backend_wire import Created, Drained, Page, TagToken
from gateway.client.errors import (
    AttemptOver,
    BackendError,
    CallbackError,
    CallbackIgnored,
    ClientError,
    TaskAlreadyRunning,
    TaskCancelled,
    TaskExists,
    UnknownTask,
    WorkerError,
)
from gateway.client.sync_worker import SyncWorker
from gateway.client.watch import WatchError, watch, watch_tag
from gateway.client.worker import Worker

__all__ = [
    "AsyncBackend",
    "AttemptOver",
    "Backend",
    "BackendError",
    "CallbackError",
    "CallbackIgnored",
    "ClientError",
    "Created",
    "Drained",
    "Page",
    "SyncWorker",
    "TagToken",
    "TaskAlreadyRunning",
    "TaskCancelled",
    "TaskExists",
    "UnknownTask",
    "WatchError",
    "Worker",
    "WorkerError",
    "watch",
    "watch_tag",
]
