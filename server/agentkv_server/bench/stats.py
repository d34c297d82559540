"""From turn records to the figures a reader compares: medians, spread, ratios to the baseline.

Repeats are the unit of spread: a figure is computed per repeat (its median over turns), and
the report gives the median of those per-repeat values with their min and max. Turn 1 is cold
in every mode (no history is held anywhere yet), so reuse is judged on the follow-up turns.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from agentkv_server.bench.records import TurnRecord

__all__ = [
    "BREAKDOWN_STEPS",
    "HistoryPoint",
    "ModeSummary",
    "Spread",
    "Summary",
    "TurnPoint",
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
class ModeSummary:
    """One mode's figures. ``speedup`` is the baseline's follow-up TTFT over this mode's."""

    mode: str
    turns: int
    errors: int
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


@dataclass(frozen=True)
class Summary:
    baseline: str
    modes: tuple[ModeSummary, ...]
    by_turn: tuple[TurnPoint, ...]
    by_history: tuple[HistoryPoint, ...]

    def mode(self, name: str) -> ModeSummary | None:
        return next((m for m in self.modes if m.mode == name), None)


def summarize(records: Iterable[TurnRecord], baseline: str = "recompute") -> Summary:
    """Every figure of the report, from the records of all modes, histories and repeats."""
    records = list(records)
    modes = list(dict.fromkeys(r.mode for r in records))
    per_mode = {mode: [r for r in records if r.mode == mode] for mode in modes}
    base = per_mode.get(baseline, [])
    return Summary(
        baseline=baseline,
        modes=tuple(_mode_summary(mode, per_mode[mode], base) for mode in modes),
        by_turn=tuple(_by_turn(records)),
        by_history=tuple(_by_history(per_mode, base)),
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
    per_mode: dict[str, list[TurnRecord]], base: list[TurnRecord]
) -> Iterable[HistoryPoint]:
    for mode, records in per_mode.items():
        for history in sorted({r.history_tokens for r in records}):
            ttft = _spread(_followups(r for r in records if r.history_tokens == history), _ttft)
            if ttft is None:
                continue
            base_ttft = _spread(_followups(r for r in base if r.history_tokens == history), _ttft)
            yield HistoryPoint(mode, history, ttft, _ratio(base_ttft, ttft))


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
