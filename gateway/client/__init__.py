"""Python clients of the gateway: ``watch`` for subscribers, ``Worker`` for the jobs that report."""

from gateway.client.watch import WatchError, watch
from gateway.client.worker import CallbackError, Worker

__all__ = ["CallbackError", "WatchError", "Worker", "watch"]
