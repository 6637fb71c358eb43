"""Configuration is read once, from a mapping the test passes (never the process environment)."""

from __future__ import annotations

import pytest

from gateway.settings import ConfigError, Settings


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
    Settings(host="0.0.0.0", api_key="k").check_bind()  # type: ignore[arg-type]


def test_a_bad_value_names_its_variable() -> None:
    with pytest.raises(ConfigError, match="GATEWAY_PORT"):
        Settings.from_environ({"GATEWAY_PORT": "eighty"})
