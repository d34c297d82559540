"""The ``agentkv`` command. Each room contributes its subcommands; heavy imports stay lazy so
``agentkv --help`` is instant and a missing extra is reported by name.

Exit status, every subcommand: 0 done; 1 a failure while running (an engine that would not
start or died, failed benchmark turns); 2 a usage or configuration error (bad options, a bad
``--config``, a missing extra), reported on one line on stderr; 130 a benchmark cut short by
Ctrl-C or SIGTERM (a server stopped that way is done: 0).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from agentkv import __version__

__all__ = [
    "EXIT_FAILURE",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_USAGE",
    "SUBCOMMANDS",
    "build_parser",
    "main",
]

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # the shell's status for a command ended by SIGINT

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
        "prepare a model (the real default, or a test model) in the cache",
    ),
}


class MissingExtraError(Exception):
    """A subcommand's module could not be imported: its extra is not installed."""


def _load(name: str):
    module_name, extra, _ = SUBCOMMANDS[name]
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise MissingExtraError(
            f"agentkv {name}: a dependency is missing ({exc.name or exc}). "
            f"Install it with: pip install 'agentkv[{extra}]'"
        ) from exc


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkv",
        description=__doc__.split(".")[0] + ".",
        epilog="Exit status: 0 done, 1 failure while running, 2 usage or configuration error.",
    )
    parser.add_argument("--version", action="version", version=f"agentkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (_, _, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # only the chosen room is imported
            _load(name).configure(sub_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(argv)
    except MissingExtraError as exc:
        print(exc, file=sys.stderr)
        return EXIT_USAGE
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    module = _load(args.command)
    _warn_deprecated(args.command, argv, getattr(module, "DEPRECATED_OPTIONS", {}))
    return int(module.run(args) or EXIT_OK)


def _warn_deprecated(command: str, argv: Sequence[str], renamed: dict[str, str]) -> None:
    for old, new in renamed.items():
        if any(arg == old or arg.startswith(old + "=") for arg in argv):
            print(f"agentkv {command}: {old} is deprecated, use {new}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
