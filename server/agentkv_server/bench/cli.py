"""``agentkv bench``: run the multi-turn agent workload against every serving mode, side by side
(``--preset long``: instead, each KV path's cost against history length, to 128k tokens;
``--preset pressure``: the modes with more sessions than the decode engine's KV cache holds,
their reuse beside the clairvoyant's; ``--preset overload``: bursts of new sessions beside
running ones at multiples of the stack's measured capacity, issue 48's bars checked;
``--preset agents12``: issue 48's twelve agent sessions).

Three ways to point it at engines:
  (default)                  start a prefill and a decode engine on this machine (CPU) and run
                             each mode's router in front of them;
  --prefill-url/--decode-url engines already running (e.g. on GPUs): bench runs the routers;
  --base-url [MODE=]URL      endpoints already running as they are (a router, or an engine for
                             ``aggregated``): bench only sends traffic.

``agentkv bench router``: what the router itself adds to a turn, on stub engines, beside
vllm-router (``agentkv bench router --help``).

Ctrl-C or SIGTERM stops a run within seconds, with the routers and engines it started, and
writes no results (exit status 130).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from types import FrameType

from tqdm import tqdm

from agentkv_server import wire
from agentkv_server.bench import router as router_bench
from agentkv_server.bench import sweep_cli
from agentkv_server.bench.cli_setup import (
    TURN_TIMEOUT_S,
    Setup,
    Stopped,
    describe_deployment,
    no_progress,
    open_deployment,
    open_setup,
    progress_line,
    refuse,
    run_config,
    run_until_stopped,
    timing,
    warm_up,
)
from agentkv_server.bench.modes import MODES
from agentkv_server.bench.paths import (
    PathSweep,
    is_path_sweep,
    model_kv_bytes_per_token,
    sweep_paths,
    write_path_report,
)
from agentkv_server.bench.pressure_report import MEASURES as PRESSURE
from agentkv_server.bench.pressure_report import write_pressure_report
from agentkv_server.bench.pressure_run import PressureRecords, run_pressure
from agentkv_server.bench.records import BenchResult, SweepResult
from agentkv_server.bench.report import MARKDOWN_NAME, write_report
from agentkv_server.bench.runner import Runner, RunRecords
from agentkv_server.bench.workload import (
    PRESETS,
    Preset,
    ToolLatency,
    Workload,
    pressure_preset,
)
from agentkv_server.cli import EXIT_INTERRUPTED
from agentkv_server.errors import AgentKVServerError, ConfigError

__all__ = ["configure", "run"]

# Seconds a path sweep's turn (and each router step) may take: a 128k-token prefill on one
# CPU core takes minutes.
_PATH_TURN_TIMEOUT_S = 1800.0
# Options of the mode comparison that the pressure sweep has no use for (it has its own
# session counts) and that only the pressure sweep takes.
_NOT_PRESSURE = ("sessions", "concurrency", "decoders", "decode_tokens")
_PRESSURE_ONLY = ("session_counts", "start_spread")
# Options of the mode comparison that the path sweep has no use for.
_MODES_ONLY = (
    "session_counts",
    "start_spread",
    "sessions",
    "turns",
    "tool_latency",
    "concurrency",
    "decoders",
    "decode_tokens",
    "repeats",
    "aggregated_url",
    "base_url",
    "metrics_url",
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    shape = parser.add_argument_group("workload (overrides the preset's values)")
    shape.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="cpu",
        help="; ".join(f"{name}: {p.description}" for name, p in PRESETS.items()),
    )
    shape.add_argument(
        "--quick",
        action="store_const",
        const="quick",
        dest="preset",
        help="same as --preset quick (CI smoke test)",
    )
    shape.add_argument(
        "--sessions", type=int,
        help="agent sessions per history length (--preset agents12: sessions)",
    )  # fmt: skip
    shape.add_argument(
        "--session-counts",
        type=_int_list,
        metavar="N[,N...]",
        help="--preset pressure: numbers of sessions at once to sweep",
    )
    shape.add_argument(
        "--start-spread",
        type=float,
        metavar="SECONDS",
        help="--preset pressure: sessions start at random moments of this many first seconds "
        "(the preset's 60 s keeps its one CPU prefill engine about half busy)",
    )
    shape.add_argument(
        "--turns",
        type=int,
        help="turns per session (--preset pressure: the most per session; overload: per "
        "bursting session)",
    )
    shape.add_argument(
        "--history-tokens",
        type=_int_list,
        metavar="N[,N...]",
        help="initial history lengths to sweep (--preset pressure, overload: LOW,HIGH, drawn "
        "per session)",
    )
    shape.add_argument(
        "--new-tokens", type=int,
        help="fresh input per turn (tool result, user; --preset agents12: words)",
    )  # fmt: skip
    shape.add_argument("--output-tokens", type=int, help="generated tokens per turn")
    shape.add_argument(
        "--tool-latency",
        type=_tool_latency,
        metavar="KIND:SECONDS",
        help="seconds between turns: fixed, exponential, lognormal or uniform (--preset "
        "pressure, overload: lognormal:MEDIAN)",
    )
    shape.add_argument("--concurrency", type=int, help="sessions active at once")
    shape.add_argument(
        "--decoders",
        type=int,
        help="sessions decoding long outputs beside the agent sessions (their inter-token "
        "latency shows what each mode's turns cost other sessions; 0: none)",
    )
    shape.add_argument("--decode-tokens", type=int, help="output tokens per decoding request")
    shape.add_argument("--repeats", type=int, help="runs of the whole workload per mode")
    shape.add_argument("--seed", type=int, help="seed of the workload's random draws")
    sweep_cli.configure_overload(parser.add_argument_group("--preset overload"))
    where = parser.add_argument_group("engines")
    where.add_argument(
        "--modes",
        type=_mode_list,
        metavar="MODE[,MODE...]",
        help=f"modes to measure, in this order (default: {','.join(MODES)}; --preset overload: "
        f"{','.join(PRESETS['overload'].modes or ())}; --preset agents12: agentkv)",
    )
    where.add_argument(
        "--model",
        help="local stack: a model name (default: the preset's, smollm2 for cpu, tiny-long for "
        "long, the tiny random-weight test model for quick) or directory; external engines: "
        "served model name (default: asked from the engine)",
    )
    where.add_argument(
        "--kv-cache-gib",
        type=int,
        metavar="GIB",
        help="local stack: each engine's KV cache (default: the preset's, 4 for cpu, else 1)",
    )
    where.add_argument(
        "--decode-kv-tokens",
        type=int,
        metavar="TOKENS",
        help="local stack: the decode engine's KV cache in tokens, below what --kv-cache-gib "
        "holds (default: the preset's; 8192 for pressure, else all of it)",
    )
    where.add_argument(
        "--host-tier-gib",
        type=float,
        metavar="GIB",
        help="local stack: host memory below the decode engine's KV cache, where holdings "
        "released for room leave their KV (default: none)",
    )
    where.add_argument(
        "--prefill-url", action="extend", nargs="+", default=[], metavar="URL",
        help="running prefill engines (repeatable): bench runs each mode's router in front",
    )  # fmt: skip
    where.add_argument(
        "--decode-url", action="extend", nargs="+", default=[], metavar="URL",
        help="running decode engines (repeatable; needs --secret)",
    )  # fmt: skip
    where.add_argument(
        "--aggregated-url",
        action="append",
        default=[],
        metavar="URL",
        help="engine(s) for mode aggregated (default: the decode engines)",
    )
    where.add_argument(
        "--router-port",
        type=int,
        default=8000,
        help="port of bench's routers: the decode engines' agentkv_router_url (8000)",
    )
    where.add_argument(
        "--secret",
        default=os.environ.get(wire.SECRET_ENV),
        help="the decode engines' agentkv_secret (default: $AGENTKV_SECRET)",
    )
    where.add_argument(
        "--base-url",
        action="append",
        default=[],
        metavar="[MODE=]URL",
        help="measure a running endpoint as it is (repeat for several modes)",
    )
    where.add_argument(
        "--metrics-url",
        action="append",
        default=[],
        metavar="URL",
        help="decode engines' /metrics for KV memory, with --base-url",
    )
    where.add_argument(
        "--tokenizer",
        type=Path,
        help="tokenizer.json or model directory used to "
        "size prompts (default: the local model's; else one token per word)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--out", type=Path, help="output directory (default: bench-results/<time>)")
    out.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        metavar="RESULTS_JSON",
        help="only render the report of an earlier run's results.json (--preset overload, "
        "agents12: of several runs' together, each of some modes or loads)",
    )
    out.add_argument(
        "--request-timeout", type=float, metavar="S",
        help=f"seconds one turn may take before it counts as failed ({TURN_TIMEOUT_S:g}; "
        f"--preset long: {_PATH_TURN_TIMEOUT_S:g}, for each router step too; --preset "
        "overload: 120, the routers' deadline for an accepted turn too)",
    )  # fmt: skip
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    other = parser.add_subparsers(
        dest="bench_command",
        title="other benchmarks (optional)",
        metavar="router",
        help="what the router adds to a turn, on stub engines, beside vllm-router; its own "
        "options (agentkv bench router --help)",
    )
    router_bench.configure(other.add_parser("router"))


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench_command", None) == "router":
        return router_bench.run(args)
    out_dir = args.out or Path("bench-results") / time.strftime("%Y%m%d-%H%M%S")
    try:
        with _sigterm_as_ctrl_c():
            result = _result(args, out_dir)
    except ConfigError as exc:  # bad options: no traceback
        print(f"agentkv bench: {exc}", file=sys.stderr)
        return 2
    except AgentKVServerError as exc:  # engines that would not start
        print(f"agentkv bench: {exc}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Stopped):  # the engines and routers it started are stopped now
        print("agentkv bench: interrupted; no results written", file=sys.stderr)
        return EXIT_INTERRUPTED
    if isinstance(result, PathSweep):
        write_path_report(result, out_dir)
        return _print_outputs(out_dir, failed=sum(not t.ok for t in result.turns))
    if isinstance(result, SweepResult):
        sweep_cli.write_sweep_report(result, out_dir)
        return _print_outputs(out_dir, failed=sum(t.outcome == "failed" for t in result.turns))
    return _report_modes(result, out_dir)


@contextlib.contextmanager
def _sigterm_as_ctrl_c() -> Iterator[None]:
    """While the block runs, SIGTERM stops it as Ctrl-C does (KeyboardInterrupt; inside its
    event loops, ``run_until_stopped``). Signals belong to the main thread; elsewhere nothing
    changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _result(args: argparse.Namespace, out_dir: Path) -> BenchResult | PathSweep | SweepResult:
    """An earlier run's results (``--from-json``), else what the preset measures."""
    if args.from_json:
        if len(args.from_json) > 1:
            return sweep_cli.merged_sweeps(args.from_json)
        data = json.loads(args.from_json[0].read_text())
        if is_path_sweep(data):
            return PathSweep.from_dict(data)
        if sweep_cli.is_sweep(data):
            return SweepResult.from_dict(data)
        return BenchResult.from_dict(data)
    plan = _plan(args)
    if plan.measures != "overload":
        refuse(args, sweep_cli.OVERLOAD_ONLY, "is an overload option (--preset overload)")
    if plan.measures == "paths":
        return _measure_paths(args, plan, out_dir)
    args = argparse.Namespace(**{**vars(args), "modes": args.modes or plan.modes or MODES})
    if plan.measures == "pressure":
        return _measure_pressure(args, plan, out_dir)
    if plan.measures == "overload":
        return sweep_cli.measure_overload(args, plan, out_dir)
    if plan.measures == "agents12":
        return sweep_cli.measure_agents(args, plan, out_dir)
    refuse(args, _PRESSURE_ONLY, "is a pressure sweep's option (--preset pressure)")
    return _measure(args, plan, out_dir)


def _print_outputs(out_dir: Path, *, failed: int) -> int:
    """The markdown summary on stdout, where the results are and what failed on stderr."""
    print((out_dir / MARKDOWN_NAME).read_text())
    print(f"results: {out_dir.resolve()}", file=sys.stderr)
    if failed:
        print(f"{failed} turn(s) failed; see 'error' in results.json", file=sys.stderr)
    return 1 if failed else 0


def _report_modes(result: BenchResult, out_dir: Path) -> int:
    if result.config.get("measures") == PRESSURE:
        write_pressure_report(result, out_dir)
    else:
        write_report(result, out_dir)
    code = _print_outputs(out_dir, failed=sum(not r.ok for r in result.records))
    failed_decodes = sum(d.error is not None for d in result.decodes)
    if failed_decodes:
        print(
            f"{failed_decodes} decoding request(s) failed; see 'decodes' in results.json",
            file=sys.stderr,
        )
    return 1 if code or failed_decodes else 0


def _plan(args: argparse.Namespace) -> Preset:
    preset = PRESETS[args.preset]
    if preset.pressure is not None:
        return _pressure_plan(args, preset)
    if preset.overload is not None:
        return sweep_cli.overload_plan(args, preset)
    if preset.agents is not None:
        return sweep_cli.agents_plan(args, preset)
    return preset.with_overrides(
        sessions=args.sessions,
        turns=args.turns,
        history_tokens=args.history_tokens,
        new_tokens=args.new_tokens,
        output_tokens=args.output_tokens,
        tool_latency=args.tool_latency,
        concurrency=args.concurrency,
        decoders=args.decoders,
        decode_tokens=args.decode_tokens,
        seed=args.seed,
        repeats=args.repeats,
        kv_cache_gib=args.kv_cache_gib,
        decode_kv_tokens=args.decode_kv_tokens,
    )


def _pressure_plan(args: argparse.Namespace, preset: Preset) -> Preset:
    """The pressure preset with the command line's values (its own meaning of some)."""
    assert preset.pressure is not None
    refuse(args, _NOT_PRESSURE, "does not apply to --preset pressure (see --session-counts)")
    gap = args.tool_latency
    if gap is not None and gap.kind != "lognormal":
        raise ConfigError("--preset pressure: tool gaps are lognormal; give lognormal:MEDIAN")
    pressure = preset.pressure.with_overrides(
        session_counts=args.session_counts,
        history_tokens=args.history_tokens,
        turns=args.turns,
        new_tokens=args.new_tokens,
        output_tokens=args.output_tokens,
        gap_median_s=gap.mean_s if gap is not None else None,
        start_spread_s=args.start_spread,
        seed=args.seed,
    )
    return pressure_preset(
        preset.description,
        pressure,
        repeats=args.repeats or preset.repeats,
        model=preset.model,
        kv_cache_gib=args.kv_cache_gib or preset.kv_cache_gib,
        decode_kv_tokens=args.decode_kv_tokens or preset.decode_kv_tokens,
    )


def _measure(args: argparse.Namespace, plan: Preset, out_dir: Path) -> BenchResult:
    started = time.time()
    with open_setup(args, plan, out_dir) as setup:
        total = len(setup.modes) * plan.repeats * _turns_per_repeat(plan.workload)
        with tqdm(total=total, unit="turn", file=sys.stderr, disable=args.no_progress) as bar:
            runner = Runner(
                plan.workload,
                setup.tokenizer,
                on_turn=lambda _: bar.update(),
                request_timeout_s=args.request_timeout or TURN_TIMEOUT_S,
            )
            records = run_until_stopped(_run_modes(setup, plan.repeats, runner, bar))
    config = {
        **run_config(args, plan),
        "workload_text": _describe_workload(plan.workload),
        "repeats": plan.repeats,
        "modes": list(setup.modes),
        "model": setup.model,
        "deployment": setup.description,
        **timing(started),
    }
    return BenchResult(
        config, tuple(records.turns), tuple(records.decodes), tuple(records.transfers)
    )


def _measure_pressure(args: argparse.Namespace, plan: Preset, out_dir: Path) -> BenchResult:
    """The pressure sweep (bench/pressure_run.py): every mode per number of sessions."""
    assert plan.pressure is not None
    pressure = plan.pressure
    started = time.time()
    progress = no_progress if args.no_progress else progress_line
    with open_setup(args, plan, out_dir) as setup:
        runner = Runner(
            plan.workload,
            setup.tokenizer,
            request_timeout_s=args.request_timeout or TURN_TIMEOUT_S,
        )

        async def sweep() -> PressureRecords:
            salt = uuid.uuid4().hex[:8]
            await warm_up(runner, setup, salt)
            return await run_pressure(
                pressure, setup.modes, plan.repeats, setup.open_target, runner, salt,
                progress=progress,
            )  # fmt: skip

        found = run_until_stopped(sweep())
    config = {
        **run_config(args, plan),
        "measures": PRESSURE,
        "pressure": json.loads(json.dumps(asdict(pressure))),
        "workload_text": pressure.describe(),
        "repeats": plan.repeats,
        "modes": list(setup.modes),
        "model": setup.model,
        "deployment": setup.description,
        **timing(started),
    }
    return BenchResult(config, tuple(found.turns), windows=tuple(found.windows))


def _measure_paths(args: argparse.Namespace, plan: Preset, out_dir: Path) -> PathSweep:
    """The path sweep (bench/paths.py) on the local stack or the engines given."""
    _refuse_options_of_modes(args)
    started = time.time()
    step_s = args.request_timeout or _PATH_TURN_TIMEOUT_S
    progress = no_progress if args.no_progress else progress_line
    with open_deployment(args, plan, out_dir) as (deployment, tokenizer, model_dir):
        sweep = sweep_paths(deployment, tokenizer, plan.workload, step_s=step_s, progress=progress)
        turns = run_until_stopped(sweep)
    w = plan.workload
    config = {
        **run_config(args, plan),
        "workload_text": (
            f"one session per history length {', '.join(map(str, w.history_tokens))} tokens, "
            f"one turn per forced KV path; {w.new_tokens} new and {w.output_tokens} output "
            "tokens per turn, not streamed"
        ),
        "model": deployment.model,
        "kv_bytes_per_token": model_kv_bytes_per_token(model_dir),
        "step_timeout_s": step_s,
        "deployment": describe_deployment(deployment),
        **timing(started),
    }
    return PathSweep(config, tuple(turns))


def _refuse_options_of_modes(args: argparse.Namespace) -> None:
    given = [name for name in _MODES_ONLY if getattr(args, name) not in (None, [])]
    if args.modes is not None:
        given.append("modes")
    if given:
        options = ", ".join("--" + name.replace("_", "-") for name in given)
        raise ConfigError(
            f"--preset {args.preset} measures each KV path, not the modes: {options} do not apply"
        )


async def _run_modes(setup: Setup, repeats: int, runner: Runner, bar: tqdm) -> RunRecords:
    salt = uuid.uuid4().hex[:8]  # a fresh prefix for every run: no cache hit from an earlier one
    await warm_up(runner, setup, salt)
    records = RunRecords([], [], [])
    for mode in setup.modes:
        for repeat in range(repeats):
            bar.set_description(f"{mode} {repeat + 1}/{repeats}")
            async with setup.open_target(mode) as target:
                records.extend(await runner.run(target, repeat, salt))
    return records


def _turns_per_repeat(workload: Workload) -> int:
    return workload.sessions * workload.turns * len(workload.history_tokens)


def _describe_workload(w: Workload) -> str:
    return (
        f"{w.sessions} sessions x {w.turns} turns per history length "
        f"{', '.join(map(str, w.history_tokens))} tokens; {w.new_tokens} new and {w.output_tokens} "
        f"output tokens per turn; tool latency {w.tool_latency}; concurrency {w.concurrency}"
        + (
            f"; beside them {w.decoders} session(s) decoding {w.decode_tokens}-token outputs"
            if w.decoders
            else ""
        )
    )


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None


def _tool_latency(text: str) -> ToolLatency:
    try:
        return ToolLatency.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _mode_list(text: str) -> tuple[str, ...]:
    modes = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}"
        )
    return modes
