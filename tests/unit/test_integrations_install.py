"""Every queue integration's ``install()`` (arq's ``configure()`` too) checks its options at once: a value the
gateway would refuse at every create raises ``ValueError`` naming the option and what it takes, and nothing
is installed. The bounds it checks against are stated on the client's side (``gateway.client.backend_wire``,
which imports nothing of the server): here they are held to the server's own, as its create schema states
them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
from celery import Celery
from dramatiq.brokers.stub import StubBroker

from gateway.client import backend_wire
from gateway.integrations import arq, celery, dramatiq, rq
from gateway.integrations.report import Reporter
from gateway.tag_names import RULE
from gateway.web.wire import CreateBody

URL = "http://127.0.0.1:1"  # never reached: nothing here sends a request


def test_the_bounds_the_integrations_check_are_the_servers() -> None:
    fields = CreateBody.model_json_schema()["properties"]
    ttl, tags = fields["ttlMs"], fields["tags"]
    (heartbeat,) = [kind for kind in fields["heartbeatMs"]["anyOf"] if kind["type"] == "integer"]
    assert ttl["type"] == "integer" and ttl["exclusiveMinimum"] + 1 == backend_wire.MIN_TTL_MS
    assert ttl["maximum"] == backend_wire.MAX_TTL_MS
    assert (
        heartbeat["minimum"],
        heartbeat["maximum"],
    ) == (backend_wire.MIN_HEARTBEAT_MS, backend_wire.MAX_HEARTBEAT_MS)
    assert tags["maxItems"] == backend_wire.MAX_TAGS and tags["uniqueItems"] is True
    assert tags["items"]["pattern"] == backend_wire.TAG_PATTERN
    assert backend_wire.TAG_RULE == RULE


def _celery(**options: Any) -> object:
    app = Celery("install-test")
    try:
        return celery.install(app, url=options.pop("url", URL), **options)
    finally:
        celery.uninstall(app)


INSTALLS: dict[str, Callable[..., object]] = {
    "celery": _celery,
    "rq": lambda **options: rq.install(**{"url": URL, **options}),
    "arq configure": lambda **options: arq.configure(**{"url": URL, **options}),
    "dramatiq": lambda **options: dramatiq.install(StubBroker(), **{"url": URL, **options}),
}

# (options, the words the error starts with, words it says of the range)
REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"heartbeat": 0.5}, "heartbeat: must be from 1 s to 4,503,599,627,370 s", "heartbeatMs: 1000 to 2**52"),
    ({"heartbeat": 0}, "heartbeat: must be from 1 s", "got 0"),
    ({"heartbeat": float("nan")}, "heartbeat: must be from 1 s", "got nan"),
    ({"heartbeat": True}, "heartbeat: must be from 1 s", "got True"),
    ({"heartbeat": 2**52 / 1000 + 1}, "heartbeat: must be from 1 s", "heartbeatMs: 1000 to 2**52"),
    ({"ttl": 0}, "ttl: must be from 0.001 s", "ttlMs: 1 to 2**52"),
    ({"ttl": 0.0004}, "ttl: must be from 0.001 s", "got 0.0004"),
    ({"ttl": -60}, "ttl: must be from 0.001 s", "got -60"),
    ({"ttl": timedelta(days=-1)}, "ttl: must be from 0.001 s", "got -86400.0"),
    ({"ttl": 1e300}, "ttl: must be from 0.001 s", "ttlMs: 1 to 2**52"),
    ({"timeout": 0}, "timeout: must be a number of seconds, above 0", "got 0"),
    ({"timeout": float("inf")}, "timeout: must be a number of seconds, above 0", "got inf"),
    ({"min_interval": -1}, "min_interval: must be a number of seconds, 0 or more", "got -1"),
    ({"tags": "owner:u42"}, "tags: must be a list of tags", "got 'owner:u42'"),
    ({"tags": ["owner u42"]}, "tags: 'owner u42' is not a tag", "1 to 128 characters of A-Z"),
    ({"tags": ["x" * 129]}, "tags: 'xxx", "1 to 128 characters"),
    ({"tags": ["a", "a"]}, "tags: 'a' is given more than once", "each tag once"),
    ({"tags": [f"t{n}" for n in range(17)]}, "tags: at most 16 tags per task", "got 17"),
    (
        {"url": "127.0.0.1:8000"},
        "url: must be the gateway's address, http:// or https://",
        "'127.0.0.1:8000'",
    ),
    ({"url": "ftp://127.0.0.1"}, "url: must be the gateway's address", "'ftp://127.0.0.1'"),
    ({"api_key": ""}, "api_key: must be the gateway's API key", "None for a gateway in open mode"),
]


@pytest.fixture
def reporters(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The module-level reporters of RQ and arq, put back after the test."""
    for module in (rq, arq):
        monkeypatch.setattr(module, "_reporter", module._reporter)
    yield


@pytest.mark.usefixtures("reporters")
@pytest.mark.parametrize("install", INSTALLS.values(), ids=INSTALLS.keys())
@pytest.mark.parametrize(("options", "starts", "says"), REFUSED, ids=[f"{o}" for o, _, _ in REFUSED])
def test_an_option_the_gateway_would_refuse_is_refused_at_install(
    install: Callable[..., object], options: dict[str, Any], starts: str, says: str
) -> None:
    with pytest.raises(ValueError) as refused:
        install(**options)
    message = str(refused.value).replace("4503599627370496", "2**52")
    assert message.startswith(starts) and says in message, message


@pytest.mark.usefixtures("reporters")
def test_a_refused_install_installs_nothing() -> None:
    # Celery: no signal handler connected.
    app = Celery("install-test")
    receivers = {signal: list(signal.receivers or ()) for signal in celery.SIGNALS}
    with pytest.raises(ValueError, match=r"^heartbeat: "):
        celery.install(app, url=URL, heartbeat=0.5)
    assert {signal: list(signal.receivers or ()) for signal in celery.SIGNALS} == receivers
    # RQ and arq: the reporter installed before stays.
    kept = rq.install(url=URL)
    with pytest.raises(ValueError, match=r"^heartbeat: "):
        rq.install(url=URL, heartbeat=0.5)
    assert rq._reporter is kept
    settings: dict[str, Any] = {"functions": []}
    with pytest.raises(ValueError, match=r"^tags: "):
        arq.install(settings, url=URL, tags=["no spaces"])
    assert settings == {"functions": []}  # nothing wrapped, no hook chained
    # Dramatiq: no middleware added.
    broker = StubBroker()
    middleware = list(broker.middleware)
    with pytest.raises(ValueError, match=r"^ttl: "):
        dramatiq.install(broker, url=URL, ttl=0)
    assert broker.middleware == middleware


@pytest.mark.usefixtures("reporters")
@pytest.mark.parametrize("install", INSTALLS.values(), ids=INSTALLS.keys())
def test_the_bounds_themselves_are_taken(install: Callable[..., object]) -> None:
    made = install(
        url="https://gateway.example:8443/",
        api_key="key",
        heartbeat=1,
        ttl=timedelta(milliseconds=1),
        timeout=0.001,
        min_interval=0,
        tags=[f"t{n}" for n in range(15)] + ["x" * 128],
    )
    reporter = made.reporter if isinstance(made, dramatiq.GatewayMiddleware) else made
    assert isinstance(reporter, Reporter)
    config = reporter.config
    assert (config.heartbeat_ms, config.ttl_ms, config.timeout_s, config.min_interval_s) == (
        1000,
        1,
        0.001,
        0,
    )
    assert len(config.tags) == 16
    largest = install(heartbeat=2**52 / 1000, ttl=2**52 / 1000)
    reporter = largest.reporter if isinstance(largest, dramatiq.GatewayMiddleware) else largest
    assert isinstance(reporter, Reporter)
    assert (reporter.config.heartbeat_ms, reporter.config.ttl_ms) == (2**52, 2**52)
