"""The overload preset's figures, per mode and offered load: goodput, failed accepted turns,
refused turns and how fast they were refused, the follow-up TTFT of sessions already running,
cold turns' waits, reuse and engines marked down; issue 48's bars checked pass/fail per mode;
written as ``results.json``, ``summary.md`` and ``overload.png`` (goodput and follow-up TTFT
p99 against the offered load, one line per mode)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Final

from agentkv_server.bench.capacity import Capacity
from agentkv_server.bench.overload import STEADY, OverloadWorkload
from agentkv_server.bench.records import SweepResult, TenantTurn
from agentkv_server.bench.report import (
    _COLORS,
    JSON_NAME,
    MARKDOWN_NAME,
    _figure,
    _legend,
    header_lines,
)
from agentkv_server.bench.turn_figures import TurnFigures, quantile
from agentkv_server.errors import ConfigError

__all__ = [
    "MEASURES",
    "OVERLOAD_PLOT",
    "Check",
    "OverloadRow",
    "capacity_of",
    "check_bars",
    "is_overload",
    "merge_sweeps",
    "overload_workload",
    "render_overload_markdown",
    "summarize_overload",
    "write_overload_report",
]

MEASURES: Final = "overload"  # config["measures"] of the overload preset's results.json
OVERLOAD_PLOT: Final = "overload.png"
# Issue 48's bars: the loads they apply at, and their limits.
ALONE, BASE, OVER = 0.0, 1.0, (2.0, 4.0)
REFUSAL_LIMIT_S: Final = 1.0
FOLLOWUP_P99_LIMIT: Final = 2.0
GOODPUT_SHARE: Final = 0.9
STEADY_P99_LIMIT: Final = 1.5


def overload_workload(result: SweepResult) -> OverloadWorkload:
    """The workload an overload run's results.json names (``config["overload"]``)."""
    fields = result.config["overload"]
    return OverloadWorkload(**{k: tuple(v) if isinstance(v, list) else v
                               for k, v in fields.items()})  # fmt: skip


def capacity_of(result: SweepResult) -> Capacity:
    """The capacity an overload run's loads are multiples of (``config["capacity"]``)."""
    return Capacity.from_dict(result.config["capacity"])


def merge_sweeps(results: Sequence[SweepResult]) -> SweepResult:
    """Runs of one preset asked for apart (each some modes or loads) as one result: every turn
    and window, the first run's configuration with every run's modes (and loads). Overload runs
    go together only on the same capacity and workload but for the loads (``--capacity``)."""
    first = results[0]
    kinds = {r.config.get("measures") for r in results}
    if len(kinds) > 1:
        raise ConfigError(
            f"runs of different presets do not go together: {sorted(map(str, kinds))}"
        )
    config = {**first.config, "modes": _union(r.config.get("modes", ()) for r in results)}
    if first.config.get("measures") == MEASURES:
        config.update(_merged_overload(results))
    turns = tuple(t for r in results for t in r.turns)
    return SweepResult(config, turns, tuple(w for r in results for w in r.windows))


def _merged_overload(results: Sequence[SweepResult]) -> dict[str, Any]:
    capacities = {capacity_of(r).tokens_per_s for r in results}
    if len(capacities) > 1:
        raise ConfigError(
            f"overload runs on different capacities ({sorted(capacities)} tokens/s) do not go "
            "together: give every run after the first the first's --capacity"
        )
    shapes = [replace(overload_workload(r), loads=(0.0,)) for r in results]
    if any(shape != shapes[0] for shape in shapes):
        raise ConfigError(
            "overload runs of different workloads (apart from --loads) do not go together"
        )
    loads = sorted(set(_union(overload_workload(r).loads for r in results)))
    workload = replace(overload_workload(results[0]), loads=tuple(loads))
    return {"overload": {**results[0].config["overload"], "loads": loads},
            "workload_text": workload.describe()}  # fmt: skip


def _union(groups: Iterable[Iterable[Any]]) -> list[Any]:
    return list(dict.fromkeys(item for group in groups for item in group))


def is_overload(data: Mapping[str, Any]) -> bool:
    """Whether a results.json holds an overload run."""
    return data.get("config", {}).get("measures") == MEASURES


@dataclass(frozen=True)
class OverloadRow:
    """One mode at one offered load, repeats pooled (goodput: over every repeat's window)."""

    mode: str
    load: float
    runs: int
    burst_size: int | None
    offered: float | None
    """What the drawn sessions offered, x the capacity."""
    figures: TurnFigures
    good: int
    """Turns answered within the objective, their first token inside the offered window."""
    goodput_per_s: float | None
    refusals: int
    """Tries refused at arrival, those of turns served on a later try included."""
    refusal_p50_s: float | None
    refusal_max_s: float | None
    slow_refusals: int
    """Refusals that came later than REFUSAL_LIMIT_S after the try was sent."""
    refusals_without_retry_after: int
    steady_followup_p99_s: float | None
    cold_ttft_p50_s: float | None
    cold_ttft_p99_s: float | None
    cold_queue_p50_s: float | None
    cold_queue_p99_s: float | None
    """The router's wait in its queue of first turns served (its ``Server-Timing``; none
    there is none on a router with admission control, and unknown on one without)."""
    marked_down: float | None
    router_refused: float | None
    router_queued: float | None


def summarize_overload(result: SweepResult) -> list[OverloadRow]:
    """One row per mode and load, in the order they ran."""
    seen = dict.fromkeys((w.mode, w.load) for w in result.windows if w.load is not None)
    return [_row(result, mode, load) for mode, load in seen]


def _row(result: SweepResult, mode: str, load: float) -> OverloadRow:
    workload = overload_workload(result)
    turns = [t for t in result.turns if t.turn.mode == mode and t.load == load]
    windows = [w for w in result.windows if w.mode == mode and w.load == load]
    served = [t for t in turns if t.outcome == "served"]
    cold = [t for t in served if t.turn.turn == 1]
    refusals = [a for t in turns for a in t.refusals]
    good = sum(_good(t, workload) for t in served)
    offered = next((w.offered_tokens_per_s for w in windows), None)
    steady = TurnFigures.of(t for t in turns if t.label == STEADY)
    # A router that counts admission says a wait in Server-Timing only when there was one.
    admits = bool(windows) and all(w.queued is not None for w in windows)
    queued = [_queue_s(t) or 0.0 for t in cold] if admits else _values(cold, _queue_s)
    return OverloadRow(
        mode=mode,
        load=load,
        runs=len(windows),
        burst_size=next((w.burst_size for w in windows), None),
        offered=None if offered is None else offered / capacity_of(result).tokens_per_s,
        figures=TurnFigures.of(turns),
        good=good,
        goodput_per_s=good / (workload.window_s * len(windows)) if windows else None,
        refusals=len(refusals),
        refusal_p50_s=quantile([a.seconds for a in refusals], 50),
        refusal_max_s=max((a.seconds for a in refusals), default=None),
        slow_refusals=sum(a.seconds > REFUSAL_LIMIT_S for a in refusals),
        refusals_without_retry_after=sum(a.retry_after_s is None for a in refusals),
        steady_followup_p99_s=steady.followup_p99_s,
        cold_ttft_p50_s=quantile(_values(cold, lambda t: t.turn.ttft_s), 50),
        cold_ttft_p99_s=quantile(_values(cold, lambda t: t.turn.ttft_s), 99),
        cold_queue_p50_s=quantile(queued, 50),
        cold_queue_p99_s=quantile(queued, 99),
        marked_down=_sum(w.marked_down for w in windows),
        router_refused=_sum(w.refused for w in windows),
        router_queued=_sum(w.queued for w in windows),
    )


def _good(turn: TenantTurn, workload: OverloadWorkload) -> bool:
    ttft, sent = turn.turn.ttft_s, turn.turn.sent_s
    if ttft is None or sent is None:
        return False
    return ttft <= workload.objective_s and sent + ttft <= workload.window_s


def _queue_s(turn: TenantTurn) -> float | None:
    answered = turn.answered
    return None if answered is None else answered.queue_s


def _values(
    turns: Iterable[TenantTurn], value: Callable[[TenantTurn], float | None]
) -> list[float]:
    return [v for t in turns if (v := value(t)) is not None]


def _sum(values: Iterable[float | None]) -> float | None:
    """None when any run did not measure it: a sum of the runs that did would read as all."""
    values = list(values)
    return None if not values or None in values else sum(v for v in values if v is not None)


@dataclass(frozen=True)
class Check:
    """One bar for one mode: passed (None: not measured, ``detail`` says why) and the figures."""

    mode: str
    bar: str
    passed: bool | None
    detail: str


def check_bars(rows: Sequence[OverloadRow]) -> list[Check]:
    """Issue 48's bars, per mode, from the rows at 0x (steady tenant alone), 1x, 2x and 4x."""
    checks: list[Check] = []
    for mode in dict.fromkeys(r.mode for r in rows):
        at = {r.load: r for r in rows if r.mode == mode}
        over = [at[load] for load in OVER if load in at]
        followups = (at.get(OVER[0]), at.get(BASE), _p99, FOLLOWUP_P99_LIMIT)
        goodput = (at.get(OVER[1]), at.get(BASE), _goodput, GOODPUT_SHARE)
        checks += [
            _over_bar(mode, "0 accepted turns fail", over, _failed),
            _over_bar(mode, "0 engines marked down", over, _marked_down),
            _over_bar(mode, _REFUSAL_BAR, over, _refusals),
            _ratio_bar(mode, _FOLLOWUP_BAR, *followups, upper=True),
            _ratio_bar(mode, _GOODPUT_BAR, *goodput, upper=False),
            _steady_bar(mode, over, at.get(ALONE)),
        ]
    return checks


_REFUSAL_BAR = f"every refusal within {REFUSAL_LIMIT_S:g} s, with Retry-After"
_FOLLOWUP_BAR = f"follow-up TTFT p99 at 2x within {FOLLOWUP_P99_LIMIT:g}x of 1x's"
_GOODPUT_BAR = f"goodput at 4x at least {GOODPUT_SHARE:.0%} of 1x's"


def _failed(row: OverloadRow) -> tuple[bool | None, str]:
    return row.figures.failed == 0, f"{row.figures.failed} failed"


def _marked_down(row: OverloadRow) -> tuple[bool | None, str]:
    if row.marked_down is None:
        return None, "not counted (no router, or a router without the counter)"
    return row.marked_down == 0, f"{row.marked_down:g} marked down"


def _refusals(row: OverloadRow) -> tuple[bool | None, str]:
    late, bare = row.slow_refusals, row.refusals_without_retry_after
    slowest = "" if row.refusal_max_s is None else f", slowest {row.refusal_max_s:.3f} s"
    detail = f"{row.refusals} refusals, {late} late, {bare} without Retry-After{slowest}"
    return late == 0 and bare == 0, detail


def _over_bar(
    mode: str,
    bar: str,
    rows: Sequence[OverloadRow],
    judge: Callable[[OverloadRow], tuple[bool | None, str]],
) -> Check:
    """A bar that every load over capacity must meet."""
    name = f"{bar} at {' and '.join(f'{load:g}x' for load in OVER)}"
    if len(rows) < len(OVER):
        return Check(mode, name, None, "not run at every load over capacity")
    judged = [(row.load, *judge(row)) for row in rows]
    verdicts = [passed for _, passed, _ in judged]
    passed = None if None in verdicts else all(verdicts)
    return Check(mode, name, passed, "; ".join(f"{load:g}x: {d}" for load, _, d in judged))


def _p99(row: OverloadRow) -> float | None:
    return row.figures.followup_p99_s


def _goodput(row: OverloadRow) -> float | None:
    return row.goodput_per_s


def _ratio_bar(
    mode: str,
    bar: str,
    row: OverloadRow | None,
    base: OverloadRow | None,
    value: Callable[[OverloadRow], float | None],
    limit: float,
    *,
    upper: bool,
) -> Check:
    """``row``'s figure over ``base``'s, at most (``upper``) or at least ``limit``."""
    mine = None if row is None else value(row)
    theirs = None if base is None else value(base)
    if mine is None or not theirs:
        return Check(mode, bar, None, "a figure it needs was not measured")
    ratio = mine / theirs
    passed = ratio <= limit if upper else ratio >= limit
    return Check(mode, bar, passed, f"{mine:.3f} / {theirs:.3f} = {ratio:.2f}x")


def _steady_bar(mode: str, over: Sequence[OverloadRow], alone: OverloadRow | None) -> Check:
    bar = (
        f"steady tenant's follow-up p99 at {' and '.join(f'{x:g}x' for x in OVER)} within "
        f"{STEADY_P99_LIMIT:g}x of its own alone"
    )
    base = None if alone is None else alone.steady_followup_p99_s
    mine = [(row.load, row.steady_followup_p99_s) for row in over]
    if not base or len(mine) < len(OVER) or any(p99 is None for _, p99 in mine):
        return Check(mode, bar, None, "a figure it needs was not measured")
    ratios = [(load, p99 / base) for load, p99 in mine if p99 is not None]
    detail = "; ".join(f"{load:g}x: {ratio:.2f}x of {base:.3f} s" for load, ratio in ratios)
    return Check(mode, bar, all(r <= STEADY_P99_LIMIT for _, r in ratios), detail)


def write_overload_report(result: SweepResult, out_dir: Path) -> list[Path]:
    """``results.json`` (with the rows and checks), ``summary.md`` and the plot."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarize_overload(result)
    checks = check_bars(rows)
    data = result.to_dict()
    data["config"] = {**data["config"], "measures": MEASURES}
    data["rows"] = [{**asdict(r), "reuse_share": r.figures.reuse_share} for r in rows]
    data["checks"] = [asdict(c) for c in checks]
    (out_dir / JSON_NAME).write_text(json.dumps(data, indent=1))
    (out_dir / MARKDOWN_NAME).write_text(render_overload_markdown(result, rows, checks))
    return [out_dir / JSON_NAME, _plot(rows, out_dir / OVERLOAD_PLOT), out_dir / MARKDOWN_NAME]


def render_overload_markdown(
    result: SweepResult, rows: Sequence[OverloadRow], checks: Sequence[Check]
) -> str:
    config, capacity, workload = result.config, capacity_of(result), overload_workload(result)
    lines = [
        *header_lines("agentkv bench: overload", config),
        "",
        (
            f"Capacity: {capacity.tokens_per_s:.0f} prompt tokens/s ({capacity.method}). Load "
            "Nx offers N times that in work a reusing stack must compute (first turns' whole "
            "prompts, follow-ups' fresh input and previous answer); offered: what the drawn "
            f"sessions offered. Objective: TTFT {workload.objective_s:g} s, also the routers' "
            f"admission bound (`admission.max_wait_s`). Offered window: "
            f"{workload.window_s:g} s."
        ),
        "",
        (
            "Goodput: turns answered within the objective (TTFT from the first try, retries "
            "included) whose first token came inside the offered window, per second of it. "
            "Failed: accepted turns never answered. Refused: turns refused on every try (the "
            "client retries as openai's does, sleeping Retry-After); refusals: every refused "
            "try, with the seconds from sending it to the refusal (p50 / max). Follow-up TTFT: "
            "served follow-ups (turn >= 2) of every session, the steady tenant's p99 apart. "
            "Cold: first turns served, their TTFT and the router's queue wait (`Server-Timing` "
            "`queue`). Reused: follow-ups served from held history (router path `local` or "
            "`reuse`; `aggregated`: prefix-cache hits). Marked down: the router's "
            "`agentkv_engines_marked_down_total` over the runs (n/a: no router, or none "
            "counted). Router refused / queued: its admission counters. Percentiles are "
            "nearest-rank, repeats pooled."
        ),
        "",
        (
            "| load | mode | offered | per burst | turns | served | goodput (/s) | failed "
            "| refused | refusals (p50 / max s) | follow-up p50 / p99 (s) | steady p99 (s) "
            "| cold TTFT p50 / p99 (s) | cold queue p50 / p99 (s) | reused | marked down "
            "| router refused / queued |"
        ),
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(_row_line(r) for r in sorted(rows, key=lambda r: r.load)),
        "",
        "Bars (issue 48):",
        "",
        "| mode | bar | result | figures |",
        "|---|---|---|---|",
        *(f"| {c.mode} | {c.bar} | {_verdict(c.passed)} | {c.detail} |" for c in checks),
    ]
    return "\n".join(lines) + "\n"


def _row_line(r: OverloadRow) -> str:
    f = r.figures
    cells = [
        f"{r.load:g}x",
        r.mode,
        "n/a" if r.offered is None else f"{r.offered:.2f}x",
        _count(r.burst_size),
        str(f.turns),
        str(f.served),
        "n/a" if r.goodput_per_s is None else f"{r.goodput_per_s:.3f} ({r.good})",
        str(f.failed),
        str(f.refused),
        f"{r.refusals} ({_pair(r.refusal_p50_s, r.refusal_max_s)})" if r.refusals else "0",
        _pair(f.followup_p50_s, f.followup_p99_s),
        _seconds(r.steady_followup_p99_s),
        _pair(r.cold_ttft_p50_s, r.cold_ttft_p99_s),
        _pair(r.cold_queue_p50_s, r.cold_queue_p99_s),
        "n/a" if f.reuse_share is None else f"{f.reuse_share:.0%} ({f.reused}/{f.followups})",
        _count(r.marked_down),
        f"{_count(r.router_refused)} / {_count(r.router_queued)}",
    ]
    return "| " + " | ".join(cells) + " |"


def _verdict(passed: bool | None) -> str:
    return "n/a" if passed is None else ("pass" if passed else "**fail**")


def _pair(first: float | None, second: float | None) -> str:
    return f"{_seconds(first)} / {_seconds(second)}"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _count(value: float | None) -> str:
    return "n/a" if value is None else f"{value:g}"


def _plot(rows: Sequence[OverloadRow], path: Path) -> Path:
    """Goodput and follow-up TTFT p99 against the offered load, one line per mode."""
    figure, (goodput_ax, p99_ax) = _figure(2)
    for mode in dict.fromkeys(r.mode for r in rows):
        mine = sorted((r for r in rows if r.mode == mode and r.offered is not None),
                      key=lambda r: r.load)  # fmt: skip
        color = _COLORS.get(mode)
        for ax, value in ((goodput_ax, _goodput), (p99_ax, _p99)):
            points = [(r.offered, v) for r in mine if (v := value(r)) is not None]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=mode, color=color)
    for ax, title, unit in (
        (goodput_ax, "goodput", "turns/s"),
        (p99_ax, "follow-up TTFT p99", "s"),
    ):
        ax.set(title=title, xlabel="offered load (x capacity)", ylabel=unit)
        ax.set(xlim=(0, None), ylim=(0, None))
        ax.grid(alpha=0.3)
    _legend(p99_ax)
    figure.savefig(path, dpi=120)
    return path
