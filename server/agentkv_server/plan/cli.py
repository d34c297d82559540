"""``agentkv plan``: predict follow-up TTFT on prefill/decode GPU nodes (a model, not a
measurement).

For each model: recompute, pull (the prefill engine loads the held KV from the decode
engine) and holder (the decode engine prefills only the new tokens) at history sizes from
2k to 128k tokens and session counts up to what the decode engine's memory holds, with the
path agentkv's per-turn policy would pick and its margin over each fixed path. First it
checks the model against the published seed (1P1D H200 over EFA). Inputs and equations:
docs/cluster-model.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from agentkv_server.plan.catalog import ITL_SLO, NIXL_OVER_EFA, SEED_WORKLOAD, SERVINGS
from agentkv_server.plan.inputs import AssumedEfficiency, Source
from agentkv_server.plan.model import ClusterModel
from agentkv_server.plan.report import (
    SEED_TOLERANCE,
    Plan,
    build_plan,
    plan_json,
    render_table,
    write_plot,
)

__all__ = ["configure", "run"]

DEFAULT_HISTORIES = tuple(2048 * 2**i for i in range(7))  # 2k .. 128k
DEFAULT_PLOT = Path("agentkv-plan.png")
_FLAG_SOURCE = Source("assumption", "set on the agentkv plan command line")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    parser.add_argument(
        "--model",
        dest="models",
        action="append",
        choices=sorted(SERVINGS),
        help="model to predict (repeatable; default: all)",
    )
    parser.add_argument(
        "--history-tokens",
        type=_positive_ints,
        default=DEFAULT_HISTORIES,
        metavar="N[,N...]",
        help="history sizes held on the decode engine (default 2048,4096,...,131072)",
    )
    parser.add_argument(
        "--new-tokens",
        type=_positive_int,
        default=SEED_WORKLOAD.new_tokens,
        help=f"fresh tokens per follow-up turn (default {SEED_WORKLOAD.new_tokens}, the seed's)",
    )
    parser.add_argument(
        "--output-tokens",
        type=_positive_int,
        default=SEED_WORKLOAD.output_tokens,
        help=f"tokens generated per turn, held too (default {SEED_WORKLOAD.output_tokens})",
    )
    parser.add_argument(
        "--session-points",
        type=_positive_int,
        default=3,
        help="session counts per history, from 1 to the decode memory limit (default 3)",
    )
    parser.add_argument(
        "--mfu",
        type=_fraction,
        help="override every model's prefill efficiency (fraction of dense peak) to see how "
        "much the answer depends on it",
    )
    parser.add_argument(
        "--link-efficiency",
        type=_fraction,
        help=f"fraction of EFA line rate a KV load reaches (default {NIXL_OVER_EFA.efficiency:.2f})",
    )
    parser.add_argument(
        "--block-size",
        type=_positive_int,
        help="override every model's KV block size in tokens (fewer, larger NIXL descriptors)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("bf16", "fp8"),
        help="override every model's KV cache precision",
    )
    parser.add_argument(
        "--itl-budget-ms",
        type=_positive_float,
        default=ITL_SLO.itl_budget_s * 1000,
        help="longest stall of other sessions' decoding the holder path may cause "
        f"(default {ITL_SLO.itl_budget_s * 1000:.0f})",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument(
        "--plot",
        type=Path,
        default=DEFAULT_PLOT,
        metavar="PATH",
        help=f"where to write the plot (default {DEFAULT_PLOT}; needs agentkv[bench])",
    )
    parser.add_argument("--no-plot", action="store_true", help="write no plot")
    parser.add_argument(
        "--check-seed",
        action="store_true",
        help=f"exit 1 when a seed ratio is off by more than {SEED_TOLERANCE * 100:.0f}%%",
    )


def run(args: argparse.Namespace) -> int:
    models = [_cluster_model(key, args) for key in args.models or sorted(SERVINGS)]
    seed_models = {SERVINGS[key].model.name: _cluster_model(key, args) for key in SERVINGS}
    plan = build_plan(models, args.history_tokens, args.session_points, seed_models)
    plot = None if args.no_plot else _write_plot(plan, args.plot)
    if args.json:
        print(json.dumps(plan_json(plan, plot), indent=2))
    else:
        print(render_table(plan))
        if plot is not None:
            print(f"\nplot: {plot}")
    seed_ok = all(abs(c.relative_error) <= SEED_TOLERANCE for c in plan.seed_checks)
    return 1 if args.check_seed and not seed_ok else 0


def _cluster_model(key: str, args: argparse.Namespace) -> ClusterModel:
    serving = SERVINGS[key]
    if args.mfu is not None:
        efficiency = AssumedEfficiency(mfu=args.mfu, source=_FLAG_SOURCE)
        serving = dataclasses.replace(serving, prefill_efficiency=efficiency)
    if args.block_size is not None:
        serving = dataclasses.replace(serving, block_size=args.block_size)
    if args.kv_cache_dtype is not None:
        serving = dataclasses.replace(serving, kv_cache_precision=args.kv_cache_dtype)
    link = NIXL_OVER_EFA
    if args.link_efficiency is not None:
        link = dataclasses.replace(link, efficiency=args.link_efficiency)
    workload = dataclasses.replace(
        SEED_WORKLOAD,
        new_tokens=args.new_tokens,
        output_tokens=args.output_tokens,
        source=SEED_WORKLOAD.source if _seed_workload(args) else _FLAG_SOURCE,
    )
    slo = ITL_SLO
    if args.itl_budget_ms != ITL_SLO.itl_budget_s * 1000:
        slo = dataclasses.replace(
            ITL_SLO, itl_budget_s=args.itl_budget_ms / 1000, source=_FLAG_SOURCE
        )
    return ClusterModel(serving, link=link, workload=workload, slo=slo)


def _seed_workload(args: argparse.Namespace) -> bool:
    return (args.new_tokens, args.output_tokens) == (
        SEED_WORKLOAD.new_tokens,
        SEED_WORKLOAD.output_tokens,
    )


def _write_plot(plan: Plan, path: Path) -> Path:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise SystemExit(
            "agentkv plan: writing the plot needs matplotlib. Install it with: "
            "pip install 'agentkv[bench]', or pass --no-plot"
        ) from exc
    try:
        return write_plot(plan, path)
    except OSError as exc:
        raise SystemExit(f"agentkv plan: cannot write the plot to {path}: {exc}") from exc


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return value


def _positive_ints(text: str) -> tuple[int, ...]:
    values = tuple(_positive_int(part) for part in text.split(",") if part.strip())
    if not values:
        raise argparse.ArgumentTypeError("give at least one value")
    return values


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0: {value}")
    return value


def _fraction(text: str) -> float:
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1]: {value}")
    return value
