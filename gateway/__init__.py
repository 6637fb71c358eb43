"""task-gateway: a real-time gateway for long-running asynchronous tasks."""

from gateway.settings import Settings
from gateway.web.app import create_app

__all__ = ["Settings", "create_app"]
