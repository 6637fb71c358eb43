"""What `gateway serve` says it runs on: on Redis, the bus and the deployment's channel, never a password."""

from __future__ import annotations

from gateway.server.startup import summary
from gateway.settings import Settings

PG = "postgresql://gw@db.internal/gateway"


def lines(bus_url: str | None, bus_channel: str | None = None) -> list[str]:
    settings = Settings(database_url=PG, bus_url=bus_url, bus_channel=bus_channel, api_key="k")
    return summary(settings, "GATEWAY_SECRET", "0.0.0.0", 8000, deployment_id="5f0c9a")


def test_on_redis_a_line_names_the_server_and_the_deployments_channel_never_the_password() -> None:
    said = lines("redis://:hunter2@cache.internal:6380/2")
    assert said[1] == "bus Redis cache.internal:6380/2, channel task_gateway:5f0c9a"
    assert "hunter2" not in "\n".join(said)
    assert (
        lines("rediss://cache.internal")[1] == "bus Redis cache.internal:6379/0, channel task_gateway:5f0c9a"
    )
    assert (
        lines("unix:///run/redis.sock")[1] == "bus Redis socket /run/redis.sock, channel task_gateway:5f0c9a"
    )


def test_a_configured_channel_is_the_one_named() -> None:
    assert (
        lines("redis://cache.internal:6379/0", "orders")[1]
        == "bus Redis cache.internal:6379/0, channel orders"
    )


def test_without_redis_there_is_no_bus_line() -> None:
    # LISTEN/NOTIFY's channel is the database's own (the first line names it); the local bus links nothing.
    for bus_url in (None, "postgres", "local"):
        said = lines(bus_url)
        assert len(said) == 2 and said[1].startswith("dashboard at "), said
