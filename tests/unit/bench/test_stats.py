from __future__ import annotations

import statistics
from collections.abc import Callable

import pytest

from agentkv_server.bench.records import TurnRecord
from agentkv_server.bench.stats import Spread, summarize


def test_spread_is_over_per_repeat_values() -> None:
    assert Spread.of([3.0, 1.0, 2.0]) == Spread(2.0, 1.0, 3.0, 3)
    assert Spread.of([]) is None


def test_mode_summary_medians_spread_and_speedup(records: list[TurnRecord]) -> None:
    summary = summarize(records)
    agentkv, recompute = summary.mode("agentkv"), summary.mode("recompute")
    assert agentkv is not None and recompute is not None
    # recompute follow-ups, repeat 0: [1,1,4,4] -> 2.5; repeat 1: x1.5 -> 3.75
    assert recompute.ttft_followup_s == Spread(3.125, 2.5, 3.75, 2)
    assert agentkv.ttft_followup_s is not None
    assert agentkv.ttft_followup_s.median == pytest.approx(3.125 / 4)
    assert agentkv.speedup == pytest.approx(4.0)
    assert recompute.speedup == pytest.approx(1.0)
    assert agentkv.latency_speedup == pytest.approx(4.0)
    assert agentkv.ttft_first_s == recompute.ttft_first_s


def test_errors_counted_apart_from_turns(records: list[TurnRecord]) -> None:
    agentkv = summarize(records).mode("agentkv")
    assert agentkv is not None
    assert (agentkv.turns, agentkv.errors) == (12, 1)


def test_reused_fraction_and_kv_usage(records: list[TurnRecord]) -> None:
    agentkv = summarize(records).mode("agentkv")
    assert agentkv is not None
    assert agentkv.reused_fraction == pytest.approx(0.9)
    assert agentkv.decode_kv_usage_peak == pytest.approx(0.3)
    assert agentkv.decode_kv_usage_mean == pytest.approx(0.2)
    recompute = summarize(records).mode("recompute")
    assert recompute is not None and recompute.decode_kv_usage_peak is None


def test_by_turn_and_by_history(records: list[TurnRecord]) -> None:
    summary = summarize(records)
    point = next(
        p for p in summary.by_turn if (p.mode, p.history_tokens, p.turn) == ("agentkv", 4000, 2)
    )
    assert point.ttft_s == pytest.approx(statistics.median([1.0, 1.5]))
    speedups = {(p.mode, p.history_tokens): p.speedup for p in summary.by_history}
    assert speedups[("agentkv", 1000)] == pytest.approx(4.0)
    assert speedups[("agentkv", 4000)] == pytest.approx(4.0)


def test_no_baseline_means_no_ratios(make_turn: Callable[..., TurnRecord]) -> None:
    summary = summarize([make_turn("agentkv", 1, 1.0), make_turn("agentkv", 2, 0.5)])
    agentkv = summary.mode("agentkv")
    assert agentkv is not None and agentkv.speedup is None
    assert all(p.speedup is None for p in summary.by_history)
