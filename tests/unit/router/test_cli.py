"""``agentkv router``'s options become one Settings object."""

from __future__ import annotations

import json

import pytest

from agentkv_server.cli import build_parser
from agentkv_server.errors import ConfigError
from agentkv_server.router.cli import settings_from_args


def parse(*argv: str):
    argv_list = ["router", *argv]
    return build_parser(argv_list).parse_args(argv_list)


def test_options_map_onto_settings(monkeypatch):
    monkeypatch.delenv("AGENTKV_SECRET", raising=False)
    args = parse(
        "--prefill",
        "http://p:1",
        "http://p:2/",
        "--decode",
        "http://d:1",
        "--port",
        "9000",
        "--redis",
        "redis://r:6379/0",
        "--policy",
        "upstream",
        "--prefill-timeout",
        "7",
        "--secret",
        "s3",
    )
    settings = settings_from_args(args, prefill_urls=args.prefill, decode_urls=args.decode)

    assert settings.prefill_urls == ("http://p:1", "http://p:2")
    assert settings.port == 9000 and settings.host == "127.0.0.1"
    assert settings.redis_url == "redis://r:6379/0" and settings.policy == "upstream"
    assert settings.timeouts.prefill_s == 7 and settings.timeouts.decode_s == 600
    assert settings.secret.get_secret_value() == "s3"


def test_config_file_then_options_then_environment_secret(tmp_path, monkeypatch):
    config = tmp_path / "router.json"
    config.write_text(
        json.dumps({"port": 1234, "max_sessions": 7, "timeouts": {"decode_s": 9, "prefill_s": 3}})
    )
    monkeypatch.setenv("AGENTKV_SECRET", "from-env")
    args = parse("--decode", "http://d:1", "--config", str(config), "--prefill-timeout", "5")
    settings = settings_from_args(args, decode_urls=args.decode)

    assert settings.port == 1234 and settings.max_sessions == 7
    assert settings.timeouts.decode_s == 9 and settings.timeouts.prefill_s == 5
    assert settings.secret.get_secret_value() == "from-env"


def test_bad_engine_url_is_a_config_error():
    args = parse("--decode", "d:1")
    with pytest.raises(ConfigError, match="http://"):
        settings_from_args(args, decode_urls=args.decode)


def test_decode_engines_are_required():
    with pytest.raises(SystemExit):
        parse("--prefill", "http://p:1")


def test_api_keys_from_options_or_environment(monkeypatch):
    monkeypatch.setenv("AGENTKV_API_KEYS", "env-key-0123456789, env-key-9876543210")
    from_env = parse("--decode", "http://d:1")
    given = parse("--decode", "http://d:1", "--api-key", "cli-key-0123456789")

    env_keys = settings_from_args(from_env, decode_urls=from_env.decode).api_keys
    cli_keys = settings_from_args(given, decode_urls=given.decode).api_keys

    assert [k.get_secret_value() for k in env_keys] == ["env-key-0123456789", "env-key-9876543210"]
    assert [k.get_secret_value() for k in cli_keys] == ["cli-key-0123456789"]
    assert "cli-key" not in repr(cli_keys)


def test_short_api_key_is_a_config_error(monkeypatch):
    monkeypatch.delenv("AGENTKV_API_KEYS", raising=False)
    args = parse("--decode", "http://d:1", "--api-key", "abc")
    with pytest.raises(ConfigError, match="16 characters"):
        settings_from_args(args, decode_urls=args.decode)


def test_no_local_turns_the_local_path_off(tmp_path):
    config = tmp_path / "router.json"
    config.write_text(json.dumps({"local": {"max_new_tokens": 64}}))
    args = parse("--decode", "http://d:1", "--config", str(config))
    assert settings_from_args(args, decode_urls=args.decode).local.enabled

    args = parse("--decode", "http://d:1", "--config", str(config), "--no-local")
    local = settings_from_args(args, decode_urls=args.decode).local
    assert not local.enabled and local.max_new_tokens == 64
