"""The example's Celery tasks: a report that takes a few seconds and says how far it got, and an answer
written word by word as a language model writes its tokens (no model here: words drawn from a fixed text).

``install`` is the whole integration: in the producer (app.py, which imports this module to publish) each
published task is created on the gateway, with the Celery task id as its id; in the worker each run is
reported (start, coalesced progress, result or error). The job itself only calls ``progress``.

Configured from the environment, as the README runs it: ``CELERY_BROKER_URL`` (the broker and its vhost,
the URL's path: this machine's RabbitMQ, vhost ``/``, by default), ``REPORT_QUEUE`` (the queue the reports
go through and the worker takes, ``task-gateway-example`` by default: not Celery's ``celery``, which other
apps on the same vhost use), ``GATEWAY_URL`` (``http://127.0.0.1:8000``) and ``GATEWAY_API_KEY`` (the
gateway's API key; none for a gateway in open mode).
"""

from __future__ import annotations

import logging
import os
import random
import time

from celery import Celery, Task

from gateway.integrations.celery import install, progress, write

BROKER_URL = os.environ.get("CELERY_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
# The example's own queue: the app publishes the reports to it, and the worker takes nothing else.
QUEUE = os.environ.get("REPORT_QUEUE", "task-gateway-example")
GATEWAY_URL = os.environ.get("GATEWAY_URL", "http://127.0.0.1:8000")
API_KEY = os.environ.get("GATEWAY_API_KEY") or None
# How long the report works on one row: 40 rows take about 4 s, long enough to watch.
ROW_S = float(os.environ.get("REPORT_ROW_S", "0.1"))
# The pace of an answer's words: 50 a second, as a model's tokens come.
TOKEN_S = float(os.environ.get("ANSWER_TOKEN_S", "0.02"))
# The words an answer is made of (a model would make them up).
VOCABULARY = [
    "the",
    "gateway",
    "keeps",
    "each",
    "task",
    "as",
    "a",
    "versioned",
    "state",
    "machine",
    "and",
    "pushes",
    "every",
    "change",
    "to",
    "whoever",
    "watches",
    "it",
    "a",
    "worker",
    "reports",
    "start",
    "progress",
    "and",
    "its",
    "outcome",
    "over",
    "HTTP",
    "while",
    "its",
    "output",
    "streams",
    "token",
    "by",
    "token",
    "to",
    "every",
    "screen",
    "resumed",
    "from",
    "its",
    "offset",
    "after",
    "a",
    "dropped",
    "link",
    "with",
    "nothing",
    "lost",
    "or",
    "repeated",
]

app = Celery("reports", broker=BROKER_URL)
# No result backend: the gateway keeps each report's state and result, and the page reads it from there.
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    # A worker killed mid-report gives the message back to RabbitMQ; the report runs again as a new attempt
    # once its gateway lease (heartbeatMs, set by app.py) has run out.
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
)
install(app, url=GATEWAY_URL, api_key=API_KEY)
# httpx logs each request at INFO, the worker's level: the reports' callbacks would fill its terminal.
logging.getLogger("httpx").setLevel(logging.WARNING)


@app.task(bind=True, max_retries=2)
def report(self: Task, owner: str, rows: int = 40) -> str:
    """Build ``owner``'s report row by row; the returned string is the report's reference (its
    ``resultRef`` on the gateway)."""
    for row in range(1, rows + 1):
        time.sleep(ROW_S)  # the work on one row
        progress(row * 100 // rows, cursor=f"row-{row}")
    return f"reports/{owner}/{self.request.id}.csv"


class ModelLost(Exception):
    """The model's connection dropped mid-answer (the example's flaky first attempt): retried."""


@app.task(bind=True, max_retries=2)
def answer(self: Task, owner: str, question: str, words: int = 120, flaky: bool = False) -> str:
    """Write an answer to ``question`` word by word to the task's stream ``output``, as a model's tokens
    come; with ``flaky``, the first attempt stops half-way and is retried, and the second attempt's answer
    replaces it on every screen. The returned string is the answer's reference."""
    chooser = random.Random(f"{question}/{self.request.retries}")
    for word in range(words):
        if flaky and self.request.retries == 0 and word == words // 2:
            raise self.retry(exc=ModelLost("the model's connection dropped"), countdown=0)
        time.sleep(TOKEN_S)
        write("output", ("" if word == 0 else " ") + chooser.choice(VOCABULARY))
        progress((word + 1) * 100 // words)
    write("output", ".\n")
    return f"answers/{owner}/{self.request.id}.txt"
