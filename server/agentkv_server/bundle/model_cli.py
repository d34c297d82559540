"""``agentkv build-model``: build (or find) the local random-weight test model, print its path."""

from __future__ import annotations

import argparse
from pathlib import Path

from agentkv_server.bundle.model import DEFAULT_PRESET, PRESETS, cache_dir, ensure_model

__all__ = ["configure", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "preset",
        nargs="?",
        default=DEFAULT_PRESET,
        choices=sorted(PRESETS),
        help=f"model size (default {DEFAULT_PRESET})",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="weights' type (default float32)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight and tokenizer seed (0)")
    parser.add_argument(
        "--cache-dir", type=Path, help=f"where models are kept (default {cache_dir()})"
    )


def run(args: argparse.Namespace) -> int:
    path = ensure_model(args.preset, dtype=args.dtype, seed=args.seed, root=args.cache_dir)
    print(path)
    return 0
