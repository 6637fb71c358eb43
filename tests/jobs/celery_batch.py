"""A Celery group of short jobs on the gateway, as a batch (issue 34): the parent task the group becomes,
and its children, each with a title of its own and a status line that moves. For the tests that follow a
batch (tests/integration/test_celery_batch.py, and a browser test's batch card).

How to run it: a gateway keyed with ``tests.support.celery_processes.API_KEY``
(``keyed_gateway(directory)``), a broker (``rabbitmq_broker()`` or ``redis_broker()``), a worker of the
Celery tests' app (``celery_worker(broker, gateway_url, shared)``: it runs ``tg.batch_item``), then from the
test process, with ``app = publishing_app(broker, gateway_url, shared)``::

    parent_id, child_ids = publish_batch(app)      # blocking (the producer creates the tasks): to_thread

``parent_id`` is the group's id and the parent task's; its title ``Quarterly reports`` unless ``title``
says; each child ``Report NN`` (01 to 20), whose status line reads ``Item <i>: step <n> of <steps>``. The
parent ends ``succeeded`` once the 20 have (the worker whose job ends the group ends it), its ``children``
counts then ``{"total": 20, "succeeded": 20, ...}``.
"""

from __future__ import annotations

from collections.abc import Sequence

from celery import Celery, group

# The batch's size, its title, and each job's steps and pause between them (about a second a job).
COUNT = 20
TITLE = "Quarterly reports"
STEPS = 5
PAUSE_S = 0.2


def child_title(index: int) -> str:
    return f"Report {index + 1:02d}"


def publish_batch(
    app: Celery,
    *,
    count: int = COUNT,
    title: str = TITLE,
    steps: int = STEPS,
    pause_s: float = PAUSE_S,
    tags: Sequence[str] = (),
) -> tuple[str, list[str]]:
    """Publish a group of ``count`` ``tg.batch_item`` jobs; the parent's id (the group's) and the children's
    ids, in the group's order."""
    jobs = [
        app.signature("tg.batch_item", args=(index, steps, pause_s)).set(
            headers={"gateway": {"title": child_title(index), "batchTitle": title, "tags": list(tags)}}
        )
        for index in range(count)
    ]
    result = group(jobs).apply_async()
    return str(result.id), [str(child.id) for child in result.results]
