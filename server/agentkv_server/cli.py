"""The ``agentkv`` command. Each room contributes its subcommands; heavy imports stay lazy so
``agentkv --help`` is instant and a missing extra is reported by name."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module providing `configure(parser)` and `run(args) -> int`, extra it needs, help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": (
        "agentkv_server.bundle.cli",
        "server,cpu",
        "start router + prefill + decode engines locally",
    ),
    "router": (
        "agentkv_server.router.cli",
        "server",
        "run the session-aware router in front of engines",
    ),
    "bench": (
        "agentkv_server.bench.cli",
        "server,bench",
        "measure multi-turn agent workloads per serving mode",
    ),
    "plan": (
        "agentkv_server.plan.cli",
        "bench",
        "predict follow-up TTFT on GPU nodes (a model, not a measurement)",
    ),
    "build-model": (
        "agentkv_server.bundle.model_cli",
        "cpu",
        "build the local random-weight test model",
    ),
}


def _load(name: str):
    module_name, extra, _ = SUBCOMMANDS[name]
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise SystemExit(
            f"agentkv {name}: a dependency is missing ({exc.name or exc}). "
            f"Install it with: pip install 'agentkv[{extra}]'"
        ) from exc


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentkv", description=__doc__.split(".")[0] + ".")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (_, _, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # only the chosen room is imported
            _load(name).configure(sub_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return int(_load(args.command).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
