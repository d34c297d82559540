"""``agentkv router``'s options, ``AGENTKV_*`` variables and ``--config`` become one Settings."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agentkv_server.cli import build_parser, main
from agentkv_server.errors import ConfigError
from agentkv_server.router.cli import settings_from_args
from agentkv_server.settings import environment_settings


@pytest.fixture(autouse=True)
def _no_agentkv_environment(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("AGENTKV_"):
            monkeypatch.delenv(name)


def parse(*argv: str):
    argv_list = ["router", *argv]
    return build_parser(argv_list).parse_args(argv_list)


def test_options_map_onto_settings():
    args = parse(
        "--prefill-url",
        "http://p:1",
        "http://p:2/",
        "--decode-url",
        "http://d:1",
        "--port",
        "9000",
        "--redis-url",
        "redis://r:6379/0",
        "--policy",
        "upstream",
        "--first-token-timeout",
        "7",
        "--max-queue-wait",
        "30",
        "--secret",
        "s3",
    )
    settings = settings_from_args(args)

    assert settings.prefill_urls == ("http://p:1", "http://p:2")
    assert settings.decode_urls == ("http://d:1",)
    assert settings.port == 9000 and settings.host == "127.0.0.1"
    assert settings.redis_url == "redis://r:6379/0" and settings.policy == "upstream"
    assert settings.timeouts.first_token_s == 7 and settings.timeouts.decode_s == 600
    assert settings.admission.max_wait_s == 30
    assert settings.secret.get_secret_value() == "s3"


def test_engine_urls_are_repeatable():
    args = parse("--decode-url", "http://d:1", "--decode-url", "http://d:2")
    assert settings_from_args(args).decode_urls == ("http://d:1", "http://d:2")


def test_old_spellings_still_work_and_warn(capsys, monkeypatch):
    args = parse("--prefill", "http://p:1", "--decode", "http://d:1", "--redis", "redis://r")
    settings = settings_from_args(args)
    assert settings.prefill_urls == ("http://p:1",) and settings.decode_urls == ("http://d:1",)
    assert settings.redis_url == "redis://r"

    from agentkv_server.router import cli as router_cli

    monkeypatch.setattr(router_cli, "run", lambda args: 0)
    assert main(["router", "--decode", "http://d:1"]) == 0
    assert "--decode is deprecated, use --decode-url" in capsys.readouterr().err


def test_the_prefill_step_deadline_became_the_turns(capsys, monkeypatch, caplog):
    """A prefill step's own deadline marked a merely busy P down (docs/faults.md, "Busy is not
    dead"); the old option and config key now set the turn's deadline, with a warning."""
    args = parse("--decode-url", "http://d:1", "--prefill-timeout", "45")
    assert settings_from_args(args).timeouts.first_token_s == 45

    from agentkv_server.router import cli as router_cli
    from agentkv_server.settings import Settings

    monkeypatch.setattr(router_cli, "run", lambda args: 0)
    assert main(["router", "--decode-url", "http://d:1", "--prefill-timeout", "45"]) == 0
    assert "--prefill-timeout is deprecated, use --first-token-timeout" in capsys.readouterr().err
    with caplog.at_level("WARNING"):
        settings = Settings.model_validate(
            {"decode_urls": ["http://d:1"], "timeouts": {"prefill_s": 30}}
        )
    assert settings.timeouts.first_token_s == 30
    assert "timeouts.prefill_s is deprecated" in caplog.text


def test_layers_config_file_then_environment_then_options(tmp_path, monkeypatch):
    config = tmp_path / "router.json"
    config.write_text(
        json.dumps(
            {
                "port": 1234,
                "max_sessions": 7,
                "policy": "never",
                "timeouts": {"decode_s": 9, "first_token_s": 3, "connect_s": 4},
            }
        )
    )
    monkeypatch.setenv("AGENTKV_SECRET", "from-env")
    monkeypatch.setenv("AGENTKV_POLICY", "always")
    monkeypatch.setenv("AGENTKV_TIMEOUTS__CONNECT_S", "8")
    monkeypatch.setenv("AGENTKV_DECODE_URLS", "http://d:1, http://d:2")
    args = parse("--config", str(config), "--first-token-timeout", "5")
    settings = settings_from_args(args)

    assert settings.port == 1234 and settings.max_sessions == 7
    assert settings.policy == "always"  # environment over the file
    assert settings.timeouts.decode_s == 9 and settings.timeouts.first_token_s == 5  # option wins
    assert settings.timeouts.connect_s == 8  # a group field from the environment, others kept
    assert settings.decode_urls == ("http://d:1", "http://d:2")
    assert settings.secret.get_secret_value() == "from-env"


def test_every_settings_field_has_an_environment_variable():
    from agentkv_server.settings import Settings

    environ = {
        "AGENTKV_MAX_CONNECTIONS": "12",
        "AGENTKV_RETENTION__MAX_S": "60",
        "AGENTKV_COST__EWMA_ALPHA": "0.5",
        "AGENTKV_API_KEYS": '["k1", "k2"]',
    }
    assert environment_settings(environ) == {
        "max_connections": "12",
        "retention": {"max_s": "60"},
        "cost": {"ewma_alpha": "0.5"},
        "api_keys": ["k1", "k2"],
    }
    for name, field in Settings.model_fields.items():
        group = getattr(field.annotation, "model_fields", None)
        if group:
            for sub in group:
                variable = f"AGENTKV_{name}__{sub}".upper()
                assert environment_settings({variable: "1"}) == {name: {sub: "1"}}, variable
        elif name.endswith(("_urls", "_keys")):
            variable = f"AGENTKV_{name.upper()}"
            assert environment_settings({variable: "a, b"}) == {name: ["a", "b"]}, variable
        else:
            variable = f"AGENTKV_{name.upper()}"
            assert environment_settings({variable: "x"}) == {name: "x"}, variable


def test_bad_engine_url_is_a_config_error():
    args = parse("--decode-url", "d:1")
    with pytest.raises(ConfigError, match="http://"):
        settings_from_args(args)


def test_decode_engines_are_required(capsys):
    assert main(["router", "--prefill-url", "http://p:1"]) == 2
    err = capsys.readouterr().err
    assert "decode_urls" in err and len(err.strip().splitlines()) == 1


def test_api_keys_from_options_or_environment(monkeypatch):
    monkeypatch.setenv("AGENTKV_API_KEYS", "env-key-0123456789, env-key-9876543210")
    from_env = parse("--decode-url", "http://d:1")
    given = parse("--decode-url", "http://d:1", "--api-key", "cli-key-0123456789")

    env_keys = settings_from_args(from_env).api_keys
    cli_keys = settings_from_args(given).api_keys

    assert [k.get_secret_value() for k in env_keys] == ["env-key-0123456789", "env-key-9876543210"]
    assert [k.get_secret_value() for k in cli_keys] == ["cli-key-0123456789"]
    assert "cli-key" not in repr(cli_keys)


def test_short_api_key_is_a_config_error():
    args = parse("--decode-url", "http://d:1", "--api-key", "abc")
    with pytest.raises(ConfigError, match="16 characters"):
        settings_from_args(args)


BAD_CONFIGS = {
    "missing": (None, "No such file"),
    "bad.json": ('{"port": 80,', "not valid JSON"),
    "bad.yaml": ("port: [80\n", "not valid YAML"),
    "list.yaml": ("- port\n", "expected a mapping"),
    "unknown.json": ('{"timeouts": {"prefil_s": 3}}', "timeouts.prefil_s: Extra inputs"),
    "wrong.yaml": ("port: eighty\n", "port: Input should be a valid integer"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_a_bad_config_is_one_line_and_exit_status_2(name, tmp_path, capsys):
    text, reason = BAD_CONFIGS[name]
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    assert main(["router", "--decode-url", "http://d:1", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert reason in err and str(path) in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_yaml_config_is_read(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text("port: 9100\ntimeouts:\n  decode_s: 30\n")
    settings = settings_from_args(parse("--decode-url", "http://d:1", "--config", str(path)))
    assert settings.port == 9100 and settings.timeouts.decode_s == 30


def test_a_bad_environment_value_is_exit_status_2(monkeypatch, capsys):
    monkeypatch.setenv("AGENTKV_MAX_SESSIONS", "many")
    assert main(["router", "--decode-url", "http://d:1"]) == 2
    err = capsys.readouterr().err
    assert "max_sessions" in err and len(err.strip().splitlines()) == 1


def test_router_log_lines_carry_their_level():
    """The warning about a generated secret, as the router process writes it."""
    code = (
        "import uvicorn; uvicorn.run = lambda *a, **k: None\n"
        "from agentkv_server.cli import main\n"
        "raise SystemExit(main(['router', '--decode-url', 'http://127.0.0.1:9']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    (line,) = [line for line in done.stderr.splitlines() if "no --secret" in line]
    assert " WARNING agentkv_server.router.cli: " in line


def test_the_startup_heap_is_frozen_before_serving():
    """Imports and setup leave ~150,000 objects; a full collection of them stalled every turn
    for 60-80 ms under load. By the time uvicorn serves, they are out of the collector's way."""
    code = (
        "import gc, uvicorn\n"
        "uvicorn.run = lambda *a, **k: print('frozen', gc.get_freeze_count())\n"
        "from agentkv_server.cli import main\n"
        "main(['router', '--decode-url', 'http://127.0.0.1:9', '--secret', 's'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("frozen ")]
    assert int(line.split()[1]) > 50_000


def test_a_port_in_use_is_a_runtime_failure(capsys):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["router", "--decode-url", "http://127.0.0.1:9", "--port", str(port)]
        assert main([*argv, "--secret", "s", "--log-level", "error"]) == 1
    assert f"could not serve on 127.0.0.1:{port}" in capsys.readouterr().err


def test_no_local_turns_the_local_path_off(tmp_path):
    config = tmp_path / "router.json"
    config.write_text(json.dumps({"local": {"max_new_tokens": 64}}))
    args = parse("--decode-url", "http://d:1", "--config", str(config))
    assert settings_from_args(args).local.enabled

    args = parse("--decode-url", "http://d:1", "--config", str(config), "--no-local")
    local = settings_from_args(args).local
    assert not local.enabled and local.max_new_tokens == 64
