"""Writes a run's results: ``results.json`` (config, records, summary), PNG plots (the TPOT
trade plot only with decoding sessions) and a markdown summary, all into one output directory.

Plots use matplotlib's Agg backend: no display is needed, and the choice is made on the
figure's own canvas rather than with the process-wide ``matplotlib.use``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from agentkv_server.bench.gaps import GAP_STEPS, SLOW_GAP_FACTOR, gap_causes
from agentkv_server.bench.records import BenchResult
from agentkv_server.bench.stats import BREAKDOWN_STEPS, ModeSummary, Spread, Summary, summarize

__all__ = [
    "JSON_NAME",
    "MARKDOWN_NAME",
    "SPEEDUP_PLOT",
    "TRADE_PLOT",
    "TTFT_PLOT",
    "header_lines",
    "render_markdown",
    "write_report",
]

JSON_NAME = "results.json"
MARKDOWN_NAME = "summary.md"
TTFT_PLOT = "ttft_by_turn.png"
SPEEDUP_PLOT = "speedup_vs_history.png"
TRADE_PLOT = "ttft_vs_tpot.png"

# One colour per mode in every plot, so the two figures read together.
_COLORS = {
    "recompute": "tab:gray",
    "upstream": "tab:orange",
    "upstream-best": "tab:red",
    "agentkv": "tab:blue",
    "aggregated": "tab:green",
}


def write_report(result: BenchResult, out_dir: Path) -> list[Path]:
    """Write every output of ``result`` into ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(result.records, decodes=result.decodes, transfers=result.transfers)
    paths = [
        _write_json(result, summary, out_dir / JSON_NAME),
        _plot_ttft_by_turn(summary, out_dir / TTFT_PLOT),
        _plot_speedup(summary, out_dir / SPEEDUP_PLOT),
    ]
    if any(m.tpot is not None for m in summary.modes):
        paths.append(_plot_trade(summary, out_dir / TRADE_PLOT))
    markdown = out_dir / MARKDOWN_NAME
    markdown.write_text(render_markdown(result, summary))
    return [*paths, markdown]


def _write_json(result: BenchResult, summary: Summary, path: Path) -> Path:
    path.write_text(json.dumps({**result.to_dict(), "summary": asdict(summary)}, indent=1))
    return path


def render_markdown(result: BenchResult, summary: Summary) -> str:
    """The summary a person reads: the run's shape, one row per mode, one row per history."""
    lines = [
        *header_lines("agentkv bench", result.config),
        "",
        (
            "TTFT and end-to-end latency are client-side medians over follow-up turns (turn >= 2), "
            "given as the median of per-repeat medians [lowest - highest repeat]. Speedup is "
            f"`{summary.baseline}`'s median over the mode's."
        ),
        "",
        (
            "| mode | turns | errors | TTFT turn 1 (s) | TTFT follow-up (s) | TTFT speedup "
            "| e2e follow-up (s) | e2e speedup | reused | decode KV mean / peak |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(_mode_row(m) for m in summary.modes),
        "",
        *_history_table(summary),
        "",
        *_trade_table(summary),
        *_breakdown_table(summary),
        *_transfer_table(summary),
        *_gap_table(result),
    ]
    return "\n".join(lines) + "\n"


def header_lines(title: str, config: Mapping[str, Any]) -> list[str]:
    """A summary's title and how its run was asked for: command, workload, model, repeats and
    deployment, from its ``config``."""
    return [
        f"# {title}",
        "",
        f"Command: `{config.get('command', 'agentkv bench')}`",
        "",
        f"Workload: {config.get('workload_text', '')}",
        (
            f"Model: {config.get('model', '?')}; repeats: {config.get('repeats', '?')}; "
            f"deployment: {config.get('deployment', '?')}"
        ),
    ]


def _mode_row(m: ModeSummary) -> str:
    kv = (
        f"{_pct(m.decode_kv_usage_mean)} / {_pct(m.decode_kv_usage_peak)}"
        if m.decode_kv_usage_peak is not None
        else "n/a"
    )
    cells = [
        m.mode,
        str(m.turns),
        str(m.errors),
        _spread(m.ttft_first_s),
        _spread(m.ttft_followup_s),
        _times(m.speedup),
        _spread(m.latency_followup_s),
        _times(m.latency_speedup),
        _pct(m.reused_fraction),
        kv,
    ]
    return "| " + " | ".join(cells) + " |"


def _history_table(summary: Summary) -> list[str]:
    modes = [m.mode for m in summary.modes]
    histories = sorted({p.history_tokens for p in summary.by_history})
    if not histories:
        return []
    cell = {(p.mode, p.history_tokens): p for p in summary.by_history}
    rows = [
        f"Follow-up TTFT by initial history (s; speedup over `{summary.baseline}` in parentheses):",
        "",
        "| history tokens | " + " | ".join(modes) + " |",
        "|---:|" + "---:|" * len(modes),
    ]
    for history in histories:
        cells = []
        for mode in modes:
            point = cell.get((mode, history))
            cells.append(
                "n/a"
                if point is None
                else f"{point.ttft_followup_s.median:.3f} ({_times(point.speedup)})"
            )
        rows.append(f"| {history} | " + " | ".join(cells) + " |")
    return rows


def _trade_table(summary: Summary) -> list[str]:
    """What each mode's follow-up TTFT costs the sessions decoding beside it (their TPOT)."""
    if not any(m.tpot is not None for m in summary.modes):
        return []
    rows = [
        (
            "Decoding sessions beside the turns: inter-token latency (TPOT) of their streams, "
            f"pooled over repeats, against the agent sessions' follow-up TTFT; p99 ratio over "
            f"`{summary.baseline}`'s; delay per turn: the gaps' excess over their median, summed "
            "and divided by the mode's agent turns (what one turn cost the decoders, whatever "
            "the run's length):"
        ),
        "",
        (
            "| mode | TTFT follow-up (s) | TPOT p50 (ms) | TPOT p99 (ms) | TPOT max (ms) "
            "| p99 ratio | delay per turn (s) | gaps | decode errors | local follow-ups |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in summary.modes:
        tpot = m.tpot
        cells = [
            m.mode,
            _spread(m.ttft_followup_s),
            *(("n/a",) * 3 if tpot is None else (_ms(tpot.p50), _ms(tpot.p99), _ms(tpot.max))),
            _times(m.tpot_p99_ratio),
            "n/a" if m.tpot_delay_per_turn_s is None else f"{m.tpot_delay_per_turn_s:.2f}",
            "0" if tpot is None else str(tpot.gaps),
            str(m.decode_errors),
            f"{m.paths.get('local', 0)} of {m.followups}" if m.paths else "n/a",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return [*rows, ""]


def _breakdown_table(summary: Summary) -> list[str]:
    """Where a follow-up turn's time goes, per mode and KV path."""
    rows = [
        (
            "Follow-up turn breakdown per KV path (median s; the router's plan, prefill step and "
            "decode step to first byte from its `Server-Timing` header, then the client's wait "
            "from the last chunk to the stream's end, the router's wait for the holding report):"
        ),
        "",
        "| mode | path | turns | plan | prefill | decode | end wait |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for m in summary.modes:
        for path, steps in m.breakdown_by_path.items():
            cells = [_seconds(steps.get(step)) for step in BREAKDOWN_STEPS]
            count = m.paths.get(path, m.followups - sum(m.paths.values()))
            rows.append(f"| {m.mode} | {path} | {count} | " + " | ".join(cells) + " |")
    return rows


def _transfer_table(summary: Summary) -> list[str]:
    """The KV transfers inside the P and D steps, which the router cannot time itself."""
    if not any(m.transfers for m in summary.modes):
        return []
    rows = [
        "",
        (
            "KV transfers as the engines report them (`vllm:nixl_xfer_time_seconds`; every "
            "request of the mode, decoding sessions' included): NIXL reads by the prefill "
            "engine (pulls of held history) and by the decode engine (P's new blocks), and "
            "their mean duration:"
        ),
        "",
        "| mode | P reads | P mean read (ms) | D reads | D mean read (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    for m in summary.modes:
        cells = []
        for role in ("prefill", "decode"):
            totals = m.transfers.get(role)
            cells += (
                ["n/a", "n/a"]
                if totals is None
                else [
                    str(totals.reads),
                    _ms(totals.seconds / totals.reads) if totals.reads else "n/a",
                ]
            )
        rows.append(f"| {m.mode} | " + " | ".join(cells) + " |")
    return rows


def _gap_table(result: BenchResult) -> list[str]:
    """What the decoding sessions' slow gaps ran beside (bench/gaps.py)."""
    causes = gap_causes(result.records, result.decodes)
    if not causes:
        return []
    rows = [
        "",
        (
            f"Decoding sessions' slow gaps (over {SLOW_GAP_FACTOR:g}x the mode's median) by the "
            "agent turns' steps they overlapped, as slow gaps of all the gaps beside that step: "
            "a gap counts under each step it overlapped, `none` when it overlapped no step:"
        ),
        "",
        "| mode | slow gaps | over (ms) | their seconds | " + " | ".join(GAP_STEPS) + " | none |",
        "|---|---:|---:|---:|" + "---:|" * (len(GAP_STEPS) + 1),
    ]
    for c in causes:
        cells = [
            f"{c.by_step.get(step, 0)} of {c.gaps_by_step.get(step, 0)}"
            for step in (*GAP_STEPS, "none")
        ]
        head = f"| {c.mode} | {c.slow} | {_ms(c.threshold_s)} | {c.slow_s:.1f} | "
        rows.append(head + " | ".join(cells) + " |")
    return rows


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}"


def _spread(spread: Spread | None) -> str:
    if spread is None:
        return "n/a"
    if spread.repeats == 1:
        return f"{spread.median:.3f}"
    return f"{spread.median:.3f} [{spread.low:.3f} - {spread.high:.3f}]"


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def _pct(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{100 * fraction:.0f}%"


def _figure(panels: int = 1):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(4.5 * panels, 3.8), layout="constrained")
    FigureCanvasAgg(figure)
    return figure, figure.subplots(1, panels, squeeze=False)[0]


def _plot_ttft_by_turn(summary: Summary, path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    histories = sorted({p.history_tokens for p in summary.by_turn}) or [0]
    figure, axes = _figure(len(histories))
    for ax, history in zip(axes, histories):
        for mode in _modes(summary):
            points = sorted(
                (p.turn, p.ttft_s)
                for p in summary.by_turn
                if p.mode == mode and p.history_tokens == history
            )
            if points:
                turns, ttfts = zip(*points)
                ax.plot(turns, ttfts, marker="o", label=mode, color=_COLORS.get(mode))
        ax.set(title=f"initial history {history} tokens", xlabel="turn", ylabel="median TTFT (s)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    _legend(axes[0])
    figure.savefig(path, dpi=120)
    return path


def _plot_speedup(summary: Summary, path: Path) -> Path:
    figure, (ax,) = _figure()
    for mode in _modes(summary):
        points = sorted(
            (p.history_tokens, p.speedup)
            for p in summary.by_history
            if p.mode == mode and p.speedup is not None
        )
        if points:
            histories, speedups = zip(*points)
            ax.plot(histories, speedups, marker="o", label=mode, color=_COLORS.get(mode))
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.set(
        title=f"follow-up TTFT speedup over {summary.baseline}",
        xlabel="initial history (tokens)",
        ylabel="speedup (x)",
    )
    ax.grid(alpha=0.3)
    _legend(ax)
    figure.savefig(path, dpi=120)
    return path


def _plot_trade(summary: Summary, path: Path) -> Path:
    """Follow-up TTFT against the decoding sessions' TPOT p99: one line per mode through its
    history lengths (labelled); down and left is better on both."""
    figure, (ax,) = _figure()
    for mode in _modes(summary):
        points = sorted(
            (p.history_tokens, p.tpot.p99 * 1000, p.ttft_followup_s.median)
            for p in summary.by_history
            if p.mode == mode and p.tpot is not None
        )
        if not points:
            continue
        _, tpots, ttfts = zip(*points)
        ax.plot(tpots, ttfts, marker="o", label=mode, color=_COLORS.get(mode))
        for history, x, y in points:
            ax.annotate(str(history), (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set(
        title="follow-up TTFT vs other sessions' TPOT",
        xlabel="decoding sessions' TPOT p99 (ms)",
        ylabel="median follow-up TTFT (s)",
    )
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _legend(ax)
    figure.savefig(path, dpi=120)
    return path


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:  # a run with no successful turn has nothing to name
        ax.legend()


def _modes(summary: Summary) -> Sequence[str]:
    return [m.mode for m in summary.modes]
