"""The pressure sweep's figures: per mode and number of sessions, follow-up reuse beside the
clairvoyant's, follow-up TTFT p50 and p99, waits for blocks, failed turns and peak KV held;
written as ``results.json``, ``summary.md`` and ``pressure.png`` (reuse share and TTFT p99
against the number of sessions)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from agentkv_server.bench.clairvoyant import Clairvoyance, best_reuse, trace_of
from agentkv_server.bench.records import BenchResult, PressureWindow, TurnRecord
from agentkv_server.bench.report import _COLORS, JSON_NAME, MARKDOWN_NAME, _figure, _legend
from agentkv_server.bench.stats import percentile
from agentkv_server.router.policy import HOST_TIER, HOST_TIER_OVER_BUDGET

__all__ = [
    "MEASURES",
    "PRESSURE_PLOT",
    "PressureRow",
    "render_pressure_markdown",
    "reused_history",
    "summarize_pressure",
    "write_pressure_report",
]

MEASURES = "pressure"  # config["measures"] of a pressure sweep's results.json
PRESSURE_PLOT = "pressure.png"


def reused_history(record: TurnRecord) -> bool:
    """Whether a follow-up reused its session's history: at least half its prompt came from
    KV already held (the router's figure, or ``aggregated``'s prefix-cache hits)."""
    prompt = record.prompt_tokens or 0
    return prompt > 0 and 2 * (record.reused_tokens or 0) >= prompt


@dataclass(frozen=True)
class PressureRow:
    """One mode at one number of sessions, repeats pooled."""

    mode: str
    sessions: int
    runs: int
    turns: int
    failed: int
    followups: int
    reused: int
    from_host_tier: int
    """Of the reused: follow-ups whose history came back from the decode engine's host tier."""
    clairvoyant_followups: int
    clairvoyant_reused: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    waited_requests: int | None
    waited_beside_holdings: int | None
    waited_beside_holdings_s: float | None
    preemptions: int | None
    peak_kv_tokens: int | None
    peak_kv_fraction: float | None
    missed: dict[str, int]
    """Follow-ups that did not reuse their history, by the router's reason for their path
    (``?``: none said)."""

    @property
    def share(self) -> float | None:
        return self.reused / self.followups if self.followups else None

    @property
    def clairvoyant_share(self) -> float | None:
        if not self.clairvoyant_followups:
            return None
        return self.clairvoyant_reused / self.clairvoyant_followups

    @property
    def of_clairvoyant(self) -> float | None:
        """The mode's share over the clairvoyant's (1: as good as any retention could be)."""
        share, best = self.share, self.clairvoyant_share
        return share / best if share is not None and best else None


def summarize_pressure(result: BenchResult) -> list[PressureRow]:
    """One row per mode and sweep point, in the order they ran."""
    seen = [(w.mode, w.sessions) for w in result.windows]
    seen += [(r.mode, r.pressure_sessions) for r in result.records if r.pressure_sessions]
    return [_row(result, mode, sessions) for mode, sessions in dict.fromkeys(seen) if sessions]


def _row(result: BenchResult, mode: str, sessions: int) -> PressureRow:
    records = [r for r in result.records if r.mode == mode and r.pressure_sessions == sessions]
    windows = [w for w in result.windows if w.mode == mode and w.sessions == sessions]
    followups = [r for r in records if r.ok and r.turn > 1]
    ttfts = [r.ttft_s for r in followups if r.ttft_s is not None]
    best = _clairvoyance(records, windows)
    peaks = [w for w in windows if w.peak_kv_tokens is not None]
    return PressureRow(
        mode=mode,
        sessions=sessions,
        runs=len({r.repeat for r in records}),
        turns=len(records),
        failed=sum(not r.ok for r in records),
        followups=len(followups),
        reused=sum(reused_history(r) for r in followups),
        from_host_tier=sum(
            reused_history(r) and r.kv_reason in (HOST_TIER, HOST_TIER_OVER_BUDGET)
            for r in followups
        ),
        clairvoyant_followups=best.followups if best else 0,
        clairvoyant_reused=best.reused if best else 0,
        ttft_p50_s=percentile(ttfts, 50) if ttfts else None,
        ttft_p99_s=percentile(ttfts, 99) if ttfts else None,
        waited_requests=_sum(w.waited_requests for w in windows),
        waited_beside_holdings=_sum(w.waited_beside_holdings for w in windows),
        waited_beside_holdings_s=_fsum(w.waited_beside_holdings_s for w in windows),
        preemptions=_sum(w.preemptions for w in windows),
        peak_kv_tokens=max((w.peak_kv_tokens or 0 for w in peaks), default=None),
        peak_kv_fraction=max((w.peak_kv_fraction or 0.0 for w in peaks), default=None),
        missed=_missed(followups),
    )


def _missed(followups: list[TurnRecord]) -> dict[str, int]:
    reasons = sorted(r.kv_reason or "?" for r in followups if not reused_history(r))
    return {reason: reasons.count(reason) for reason in dict.fromkeys(reasons)}


def _clairvoyance(records: list[TurnRecord], windows: list[PressureWindow]) -> Clairvoyance | None:
    """The clairvoyant of each run (its own trace, its engine's size), summed over repeats;
    None where the engines did not say their KV cache's size."""
    total = None
    for window in windows:
        if window.capacity_tokens is None:
            continue
        run = [r for r in records if r.repeat == window.repeat]
        found = best_reuse(trace_of(run), window.capacity_tokens, window.block_size or 1)
        total = found if total is None else total + found
    return total


def _sum(values: Iterable[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def _fsum(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) if known else None


def write_pressure_report(result: BenchResult, out_dir: Path) -> list[Path]:
    """``results.json`` (with the rows), ``summary.md`` and the plot, into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = summarize_pressure(result)
    data = result.to_dict()
    data["config"] = {**data["config"], "measures": MEASURES}
    data["pressure"] = [{**asdict(r), "share": r.share,
                         "clairvoyant_share": r.clairvoyant_share} for r in rows]  # fmt: skip
    (out_dir / JSON_NAME).write_text(json.dumps(data, indent=1))
    (out_dir / MARKDOWN_NAME).write_text(render_pressure_markdown(result, rows))
    return [out_dir / JSON_NAME, _plot(rows, out_dir / PRESSURE_PLOT), out_dir / MARKDOWN_NAME]


def render_pressure_markdown(result: BenchResult, rows: Sequence[PressureRow]) -> str:
    config = result.config
    threshold = next((w.wait_threshold_s for w in result.windows), 1.0)
    capacity = next((w.capacity_tokens for w in result.windows if w.capacity_tokens), None)
    lines = [
        "# agentkv bench: memory pressure",
        "",
        f"Command: `{config.get('command', 'agentkv bench')}`",
        "",
        f"Workload: {config.get('workload_text', '')}",
        (
            f"Model: {config.get('model', '?')}; repeats: {config.get('repeats', '?')}; decode "
            f"KV cache: {capacity if capacity is not None else 'unknown'} tokens; deployment: "
            f"{config.get('deployment', '?')}"
        ),
        "",
        (
            "Reused: follow-ups (turn >= 2) that reused at least half their prompt from held KV "
            "(and how many of them loaded it back from the decode engine's host tier). "
            "Clairvoyant: the most follow-ups any retention could have reused in the decode "
            "engine's KV cache, given the run's own trace (Belady's rule: drop the holding used "
            "furthest ahead). TTFT: client-side, over follow-ups, repeats pooled. Waited: decode "
            f"engine requests queued over {threshold:g} s before being scheduled "
            "(`vllm:request_queue_time_seconds`); beside holdings: decode requests that "
            "waited for blocks while unreleased holdings were in the way, as their engine's "
            'connector measured it (`agentkv_engine_blocks_wait_seconds{beside="retained"}`'
            "), and their whole waits in seconds; n/a without a router; preempted: "
            "`vllm:num_preemptions`. Peak KV: "
            "the most the decode engine held, sampled every second. Missed: the follow-ups "
            "that did not reuse their history, by the router's reason for their path "
            "(`released_*`: the session's holding went to make room; `none_held`: it had "
            "expired; docs/protocol.md section 3)."
        ),
        "",
        (
            "| sessions | mode | turns | failed | reused | clairvoyant | of clairvoyant "
            "| TTFT p50 (s) | TTFT p99 (s) | waited | beside holdings | preempted | peak KV "
            "| missed |"
        ),
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        *(_row_line(r) for r in sorted(rows, key=lambda r: r.sessions)),
    ]
    return "\n".join(lines) + "\n"


def _row_line(r: PressureRow) -> str:
    peak = (
        "n/a"
        if r.peak_kv_fraction is None
        else f"{100 * r.peak_kv_fraction:.0f}% ({r.peak_kv_tokens or 0} tokens)"
    )
    cells = [
        str(r.sessions),
        r.mode,
        str(r.turns),
        str(r.failed),
        _reused(r),
        f"{_pct(r.clairvoyant_share)} ({r.clairvoyant_reused}/{r.clairvoyant_followups})",
        _pct(r.of_clairvoyant),
        _seconds(r.ttft_p50_s),
        _seconds(r.ttft_p99_s),
        _count(r.waited_requests),
        _beside(r),
        _count(r.preemptions),
        peak,
        ", ".join(f"{reason} {count}" for reason, count in r.missed.items()) or "-",
    ]
    return "| " + " | ".join(cells) + " |"


def _reused(r: PressureRow) -> str:
    tier = f", {r.from_host_tier} from the host tier" if r.from_host_tier else ""
    return f"{_pct(r.share)} ({r.reused}/{r.followups}{tier})"


def _beside(r: PressureRow) -> str:
    if r.waited_beside_holdings is None:
        return "n/a"
    if not r.waited_beside_holdings or r.waited_beside_holdings_s is None:
        return str(r.waited_beside_holdings)
    return f"{r.waited_beside_holdings} ({r.waited_beside_holdings_s:.2f} s)"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f}%"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _count(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _plot(rows: Sequence[PressureRow], path: Path) -> Path:
    """Reuse share (solid; the clairvoyant's on the same trace dashed) and follow-up TTFT p99
    against the number of sessions, one colour per mode."""
    from matplotlib.ticker import MaxNLocator

    figure, (share_ax, ttft_ax) = _figure(2)
    for mode in dict.fromkeys(r.mode for r in rows):
        mine = sorted((r for r in rows if r.mode == mode), key=lambda r: r.sessions)
        color = _COLORS.get(mode)
        _line(share_ax, [(r.sessions, r.share) for r in mine], mode, color, "-", "o")
        best = [(r.sessions, r.clairvoyant_share) for r in mine]
        _line(share_ax, best, None, color, "--", "x")
        _line(ttft_ax, [(r.sessions, r.ttft_p99_s) for r in mine], mode, color, "-", "o")
    share_ax.set(
        title="follow-ups reused (dashed: clairvoyant)",
        xlabel="sessions at once",
        ylabel="share of follow-ups",
        ylim=(0, 1.05),
    )
    ttft_ax.set(title="follow-up TTFT p99", xlabel="sessions at once", ylabel="TTFT p99 (s)")
    ttft_ax.set_ylim(bottom=0)
    for ax in (share_ax, ttft_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    _legend(ttft_ax)
    figure.savefig(path, dpi=120)
    return path


def _line(ax, points, label, color, style: str, marker: str) -> None:  # type: ignore[no-untyped-def]
    known = [(x, y) for x, y in points if y is not None]
    if known:
        xs, ys = zip(*known)
        ax.plot(xs, ys, style, marker=marker, label=label, color=color)
