"""``agentkv router``: run the router in front of running prefill and decode engines.

Settings come in layers, each overriding the one before: defaults, the ``--config`` file (JSON
or YAML), ``AGENTKV_*`` environment variables (every field: ``AGENTKV_DECODE_URLS=http://d:8200``,
``AGENTKV_TIMEOUTS__FIRST_TOKEN_S=300``), then the options given. ``add_arguments`` and
``settings_from_args`` are public so that ``agentkv serve`` offers the same options and builds
the same :class:`~agentkv_server.settings.Settings`.
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import logging
import sys
from pathlib import Path
from typing import Any, get_args

from agentkv_server.errors import ConfigError
from agentkv_server.settings import (
    PolicyName,
    Settings,
    environment_settings,
    load_settings,
    read_config_file,
)
from agentkv_server.wire import API_KEYS_ENV, SECRET_ENV

__all__ = [
    "DEPRECATED_OPTIONS",
    "LOG_FORMAT",
    "add_arguments",
    "configure",
    "is_loopback",
    "run",
    "settings_from_args",
]

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
"""Router log lines: time, level, logger, message."""

DEPRECATED_OPTIONS = {
    "--prefill": "--prefill-url",
    "--decode": "--decode-url",
    "--redis": "--redis-url",
    "--prefill-timeout": "--first-token-timeout",
}
"""Old spellings that still work (``agentkv`` warns): old -> new."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The router's options (engine URLs excluded: ``agentkv serve`` starts its own engines)."""
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="JSON or YAML file of settings (docs/router.md); environment and options override it",
    )
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8000)")
    parser.add_argument(
        "--redis-url",
        "--redis",
        dest="redis_url",
        metavar="URL",
        help="share sessions through Redis, e.g. redis://host:6379/0 (several router replicas; "
        "default: in memory)",
    )
    parser.add_argument(
        "--policy",
        choices=get_args(PolicyName),
        help="reuse policy: cost model (default), vLLM's example proxy (upstream), that proxy "
        "once streamed turns report their holdings (upstream-best), never, or always (pull "
        "every live holding)",
    )
    parser.add_argument(
        "--no-local",
        action="store_true",
        help="never continue a turn on its decode holder (no prefill on decode engines): "
        "pull or recompute only (docs/router.md, three paths)",
    )
    parser.add_argument(
        "--secret",
        help=f"shared secret for engines' holding reports (default ${SECRET_ENV}, else generated)",
    )
    parser.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        metavar="KEY",
        help=f"a client API key (repeatable; default ${API_KEYS_ENV}, comma-separated): "
        "clients must send 'Authorization: Bearer KEY' and get their own session namespace",
    )
    parser.add_argument(
        "--first-token-timeout",
        "--prefill-timeout",
        type=float,
        dest="first_token_s",
        metavar="S",
        help="a turn's deadline from its arrival to its first token, its waits for busy "
        "engines included; past it the client gets 504 and no engine is blamed (default 600)",
    )
    timeouts = (
        ("--decode-timeout", "decode_s", "a whole decode step, streaming included (600)"),
        ("--connect-timeout", "connect_s", "a TCP connect to an engine (2)"),
    )
    for flag, dest, what in timeouts:
        parser.add_argument(flag, type=float, dest=dest, metavar="S", help=f"seconds for {what}")
    parser.add_argument(
        "--max-queue-wait",
        type=float,
        dest="max_wait_s",
        metavar="S",
        help="refuse a turn at once (503 with Retry-After) when it would wait longer than this "
        "for a prefill engine: a TTFT objective (default 300; docs/router.md, Admission)",
    )
    parser.add_argument(
        "--max-body-bytes", type=int, metavar="N", help="largest request body (default 16 MiB)"
    )
    parser.add_argument(
        "--max-sessions",
        type=int,
        metavar="N",
        help="sessions the router indexes before evicting the least recent (default 100000)",
    )
    parser.add_argument(
        "--health-interval",
        type=float,
        dest="health_interval_s",
        metavar="S",
        help="seconds between engine health checks (default 5)",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=("debug", "info", "warning", "error"),
        help="router log level (default warning)",
    )


def configure(parser: argparse.ArgumentParser) -> None:
    engines = parser.add_argument_group("engines (or AGENTKV_PREFILL_URLS / AGENTKV_DECODE_URLS)")
    engines.add_argument(
        "--prefill-url",
        "--prefill",
        dest="prefill_urls",
        action="extend",
        nargs="*",
        metavar="URL",
        help="prefill engines (repeatable; none: decode-only serving)",
    )
    engines.add_argument(
        "--decode-url",
        "--decode",
        dest="decode_urls",
        action="extend",
        nargs="+",
        metavar="URL",
        help="decode engines (repeatable; at least one)",
    )
    add_arguments(parser)


_OPTION_FIELDS = (
    "host",
    "port",
    "redis_url",
    "policy",
    "secret",
    "max_body_bytes",
    "max_sessions",
    "health_interval_s",
    "prefill_urls",
    "decode_urls",
)
_TIMEOUT_FIELDS = ("first_token_s", "decode_s", "connect_s")


def settings_from_args(args: argparse.Namespace, **overrides: Any) -> Settings:
    """Settings from ``--config``, then ``AGENTKV_*`` variables, then the options given, then
    ``overrides``; ConfigError (one line) when they do not make valid settings."""
    from_file = read_config_file(args.config) if getattr(args, "config", None) else {}
    given: dict[str, Any] = {
        name: getattr(args, name)
        for name in _OPTION_FIELDS
        if getattr(args, name, None) is not None
    }
    timeouts = {
        name: getattr(args, name)
        for name in _TIMEOUT_FIELDS
        if getattr(args, name, None) is not None
    }
    if timeouts:
        given["timeouts"] = timeouts
    if getattr(args, "no_local", False):
        given["local"] = {"enabled": False}
    if getattr(args, "max_wait_s", None) is not None:
        given["admission"] = {"max_wait_s": args.max_wait_s}
    if getattr(args, "api_keys", None):
        given["api_keys"] = args.api_keys
    source = f"settings (config file {args.config})" if from_file else "settings"
    return load_settings(from_file, environment_settings(), given, overrides, source=source)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from agentkv_server.router.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"agentkv router: {exc}", file=sys.stderr)
        return 2
    if "secret" not in settings.model_fields_set:
        logger.warning(
            "no --secret or $%s: generated one, so engines cannot report streamed "
            "turns' holdings (non-streamed turns still reuse)",
            SECRET_ENV,
        )
    if not settings.api_keys and not is_loopback(settings.host):
        logger.warning(
            "listening on %s without --api-key: anyone who can reach it can use the engines "
            "(docs/security.md)",
            settings.host,
        )
    app = create_app(settings)
    freeze_startup_heap()
    try:
        uvicorn.run(
            app,
            host=settings.host,
            port=settings.port,
            log_level=args.log_level,
            access_log=False,
        )
    except SystemExit as exc:  # uvicorn's own status for a failed start (3: cannot bind)
        if exc.code:
            print(
                f"agentkv router: could not serve on {settings.host}:{settings.port}",
                file=sys.stderr,
            )
            return 1
    return 0


def freeze_startup_heap() -> None:
    """Exempt what imports and setup built (~150,000 objects) from the cyclic collector: each
    full collection of that heap stopped every turn in flight for 60-80 ms, the router's p99
    under load (docs/router.md, "Hot path")."""
    gc.collect()
    gc.freeze()


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or address) stays on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
