"""``agentkv router``: run the router in front of running prefill and decode engines.

``add_arguments`` and ``settings_from_args`` are public so that ``agentkv serve`` offers the same
options and builds the same :class:`~agentkv_server.settings.Settings`.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import logging
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agentkv_server.errors import ConfigError
from agentkv_server.settings import Settings

__all__ = ["add_arguments", "configure", "is_loopback", "run", "settings_from_args"]

logger = logging.getLogger(__name__)

SECRET_ENV = "AGENTKV_SECRET"
API_KEYS_ENV = "AGENTKV_API_KEYS"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The router's options (engine URLs excluded: ``agentkv serve`` starts its own engines)."""
    parser.add_argument("--config", type=Path, help="JSON file of Settings; options override it")
    parser.add_argument("--host", help="listen address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (default 8000)")
    parser.add_argument(
        "--redis",
        dest="redis_url",
        metavar="URL",
        help="share sessions through Redis (several router replicas)",
    )
    parser.add_argument(
        "--policy",
        choices=("agentkv", "upstream", "never", "always"),
        help="reuse policy: cost model (default), vLLM's example proxy, never, or always "
        "(pull every live holding)",
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
    parser.add_argument("--prefill-timeout", type=float, dest="prefill_s", metavar="S")
    parser.add_argument("--first-token-timeout", type=float, dest="first_token_s", metavar="S")
    parser.add_argument("--decode-timeout", type=float, dest="decode_s", metavar="S")
    parser.add_argument("--connect-timeout", type=float, dest="connect_s", metavar="S")
    parser.add_argument("--max-body-bytes", type=int)
    parser.add_argument("--max-sessions", type=int)
    parser.add_argument("--health-interval", type=float, dest="health_interval_s", metavar="S")
    parser.add_argument(
        "--log-level", default="warning", choices=("debug", "info", "warning", "error")
    )


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill",
        nargs="*",
        default=[],
        metavar="URL",
        help="prefill engines (none: decode-only serving)",
    )
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode engines")
    add_arguments(parser)


def settings_from_args(args: argparse.Namespace, **overrides: Any) -> Settings:
    """Settings from ``--config``, then the options given, then ``overrides``."""
    data: dict[str, Any] = json.loads(args.config.read_text()) if args.config else {}
    for name in (
        "host",
        "port",
        "redis_url",
        "policy",
        "max_body_bytes",
        "max_sessions",
        "health_interval_s",
    ):
        if getattr(args, name, None) is not None:
            data[name] = getattr(args, name)
    timeouts = {
        name: getattr(args, name)
        for name in ("prefill_s", "first_token_s", "decode_s", "connect_s")
        if getattr(args, name, None) is not None
    }
    if timeouts:
        data["timeouts"] = {**data.get("timeouts", {}), **timeouts}
    secret = args.secret or os.environ.get(SECRET_ENV) or data.get("secret")
    if secret:
        data["secret"] = secret
    api_keys = getattr(args, "api_keys", None) or _split(os.environ.get(API_KEYS_ENV, ""))
    if api_keys:
        data["api_keys"] = api_keys
    data.update(overrides)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from agentkv_server.router.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        settings = settings_from_args(
            args, prefill_urls=args.prefill or [], decode_urls=args.decode
        )
    except ConfigError as exc:
        logger.error("agentkv router: %s", exc)
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
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level,
        access_log=False,
    )
    return 0


def _split(keys: str) -> list[str]:
    return [key.strip() for key in keys.split(",") if key.strip()]


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or address) stays on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
