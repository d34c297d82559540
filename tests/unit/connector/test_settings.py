"""Connector settings from kv_connector_extra_config and the environment."""

from __future__ import annotations

import pytest

from agentkv_server.connector.settings import ConnectorSettings
from agentkv_server.errors import ConfigError


def test_defaults_follow_upstream_ttl() -> None:
    settings = ConnectorSettings.from_extra_config({}, environ={})
    assert settings.default_retention_seconds == settings.max_retention_seconds == 480.0
    assert settings.report_url is None
    assert (settings.idle_grace_seconds, settings.idle_sleep_seconds) == (0.1, 0.005)
    assert settings.idle_max_wait_seconds == 30.0
    assert settings.nixl_progress_delay_us == 10_000


def test_upstream_ttl_sets_default_and_cap() -> None:
    settings = ConnectorSettings.from_extra_config({"decoder_kv_blocks_ttl": 60}, environ={})
    assert (settings.default_retention_seconds, settings.max_retention_seconds) == (60.0, 60.0)


def test_agentkv_keys() -> None:
    settings = ConnectorSettings.from_extra_config(
        {
            "agentkv_max_retention_seconds": 900,
            "agentkv_router_url": "http://r:8000/",
            "agentkv_secret": "s",
            "agentkv_pull_timeout_seconds": 5,
            "agentkv_idle_grace_ms": 250,
            "agentkv_idle_sleep_ms": 0,
            "agentkv_idle_max_wait_ms": 2000,
            "agentkv_nixl_progress_delay_us": 0,
            "agentkv_sync_load_max_tokens": 256,
            "agentkv_sync_load_timeout_ms": 200,
        },
        environ={},
    )
    assert (settings.idle_grace_seconds, settings.idle_sleep_seconds) == (0.25, 0.0)
    assert (settings.idle_max_wait_seconds, settings.nixl_progress_delay_us) == (2.0, 0)
    assert settings.max_retention_seconds == 900.0
    assert settings.report_url == "http://r:8000/internal/v1/kv-holdings"
    assert settings.secret == "s"
    assert settings.pull_timeout_seconds == 5.0
    assert (settings.sync_load_max_tokens, settings.sync_load_timeout_seconds) == (256, 0.2)


def test_router_url_and_secret_fall_back_to_the_environment() -> None:
    env = {"AGENTKV_ROUTER_URL": "http://env:1", "AGENTKV_SECRET": "e"}
    settings = ConnectorSettings.from_extra_config({}, environ=env)
    assert (settings.router_url, settings.secret) == ("http://env:1", "e")
    explicit = ConnectorSettings.from_extra_config({"agentkv_secret": "x"}, environ=env)
    assert explicit.secret == "x"


@pytest.mark.parametrize(
    "extra",
    [
        {"agentkv_max_retention_seconds": -1},
        {"agentkv_pull_timeout_seconds": 0},
        {"agentkv_report_queue_size": 0},
        {"agentkv_idle_sleep_ms": -1},
        {"agentkv_sync_load_max_tokens": -1},
        {"agentkv_sync_load_timeout_ms": 0},
    ],
)
def test_impossible_values_are_refused(extra: dict) -> None:
    with pytest.raises(ConfigError):
        ConnectorSettings.from_extra_config(extra, environ={})
