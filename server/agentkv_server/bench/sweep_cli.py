"""``agentkv bench --preset overload`` and ``--preset agents12`` on the command line: their
options, their plans from the preset and the options given, and their runs (bench/sweep.py)
on the engines bench/cli_setup.py opens, into results the reports of bench/overload_report.py
and bench/agents12_report.py render.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from agentkv_server.bench.agents12_report import MEASURES as AGENTS
from agentkv_server.bench.agents12_report import is_agents, write_agents_report
from agentkv_server.bench.capacity import GIVEN, Capacity, measure_capacity
from agentkv_server.bench.cli_setup import (
    TURN_TIMEOUT_S,
    Setup,
    no_progress,
    open_setup,
    progress_line,
    refuse,
    run_config,
    run_until_stopped,
    timing,
    warm_up,
)
from agentkv_server.bench.modes import serve_mode
from agentkv_server.bench.overload import router_settings
from agentkv_server.bench.overload_report import MEASURES as OVERLOAD
from agentkv_server.bench.overload_report import is_overload, merge_sweeps, write_overload_report
from agentkv_server.bench.records import SweepResult
from agentkv_server.bench.runner import Runner, Target
from agentkv_server.bench.sweep import run_points
from agentkv_server.bench.tenant_runner import TenantRunner
from agentkv_server.bench.workload import Preset, WordTokenizer, agents_preset, overload_preset
from agentkv_server.errors import ConfigError

__all__ = [
    "OVERLOAD_ONLY",
    "agents_plan",
    "configure_overload",
    "is_sweep",
    "measure_agents",
    "measure_overload",
    "merged_sweeps",
    "overload_plan",
    "write_sweep_report",
]


# Options only the overload preset takes, and those it has no use for (agents12 likewise).
OVERLOAD_ONLY = ("loads", "objective", "capacity", "bursts", "burst_window", "burst_period")
_NEITHER = ("concurrency", "decoders", "decode_tokens", "session_counts", "start_spread")
_NOT_OVERLOAD = (*_NEITHER, "sessions", "base_url")
_NOT_AGENTS = (*_NEITHER, "tool_latency")


def configure_overload(group: argparse._ArgumentGroup) -> None:
    """The overload preset's own options (its other overrides are the mode comparison's)."""
    group.add_argument(
        "--loads",
        type=_float_list,
        metavar="X[,X...]",
        help="offered loads, x the stack's capacity; 0: the steady tenant alone (0,1,2,4)",
    )
    group.add_argument(
        "--objective",
        type=float,
        metavar="SECONDS",
        help="TTFT within which a turn counts as goodput, also the routers' admission bound (30)",
    )
    group.add_argument(
        "--capacity",
        type=float,
        metavar="TOKENS_PER_S",
        help="the capacity the loads are multiples of, instead of measuring it (e.g. an earlier "
        "run's, from its summary.md: every point of one comparison on the same figure)",
    )
    group.add_argument("--bursts", type=int, help="bursts of new sessions per run (3)")
    group.add_argument(
        "--burst-window", type=float, metavar="SECONDS",
        help="a burst's sessions arrive within this (5)",
    )  # fmt: skip
    group.add_argument(
        "--burst-period", type=float, metavar="SECONDS",
        help="seconds from one burst to the next (40)",
    )  # fmt: skip


def overload_plan(args: argparse.Namespace, preset: Preset) -> Preset:
    """The overload preset with the command line's values (``--turns``: the most per bursting
    session; ``--tool-latency lognormal:MEDIAN``: the bursting sessions' gaps)."""
    assert preset.overload is not None
    refuse(args, _NOT_OVERLOAD, "does not apply to --preset overload")
    gap = args.tool_latency
    if gap is not None and gap.kind != "lognormal":
        raise ConfigError("--preset overload: tool gaps are lognormal; give lognormal:MEDIAN")
    if args.capacity is not None and args.capacity <= 0:
        raise ConfigError("--capacity is prompt tokens per second, more than 0")
    low = preset.overload.turns[0]
    overload = preset.overload.with_overrides(
        loads=args.loads,
        objective_s=args.objective,
        history_tokens=args.history_tokens,
        turns=None if args.turns is None else (min(low, args.turns), args.turns),
        new_tokens=args.new_tokens,
        output_tokens=args.output_tokens,
        gap_median_s=None if gap is None else gap.mean_s,
        bursts=args.bursts,
        burst_window_s=args.burst_window,
        burst_period_s=args.burst_period,
        turn_timeout_s=args.request_timeout,
        seed=args.seed,
    )
    return _rebuilt(args, preset, overload_preset(preset.description, overload))


def agents_plan(args: argparse.Namespace, preset: Preset) -> Preset:
    """The agents12 preset with the command line's values (``--new-tokens``: new words)."""
    assert preset.agents is not None
    refuse(args, _NOT_AGENTS, "does not apply to --preset agents12")
    history = args.history_tokens
    if history is not None and len(history) != 1:
        raise ConfigError("--preset agents12: --history-tokens is one length")
    agents = preset.agents.with_overrides(
        sessions=args.sessions,
        turns=args.turns,
        history_tokens=None if history is None else history[0],
        new_words=args.new_tokens,
        output_tokens=args.output_tokens,
        seed=args.seed,
    )
    return _rebuilt(args, preset, agents_preset(preset.description, agents))


def _rebuilt(args: argparse.Namespace, preset: Preset, plan: Preset) -> Preset:
    """``plan`` (rebuilt from ``preset`` with new sessions) with the repeats and memory given."""
    given = {"repeats": args.repeats or preset.repeats, "kv_cache_gib": args.kv_cache_gib,
             "decode_kv_tokens": args.decode_kv_tokens}  # fmt: skip
    return dataclasses.replace(plan, **{k: v for k, v in given.items() if v is not None})


def measure_overload(args: argparse.Namespace, plan: Preset, out_dir: Path) -> SweepResult:
    """The overload preset: the capacity (measured, or ``--capacity``), then every offered load
    per mode (bench/sweep.py), each mode's router with the tenants' keys and admission bound."""
    assert plan.overload is not None
    workload = plan.overload
    started = time.time()
    progress = no_progress if args.no_progress else progress_line
    with open_setup(args, plan, out_dir) as setup:
        assert setup.deployment is not None  # --base-url is refused
        deployment = setup.deployment
        tuned = dataclasses.replace(
            deployment,
            router_settings=router_settings(deployment.router_settings, workload),
        )
        timeout = workload.client_timeout_s
        plain = Runner(plan.workload, setup.tokenizer, request_timeout_s=timeout)
        runner = TenantRunner(plan.workload, setup.tokenizer, request_timeout_s=timeout)

        def routed(mode: str) -> contextlib.AbstractAsyncContextManager[Target]:
            return serve_mode(mode, tuned)  # type: ignore[arg-type]

        async def sweep() -> tuple[Capacity, SweepResult]:
            salt = uuid.uuid4().hex[:8]
            # Through agentkv whatever the modes: P and D before the calibration.
            await warm_up(plain, dataclasses.replace(setup, modes=("agentkv",)), salt)
            if args.capacity:
                capacity = Capacity(args.capacity, GIVEN)
            else:
                async with serve_mode("recompute", deployment) as target:
                    capacity = await measure_capacity(target, plain, workload, salt)
            progress(f"capacity: {capacity.tokens_per_s:.0f} prompt tokens/s ({capacity.method})")
            found = await run_points(
                workload.points(capacity.tokens_per_s), setup.modes, plan.repeats, routed,
                runner, salt, progress=progress, secret=deployment.secret,
            )  # fmt: skip
            return capacity, found

        capacity, found = run_until_stopped(sweep())
    config = {
        **_sweep_config(args, plan, setup, started),
        "measures": OVERLOAD,
        "overload": json.loads(json.dumps(asdict(workload))),
        "capacity": capacity.to_dict(),
        "workload_text": workload.describe(),
        "client_timeout_s": timeout,
        "mode_router_settings": {  # what each mode's router ran with, its keys left out
            key: value for key, value in tuned.router_settings.items() if key != "api_keys"
        },
    }
    return dataclasses.replace(found, config=config)


def measure_agents(args: argparse.Namespace, plan: Preset, out_dir: Path) -> SweepResult:
    """Issue 48's twelve sessions (bench/agents12.py), once per mode and repeat. No warm-up:
    the issue's sessions met a freshly started stack, its first handshakes included."""
    assert plan.agents is not None
    started = time.time()
    progress = no_progress if args.no_progress else progress_line
    with open_setup(args, plan, out_dir) as setup:
        runner = TenantRunner(
            plan.workload,
            setup.tokenizer,
            new_tokenizer=WordTokenizer(),  # the fresh input is counted in words
            request_timeout_s=args.request_timeout or TURN_TIMEOUT_S,
        )
        sweep = run_points(
            [plan.agents.point()], setup.modes, plan.repeats, setup.open_target, runner,
            uuid.uuid4().hex[:8], progress=progress,
        )  # fmt: skip
        found = run_until_stopped(sweep)
    config = {
        **_sweep_config(args, plan, setup, started),
        "measures": AGENTS,
        "agents12": asdict(plan.agents),
        "workload_text": plan.agents.describe(),
    }
    return dataclasses.replace(found, config=config)


def _sweep_config(
    args: argparse.Namespace, plan: Preset, setup: Setup, started: float
) -> dict[str, object]:
    return {
        **run_config(args, plan),
        "repeats": plan.repeats,
        "modes": list(setup.modes),
        "model": setup.model,
        "deployment": setup.description,
        **timing(started),
    }


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers"
        ) from None


def is_sweep(data: dict[str, object]) -> bool:
    """Whether a results.json holds an overload or agents12 run."""
    return is_overload(data) or is_agents(data)


def merged_sweeps(paths: Sequence[Path]) -> SweepResult:
    """Several overload or agents12 runs' results.json as one result (``merge_sweeps``)."""
    return merge_sweeps([_sweep_of(path) for path in paths])


def write_sweep_report(result: SweepResult, out_dir: Path) -> None:
    """The report of an overload or agents12 run, into ``out_dir``."""
    if result.config.get("measures") == OVERLOAD:
        write_overload_report(result, out_dir)
    else:
        write_agents_report(result, out_dir)


def _sweep_of(path: Path) -> SweepResult:
    data = json.loads(path.read_text())
    if not is_sweep(data):
        raise ConfigError(f"--from-json {path}: only overload and agents12 runs go together")
    return SweepResult.from_dict(data)
