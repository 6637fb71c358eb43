"""Every queue integration's ``install()`` (arq's ``configure()`` too) quiets httpx's line per request (the
``httpx`` logger at INFO: a line per progress callback and heartbeat in a worker run at ``--loglevel
INFO``), unless the user has chosen that logger's level."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import pytest
from celery import Celery
from dramatiq.brokers.stub import StubBroker

from gateway.integrations import arq, celery, dramatiq, rq

URL = "http://127.0.0.1:1"  # never reached: nothing here sends a request


def _celery() -> None:
    app = Celery("logging-test")
    celery.install(app, url=URL)
    celery.uninstall(app)


INSTALLS: dict[str, Callable[[], object]] = {
    "celery": _celery,
    "rq": lambda: rq.install(url=URL),
    "arq install": lambda: arq.install({"functions": []}, url=URL),
    "arq configure": lambda: arq.configure(url=URL),
    "dramatiq": lambda: dramatiq.install(StubBroker(), url=URL),
}


@pytest.fixture
def httpx_logger(monkeypatch: pytest.MonkeyPatch) -> Iterator[logging.Logger]:
    """The ``httpx`` logger, its level put back after the test (and the reporters the installs made)."""
    for module in (rq, arq):
        monkeypatch.setattr(module, "_reporter", module._reporter)
    logger = logging.getLogger("httpx")
    level = logger.level
    yield logger
    logger.setLevel(level)


@pytest.mark.parametrize("install", INSTALLS.values(), ids=INSTALLS.keys())
def test_install_sets_httpx_to_warning_when_nobody_chose_its_level(
    install: Callable[[], object], httpx_logger: logging.Logger
) -> None:
    httpx_logger.setLevel(logging.NOTSET)
    install()
    assert httpx_logger.level == logging.WARNING


@pytest.mark.parametrize("install", INSTALLS.values(), ids=INSTALLS.keys())
def test_install_keeps_the_httpx_level_the_user_chose(
    install: Callable[[], object], httpx_logger: logging.Logger
) -> None:
    httpx_logger.setLevel(logging.INFO)
    install()
    assert httpx_logger.level == logging.INFO
