"""task-gateway: a real-time gateway for long-running asynchronous tasks.

Importing ``gateway`` loads nothing else, so that ``gateway.client`` (the Python clients) and the pure core
(``gateway.machine``) do not drag in the server's stack: ``Settings`` and ``create_app`` load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gateway.settings import Settings
    from gateway.web.app import create_app

__all__ = ["Settings", "create_app"]


def __getattr__(name: str) -> Any:
    if name == "Settings":
        from gateway.settings import Settings

        return Settings
    if name == "create_app":
        from gateway.web.app import create_app

        return create_app
    raise AttributeError(f"module 'gateway' has no attribute {name!r}")
