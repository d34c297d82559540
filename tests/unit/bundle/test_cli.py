"""`agentkv serve` and `agentkv build-model` options, without starting engines."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentkv_server.bundle import cli as serve_cli
from agentkv_server.cli import build_parser, main
from agentkv_server.errors import ConfigError
from agentkv_server.testing.conditions import wait_healthy


def serve_args(*argv: str):
    return build_parser(["serve", *argv]).parse_args(["serve", *argv])


def test_serve_defaults_to_the_tiny_model_one_engine_each_and_port_8000() -> None:
    config = serve_cli.stack_config(serve_args("--device", "cpu"))
    assert (config.model, config.dtype, config.prefill, config.decode) == (None, "float32", 1, 1)
    assert (config.host, config.port, config.device) == ("127.0.0.1", 8000, "cpu")
    assert config.log_dir == Path(".agentkv/logs")
    assert config.router and config.router_settings == {}


def test_serve_passes_engine_arguments_through_in_order() -> None:
    args = serve_args(
        "--device=cuda",
        "--engine-arg=--max-model-len=8192",
        "--engine-arg=--gpu-memory-utilization=0.8",
        "--model",
        "/models/llama",
    )
    config = serve_cli.stack_config(args)
    assert config.engine_args == ("--max-model-len=8192", "--gpu-memory-utilization=0.8")
    assert (config.model, config.device) == ("/models/llama", "cuda")


def test_serve_gives_decode_engines_a_host_tier_when_asked() -> None:
    assert serve_cli.stack_config(serve_args("--device=cpu")).host_tier_gib == 0.0
    config = serve_cli.stack_config(serve_args("--device=cpu", "--host-tier-gib", "2"))
    assert config.host_tier_gib == 2.0
    with pytest.raises(ConfigError, match="--host-tier-gib"):
        serve_cli.stack_config(serve_args("--device=cpu", "--host-tier-gib", "-1"))


def test_serve_hands_router_options_to_the_router_and_keeps_the_secret_out_of_them() -> None:
    args = serve_args(
        "--device=cpu", "--policy", "never", "--first-token-timeout", "30", "--port", "9000"
    )
    args.secret = "s3cret"
    config = serve_cli.stack_config(args)
    assert config.router_settings == {"policy": "never", "timeouts": {"first_token_s": 30.0}}
    assert (config.port, config.secret) == (9000, "s3cret")


def test_serve_hands_its_log_level_to_the_router() -> None:
    """A reproduction: ``agentkv serve --log-level debug`` was accepted and dropped, the router
    logged at warning whatever was asked."""
    assert serve_cli.stack_config(serve_args("--device=cpu")).router_log_level == "warning"
    config = serve_cli.stack_config(serve_args("--device=cpu", "--log-level", "debug"))
    assert config.router_log_level == "debug"


def test_serve_passes_api_keys_unmasked_and_outside_the_settings_file() -> None:
    key = "k" * 20
    config = serve_cli.stack_config(serve_args("--device=cpu", "--api-key", key))
    assert config.api_keys == (key,)
    assert "api_keys" not in config.router_settings


def test_serve_run_gives_the_command_the_stack_and_its_exit_status(tmp_path: Path) -> None:
    class ReadyStack:
        def client_environment(self) -> dict[str, str]:
            return {"AGENTKV_BASE_URL": "http://127.0.0.1:8123/v1", "AGENTKV_MODEL": "tiny"}

    out = tmp_path / "env.txt"
    command = f'echo "$AGENTKV_BASE_URL $AGENTKV_MODEL $(command -v python)" > {out}; exit 3'
    assert serve_cli._run_command(ReadyStack(), command) == 3
    base_url, model, python = out.read_text().split()
    assert (base_url, model) == ("http://127.0.0.1:8123/v1", "tiny")
    assert Path(python).parent == Path(sys.executable).parent


def test_serve_reports_bad_options_without_starting_anything(capsys) -> None:
    assert main(["serve", "--device=cpu", "--decode-engines", "0"]) == 2
    assert "decode engine" in capsys.readouterr().err


def test_serve_engine_counts_keep_their_old_spelling(capsys) -> None:
    config = serve_cli.stack_config(serve_args("--device=cpu", "--prefill", "0", "--decode", "2"))
    assert (config.prefill, config.decode) == (0, 2)
    assert main(["serve", "--device=cpu", "--decode", "0"]) == 2
    assert "--decode is deprecated, use --decode-engines" in capsys.readouterr().err


def test_serve_reports_a_bad_router_option(capsys) -> None:
    assert main(["serve", "--device=cpu", "--max-sessions", "0"]) == 2
    assert "max_sessions" in capsys.readouterr().err


def test_build_model_prints_the_model_directory(tmp_path: Path, capsys) -> None:
    assert main(["build-model", "tiny", "--cache-dir", str(tmp_path)]) == 0
    built = Path(capsys.readouterr().out.strip())
    assert built.parent == tmp_path and (built / "config.json").is_file()


def test_serve_gives_tiny_long_enough_kv_cache_and_says_so() -> None:
    config = serve_cli.stack_config(serve_args("--device=cpu", "--model", "tiny-long"))
    assert config.engine_kv_cache_gib == 2
    assert "each engine gets 2 GiB of KV cache" in (config.kv_cache_note() or "")
    parser = argparse.ArgumentParser()
    serve_cli.configure(parser)
    assert "(tiny, tiny-long, small)" in " ".join(parser.format_help().split())


def test_build_model_refuses_unknown_presets() -> None:
    with pytest.raises(SystemExit):
        build_parser(["build-model"]).parse_args(["build-model", "huge"])


KEY = "client-key-0123456789"
SECRET = "router-secret"


@pytest.fixture
def router_with_keys(tmp_path: Path) -> Iterator[str]:
    """A real ``agentkv router`` process with API keys, over stub engines, on loopback."""
    from agentkv_server.bundle.ports import free_ports

    stubs = subprocess.Popen(
        [sys.executable, "-m", "agentkv_server.testing", "--engines", "2"],
        stdout=subprocess.PIPE,
        text=True,
    )
    (port,) = free_ports(1)
    env = {**os.environ, "AGENTKV_API_KEYS": KEY}
    router = None
    try:
        prefill, decode = json.loads(stubs.stdout.readline())
        router = subprocess.Popen(
            [sys.executable, "-m", "agentkv_server.cli", "router", "--port", str(port)]
            + ["--prefill-url", prefill, "--decode-url", decode, "--secret", SECRET],
            env=env,
            stderr=(tmp_path / "router.log").open("w"),
        )
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, router)
        yield url
    finally:
        for process in (router, stubs):
            if process is not None:
                process.terminate()
                process.wait(15)


def _shell(line: str, **env: str) -> str:
    done = subprocess.run(
        ["bash", "-c", line],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_serve_announces_examples_that_work_with_api_keys(router_with_keys, monkeypatch) -> None:
    """The curl lines ``agentkv serve`` prints, run as printed against a router with keys
    taken from $AGENTKV_API_KEYS: health, metrics (with the secret) and a chat turn."""
    monkeypatch.setenv("AGENTKV_API_KEYS", KEY)
    credentials = serve_cli._credentials(serve_args("--device=cpu", "--secret", SECRET))
    assert credentials == serve_cli.Credentials("${AGENTKV_API_KEYS%%,*}", SECRET)
    health, metrics, chat = serve_cli.client_examples(router_with_keys, "stub-model", credentials)

    assert _shell(health, AGENTKV_API_KEYS=KEY).strip()
    assert "agentkv_turns_total" in _shell(metrics, AGENTKV_API_KEYS=KEY)
    answer = json.loads(_shell(chat, AGENTKV_API_KEYS=KEY))
    assert answer["choices"][0]["message"]["role"] == "assistant"
    # The key is what makes it work: without it the router refuses the turn.
    refused = json.loads(_shell(chat, AGENTKV_API_KEYS="wrong-key-0123456789"))
    assert "choices" not in refused


def test_serve_examples_spell_out_a_key_given_as_an_option(monkeypatch) -> None:
    monkeypatch.delenv("AGENTKV_API_KEYS", raising=False)
    monkeypatch.delenv("AGENTKV_SECRET", raising=False)
    args = serve_args("--device=cpu", "--api-key", 'k"$y-0123456789abcdef')
    credentials = serve_cli._credentials(args)
    assert credentials == serve_cli.Credentials('k\\"\\$y-0123456789abcdef', None)
    lines = serve_cli.client_examples("http://h:1", "m", credentials)
    assert not any("/metrics" in line for line in lines)  # the secret was generated: no example
    assert _shell(f'printf %s "{credentials.api_key}"') == 'k"$y-0123456789abcdef'


def test_serve_examples_without_api_keys_need_no_credentials(monkeypatch) -> None:
    monkeypatch.delenv("AGENTKV_API_KEYS", raising=False)
    credentials = serve_cli._credentials(serve_args("--device=cpu"))
    lines = serve_cli.client_examples("http://h:1", "m", credentials)
    assert lines[:2] == ["curl -s http://h:1/health", "curl -s http://h:1/metrics"]
    assert "Authorization" not in lines[2]
