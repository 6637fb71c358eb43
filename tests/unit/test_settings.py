"""Configuration is read once, from a mapping the test passes (never the process environment)."""

from __future__ import annotations

import logging

import pytest

from gateway.errors import ConfigError
from gateway.settings import Settings, unknown_variables


def test_environment_is_read_into_settings() -> None:
    settings = Settings.from_environ(
        {
            "GATEWAY_PORT": "9000",
            "GATEWAY_API_KEY": "s3cr3t-key",
            "GATEWAY_ALLOWED_ORIGINS": "https://a.example, *",
        }
    )
    assert settings.port == 9000
    assert settings.api_key is not None and settings.api_key.get_secret_value() == "s3cr3t-key"
    assert settings.allowed_origins == ("https://a.example", "*")
    assert "s3cr3t-key" not in repr(settings)  # secrets never print


@pytest.mark.parametrize("value", ["", "   "])
def test_a_blank_api_key_is_refused_not_taken_for_open_mode(value: str) -> None:
    # An empty key from `--api-key "$UNSET"` must not open the management API on a public address.
    with pytest.raises(ConfigError, match="GATEWAY_API_KEY"):
        Settings.from_environ({"GATEWAY_HOST": "0.0.0.0"}, api_key=value)


def test_open_mode_is_refused_off_loopback() -> None:
    with pytest.raises(ConfigError, match="GATEWAY_API_KEY"):
        Settings(host="0.0.0.0").check_bind()
    Settings(host="::1").check_bind()
    Settings(host="0.0.0.0", api_key="k").check_bind()


def test_a_bad_value_names_its_variable() -> None:
    with pytest.raises(ConfigError, match="GATEWAY_PORT"):
        Settings.from_environ({"GATEWAY_PORT": "eighty"})


def test_unknown_variables_are_named_with_the_closest_known_one() -> None:
    environ = {
        "GATEWAY_SERCET": "x",
        "GATEWAY_DATABASEURL": "sqlite:///g.db",
        "GATEWAY_COLOUR": "blue",
        "GATEWAY_URL": "http://127.0.0.1:8000",  # gateway watch's
        "GATEWAY_PORT": "8000",
        "HOME": "/root",
    }
    assert unknown_variables(environ) == (
        "ignoring unknown variables GATEWAY_COLOUR, "
        "GATEWAY_DATABASEURL (did you mean GATEWAY_DATABASE_URL?), "
        "GATEWAY_SERCET (did you mean GATEWAY_SECRET?)"
    )
    assert unknown_variables({"GATEWAY_PORT": "1"}) is None


def test_log_level_and_secret_length_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"^GATEWAY_LOG_LEVEL: unknown log level 'loud'"):
        Settings.from_environ({"GATEWAY_LOG_LEVEL": "loud"})
    assert Settings.from_environ({"GATEWAY_LOG_LEVEL": "WARNING"}).logging_level == logging.WARNING
    assert Settings(log_level="trace").logging_level == 5
    with pytest.raises(ConfigError, match=r"^GATEWAY_SECRET: must be at least 32 bytes \(it has 31\)"):
        Settings.from_environ({"GATEWAY_SECRET": "s" * 31})
    Settings.from_environ({"GATEWAY_SECRET": "s" * 32})


def test_retention_is_whole_seconds_from_zero_to_a_hundred_years() -> None:
    assert Settings.from_environ({}).retain_finished_s == 7 * 24 * 3600
    assert Settings.from_environ({"GATEWAY_RETAIN_FINISHED_S": "0"}).retain_finished_s == 0  # keep all
    for bad in ("-1", "7d", "1.5", str(101 * 365 * 24 * 3600)):
        with pytest.raises(ConfigError, match=r"^GATEWAY_RETAIN_FINISHED_S: ") as refused:
            Settings.from_environ({"GATEWAY_RETAIN_FINISHED_S": bad})
        assert "\n" not in str(refused.value), bad


def test_a_bus_channel_is_a_name_redis_and_postgresql_both_take() -> None:
    assert Settings.from_environ({}).bus_channel is None  # the deployment's own
    channel = Settings.from_environ({"GATEWAY_BUS_CHANNEL": "orders-prod:task_gateway.v2"}).bus_channel
    assert channel == "orders-prod:task_gateway.v2"
    assert Settings.from_environ({"GATEWAY_BUS_CHANNEL": "c" * 63}).bus_channel == "c" * 63
    # Too long for a PostgreSQL identifier (NOTIFY's channel), a space, a glob Redis' PSUBSCRIBE would expand.
    for bad in ("c" * 64, "orders prod", "orders*", "tâches"):
        with pytest.raises(ConfigError, match=r"^GATEWAY_BUS_CHANNEL: must be 1 to 63 letters") as refused:
            Settings.from_environ({"GATEWAY_BUS_CHANNEL": bad})
        assert "\n" not in str(refused.value), bad
