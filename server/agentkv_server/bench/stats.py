"""From turn records to the figures a reader compares: medians, spread, ratios to the baseline.

Repeats are the unit of spread: a figure is computed per repeat (its median over turns), and
the report gives the median of those per-repeat values with their min and max. Turn 1 is cold
in every mode (no history is held anywhere yet), so reuse is judged on the follow-up turns.

Decoding sessions' inter-token latency (TPOT) is pooled over all their gaps in a mode (or a
mode and history length), repeats together: a stall is one gap among hundreds, so its tail
(p99) is what shows it, and per-repeat tails of a few hundred gaps would be too coarse.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

from agentkv_server.bench.records import DecodeRecord, TransferRecord, TurnRecord
from agentkv_server.bench.transfers import TransferTotals

__all__ = [
    "BREAKDOWN_STEPS",
    "HistoryPoint",
    "ModeSummary",
    "Spread",
    "Summary",
    "Tpot",
    "TurnPoint",
    "percentile",
    "summarize",
]


@dataclass(frozen=True)
class Spread:
    """Median over repeats of a per-repeat median, with the lowest and highest repeat."""

    median: float
    low: float
    high: float
    repeats: int

    @classmethod
    def of(cls, per_repeat: Sequence[float]) -> Spread | None:
        if not per_repeat:
            return None
        return cls(statistics.median(per_repeat), min(per_repeat), max(per_repeat), len(per_repeat))


@dataclass(frozen=True)
class Tpot:
    """Decoding sessions' inter-token latency: median, 99th percentile and worst gap (s)."""

    p50: float
    p99: float
    max: float
    gaps: int

    @classmethod
    def of(cls, gaps: Sequence[float]) -> Tpot | None:
        if not gaps:
            return None
        return cls(percentile(gaps, 50), percentile(gaps, 99), max(gaps), len(gaps))


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100): a value that was measured."""
    ordered = sorted(values)
    rank = max(math.ceil(q / 100 * len(ordered)), 1)
    return ordered[rank - 1]


@dataclass(frozen=True)
class ModeSummary:
    """One mode's figures. ``speedup`` is the baseline's follow-up TTFT over this mode's."""

    mode: str
    turns: int
    errors: int
    followups: int
    ttft_first_s: Spread | None
    ttft_followup_s: Spread | None
    latency_followup_s: Spread | None
    reused_fraction: float | None
    decode_kv_usage_mean: float | None
    decode_kv_usage_peak: float | None
    speedup: float | None
    latency_speedup: float | None
    paths: dict[str, int]
    """Follow-up turns per KV path the router reported (``local``, ``reuse``, ...)."""
    breakdown: dict[str, float]
    """Median seconds of each step of a follow-up turn (TurnRecord's breakdown fields)."""
    breakdown_by_path: dict[str, dict[str, float]] = field(default_factory=dict)
    """The same per KV path (``local``, ``reuse``, ...; ``-`` where no router reported one):
    the paths' steps differ, so their medians are read apart."""
    tpot: Tpot | None = None
    """Decoding sessions' inter-token latency; None without decoding sessions."""
    tpot_p99_ratio: float | None = None
    """This mode's TPOT p99 over the baseline's (above 1: decoding suffers more)."""
    tpot_delay_per_turn_s: float | None = None
    """Seconds the decoding sessions' gaps ran over their median, per agent turn of the mode:
    what one turn cost them. The p99 also depends on how many gaps a run had (a mode whose
    closed-loop sessions finish sooner has fewer), this does not."""
    decode_errors: int = 0
    """Decoding sessions' failed requests."""
    transfers: dict[str, TransferTotals] = field(default_factory=dict)
    """NIXL reads per engine role (``prefill``, ``decode``) over the mode's whole run, as the
    engines report them; missing where the engines were not asked or did not say."""


@dataclass(frozen=True)
class TurnPoint:
    """Median TTFT of one turn index, over sessions and repeats (the TTFT-by-turn plot)."""

    mode: str
    history_tokens: int
    turn: int
    ttft_s: float


@dataclass(frozen=True)
class HistoryPoint:
    """Follow-up TTFT at one initial history length (the speedup-vs-history plot)."""

    mode: str
    history_tokens: int
    ttft_followup_s: Spread
    speedup: float | None
    tpot: Tpot | None = None


@dataclass(frozen=True)
class Summary:
    baseline: str
    modes: tuple[ModeSummary, ...]
    by_turn: tuple[TurnPoint, ...]
    by_history: tuple[HistoryPoint, ...]

    def mode(self, name: str) -> ModeSummary | None:
        return next((m for m in self.modes if m.mode == name), None)


def summarize(
    records: Iterable[TurnRecord],
    baseline: str = "recompute",
    decodes: Iterable[DecodeRecord] = (),
    transfers: Iterable[TransferRecord] = (),
) -> Summary:
    """Every figure of the report, from the records of all modes, histories and repeats, the
    decoding sessions' requests and the engines' transfer totals."""
    records = list(records)
    decodes = list(decodes)
    transfers = list(transfers)
    modes = list(dict.fromkeys(r.mode for r in records))
    per_mode = {mode: [r for r in records if r.mode == mode] for mode in modes}
    base = per_mode.get(baseline, [])
    base_tpot = _tpot(decodes, baseline)
    return Summary(
        baseline=baseline,
        modes=tuple(
            replace(
                _with_tpot(_mode_summary(mode, per_mode[mode], base), decodes, base_tpot),
                transfers=_transfers(transfers, mode),
            )
            for mode in modes
        ),
        by_turn=tuple(_by_turn(records)),
        by_history=tuple(_by_history(per_mode, base, decodes)),
    )


def _gaps(decodes: list[DecodeRecord], mode: str, history: int | None = None) -> list[float]:
    return [
        gap
        for d in decodes
        if d.mode == mode and (history is None or d.history_tokens == history)
        for gap in d.gaps_s
    ]


def _tpot(decodes: list[DecodeRecord], mode: str, history: int | None = None) -> Tpot | None:
    return Tpot.of(_gaps(decodes, mode, history))


def _transfers(transfers: list[TransferRecord], mode: str) -> dict[str, TransferTotals]:
    totals: dict[str, TransferTotals] = {}
    for t in transfers:
        if t.mode == mode:
            totals[t.role] = totals.get(t.role, TransferTotals(0, 0.0)) + TransferTotals(
                t.reads, t.seconds
            )
    return totals


def _with_tpot(summary: ModeSummary, decodes: list[DecodeRecord], base: Tpot | None) -> ModeSummary:
    gaps = _gaps(decodes, summary.mode)
    tpot = Tpot.of(gaps)
    ratio = tpot.p99 / base.p99 if tpot is not None and base is not None and base.p99 > 0 else None
    delay = None
    if tpot is not None and summary.turns:
        delay = sum(max(gap - tpot.p50, 0.0) for gap in gaps) / summary.turns
    errors = sum(d.error is not None for d in decodes if d.mode == summary.mode)
    return replace(
        summary,
        tpot=tpot,
        tpot_p99_ratio=ratio,
        tpot_delay_per_turn_s=delay,
        decode_errors=errors,
    )


def _mode_summary(mode: str, records: list[TurnRecord], base: list[TurnRecord]) -> ModeSummary:
    ok = [r for r in records if r.ok]
    followups = [r for r in ok if r.turn > 1]
    ttft = _spread(followups, _ttft)
    latency = _spread(followups, _latency)
    usage = [r.decode_kv_usage for r in ok if r.decode_kv_usage is not None]
    return ModeSummary(
        mode=mode,
        turns=len(ok),
        errors=len(records) - len(ok),
        followups=len(followups),
        ttft_first_s=_spread([r for r in ok if r.turn == 1], _ttft),
        ttft_followup_s=ttft,
        latency_followup_s=latency,
        reused_fraction=_reused_fraction(followups),
        decode_kv_usage_mean=statistics.fmean(usage) if usage else None,
        decode_kv_usage_peak=max(usage) if usage else None,
        speedup=_ratio(_spread(_followups(base), _ttft), ttft),
        latency_speedup=_ratio(_spread(_followups(base), _latency), latency),
        paths=dict(Counter(r.kv_path for r in followups if r.kv_path is not None)),
        breakdown=_breakdown(followups),
        breakdown_by_path={
            path: _breakdown([r for r in followups if (r.kv_path or "-") == path])
            for path in sorted({r.kv_path or "-" for r in followups})
        },
    )


BREAKDOWN_STEPS = ("plan_s", "prefill_s", "decode_s", "end_wait_s")


def _breakdown(records: list[TurnRecord]) -> dict[str, float]:
    medians = {}
    for step in BREAKDOWN_STEPS:
        values = [v for r in records if (v := getattr(r, step)) is not None]
        if values:
            medians[step] = statistics.median(values)
    return medians


def _by_turn(records: list[TurnRecord]) -> Iterable[TurnPoint]:
    groups: dict[tuple[str, int, int], list[float]] = defaultdict(list)
    for r in records:
        if r.ok:
            groups[(r.mode, r.history_tokens, r.turn)].append(_ttft(r))
    for (mode, history, turn), values in groups.items():
        yield TurnPoint(mode, history, turn, statistics.median(values))


def _by_history(
    per_mode: dict[str, list[TurnRecord]], base: list[TurnRecord], decodes: list[DecodeRecord]
) -> Iterable[HistoryPoint]:
    for mode, records in per_mode.items():
        for history in sorted({r.history_tokens for r in records}):
            ttft = _spread(_followups(r for r in records if r.history_tokens == history), _ttft)
            if ttft is None:
                continue
            base_ttft = _spread(_followups(r for r in base if r.history_tokens == history), _ttft)
            tpot = _tpot(decodes, mode, history)
            yield HistoryPoint(mode, history, ttft, _ratio(base_ttft, ttft), tpot)


def _followups(records: Iterable[TurnRecord]) -> list[TurnRecord]:
    return [r for r in records if r.ok and r.turn > 1]


def _spread(records: list[TurnRecord], value: Callable[[TurnRecord], float]) -> Spread | None:
    by_repeat: dict[int, list[float]] = defaultdict(list)
    for r in records:
        by_repeat[r.repeat].append(value(r))
    return Spread.of([statistics.median(v) for _, v in sorted(by_repeat.items())])


def _ratio(base: Spread | None, other: Spread | None) -> float | None:
    if base is None or other is None or other.median <= 0:
        return None
    return base.median / other.median


def _reused_fraction(records: list[TurnRecord]) -> float | None:
    counted = [r for r in records if r.prompt_tokens and r.reused_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in counted)
    return sum(r.reused_tokens or 0 for r in counted) / prompt if prompt else None


def _ttft(record: TurnRecord) -> float:
    return record.ttft_s or 0.0


def _latency(record: TurnRecord) -> float:
    return record.latency_s or 0.0
