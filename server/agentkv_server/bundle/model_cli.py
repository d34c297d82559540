"""``agentkv build-model``: prepare (or find) a model in the cache and print its directory."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from agentkv_server.bundle.model import DEFAULT_MODEL, MODEL_NAMES, cache_dir, resolve_model
from agentkv_server.errors import AgentKVServerError

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", nargs="?", default=DEFAULT_MODEL, choices=MODEL_NAMES,
        help=f"{DEFAULT_MODEL} (the real default model) or a random-weight test model",
    )  # fmt: skip
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="weights' type (default float32)",
    )
    parser.add_argument(
        "--cache-dir", type=Path, help=f"where models are kept (default {cache_dir()})"
    )


def run(args: argparse.Namespace) -> int:
    try:
        path, _ = resolve_model(args.model, dtype=args.dtype, root=args.cache_dir)
    except AgentKVServerError as exc:
        print(f"agentkv build-model: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
