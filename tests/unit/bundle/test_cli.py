"""`agentkv serve` and `agentkv build-model` options, without starting engines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agentkv_server.bundle import cli as serve_cli
from agentkv_server.cli import build_parser, main


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


def test_serve_hands_router_options_to_the_router_and_keeps_the_secret_out_of_them() -> None:
    args = serve_args(
        "--device=cpu", "--policy", "never", "--prefill-timeout", "30", "--port", "9000"
    )
    args.secret = "s3cret"
    config = serve_cli.stack_config(args)
    assert config.router_settings == {"policy": "never", "timeouts": {"prefill_s": 30.0}}
    assert (config.port, config.secret) == (9000, "s3cret")


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
    assert main(["serve", "--device=cpu", "--decode", "0"]) == 2
    assert "decode engine" in capsys.readouterr().err


def test_serve_reports_a_bad_router_option(capsys) -> None:
    assert main(["serve", "--device=cpu", "--max-sessions", "0"]) == 2
    assert "max_sessions" in capsys.readouterr().err


def test_build_model_prints_the_model_directory(tmp_path: Path, capsys) -> None:
    assert main(["build-model", "tiny", "--cache-dir", str(tmp_path)]) == 0
    built = Path(capsys.readouterr().out.strip())
    assert built.parent == tmp_path and (built / "config.json").is_file()


def test_build_model_refuses_unknown_presets() -> None:
    with pytest.raises(SystemExit):
        build_parser(["build-model"]).parse_args(["build-model", "huge"])
