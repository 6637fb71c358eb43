"""The app a test's ``celery -A tests.jobs.celery_worker worker`` process runs:
``tests.jobs.celery_tasks.make_app`` configured by its environment (``TG_BROKER``, ``TG_BACKEND``,
``TG_QUEUE``, ``TG_PREFIX``, ``TG_GATEWAY``, ``TG_API_KEY``, ``TG_TAGS``, ``TG_DIR``: the directory the tasks
and the test share). Imported by worker processes only: the test process, which publishes, makes its own
app."""

from __future__ import annotations

import os
from pathlib import Path

from tests.jobs.celery_tasks import make_app

app = make_app(
    broker=os.environ["TG_BROKER"],
    backend=os.environ["TG_BACKEND"],
    queue=os.environ["TG_QUEUE"],
    prefix=os.environ["TG_PREFIX"],
    gateway=os.environ["TG_GATEWAY"],
    api_key=os.environ.get("TG_API_KEY") or None,
    tags=tuple(t for t in os.environ.get("TG_TAGS", "").split(",") if t),
    shared=Path(os.environ["TG_DIR"]),
)
