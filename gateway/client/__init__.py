"""Python clients of the gateway: ``watch`` and ``watch_tag`` for subscribers, ``Worker`` for the jobs that
report.

They import nothing of the server (no Starlette, SQLAlchemy, uvicorn, ...): ``from gateway.client import
watch`` loads httpx/websockets and these modules only.
"""

from gateway.client.errors import (
    AttemptOver,
    CallbackError,
    CallbackIgnored,
    ClientError,
    TaskAlreadyRunning,
    TaskCancelled,
    WorkerError,
)
from gateway.client.watch import WatchError, watch, watch_tag
from gateway.client.worker import Worker

__all__ = [
    "AttemptOver",
    "CallbackError",
    "CallbackIgnored",
    "ClientError",
    "TaskAlreadyRunning",
    "TaskCancelled",
    "WatchError",
    "Worker",
    "WorkerError",
    "watch",
    "watch_tag",
]
