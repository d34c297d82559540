from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import replace

import pytest

from agentkv_server.bench.records import DecodeRecord, TurnRecord
from agentkv_server.bench.stats import Spread, Tpot, percentile, summarize


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


def test_percentile_is_a_measured_value_by_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile(values, 100) == 100.0
    assert percentile([0.2, 0.1], 50) == 0.1
    assert percentile([7.0], 99) == 7.0


def decoding(
    mode: str, gaps: list[float], *, history: int = 1000, error: str | None = None
) -> DecodeRecord:
    return DecodeRecord(mode, 0, history, 0, 0, ttft_s=0.1, gaps_s=tuple(gaps), error=error)


def test_tpot_pools_decoding_gaps_per_mode_against_the_baseline(
    records: list[TurnRecord],
) -> None:
    # 99 steady gaps and one stall per mode: agentkv's stall is 4x recompute's.
    decodes = [
        decoding("recompute", [0.02] * 99 + [0.1]),
        decoding("agentkv", [0.02] * 49, history=1000),
        decoding("agentkv", [0.02] * 50 + [0.4], history=4000),
        decoding("agentkv", [], error="ReadTimeout"),
    ]
    summary = summarize(records, decodes=decodes)
    agentkv, recompute = summary.mode("agentkv"), summary.mode("recompute")
    assert agentkv is not None and recompute is not None
    assert recompute.tpot == Tpot(0.02, 0.02, 0.1, 100)
    assert agentkv.tpot is not None and agentkv.tpot.max == 0.4 and agentkv.tpot.gaps == 100
    assert (agentkv.decode_errors, recompute.decode_errors) == (1, 0)
    # A p99 over 100 gaps is the 99th: the stall only moves it when it is 2 of 100.
    assert agentkv.tpot_p99_ratio == pytest.approx(1.0)
    by_history = {(p.mode, p.history_tokens): p.tpot for p in summary.by_history}
    assert by_history[("agentkv", 4000)] == Tpot(0.02, 0.4, 0.4, 51)
    assert by_history[("agentkv", 1000)] == Tpot(0.02, 0.02, 0.02, 49)


def test_stalls_beyond_one_percent_raise_p99() -> None:
    decodes = [decoding("recompute", [0.02] * 100), decoding("agentkv", [0.02] * 97 + [0.3] * 3)]
    summary = summarize([], decodes=decodes)
    assert summary.modes == ()  # modes come from the turns: no turn, nothing to compare
    tpot = Tpot.of(decodes[1].gaps_s)
    assert tpot is not None and tpot.p99 == 0.3 and tpot.p50 == 0.02


def test_delay_per_turn_does_not_depend_on_the_runs_length(records: list[TurnRecord]) -> None:
    """The same three 0.2 s stalls among 3x fewer gaps (a mode whose sessions finish sooner)
    make a 10x p99, but the same delay per turn. Found on the cpu preset with a decoder."""
    decodes = [
        decoding("recompute", [0.02] * 297 + [0.2] * 3),
        decoding("agentkv", [0.02] * 97 + [0.2] * 3),
    ]
    summary = summarize(records, decodes=decodes)
    agentkv, recompute = summary.mode("agentkv"), summary.mode("recompute")
    assert agentkv is not None and recompute is not None
    assert agentkv.tpot_p99_ratio == pytest.approx(10.0)
    stalled = 3 * (0.2 - 0.02)
    assert recompute.tpot_delay_per_turn_s == pytest.approx(stalled / recompute.turns)
    assert agentkv.tpot_delay_per_turn_s == pytest.approx(stalled / agentkv.turns)


def test_no_decoding_sessions_means_no_tpot(records: list[TurnRecord]) -> None:
    summary = summarize(records)
    assert all(m.tpot is None and m.tpot_p99_ratio is None for m in summary.modes)
    assert all(p.tpot is None for p in summary.by_history)


def test_breakdown_per_kv_path(make_turn: Callable[..., TurnRecord]) -> None:
    local = replace(make_turn("agentkv", 2, 0.2), kv_path="local", plan_s=0.001, decode_s=0.2)
    pulled = replace(
        make_turn("agentkv", 3, 1.0), kv_path="reuse", plan_s=0.003, prefill_s=0.5, decode_s=0.4
    )
    plain = replace(make_turn("aggregated", 2, 0.1), end_wait_s=0.001)
    summary = summarize([make_turn("agentkv", 1, 2.0), local, pulled, plain])
    agentkv, aggregated = summary.mode("agentkv"), summary.mode("aggregated")
    assert agentkv is not None and aggregated is not None
    assert agentkv.breakdown_by_path == {
        "local": {"plan_s": 0.001, "decode_s": 0.2},
        "reuse": {"plan_s": 0.003, "prefill_s": 0.5, "decode_s": 0.4},
    }
    assert agentkv.paths == {"local": 1, "reuse": 1}
    assert aggregated.breakdown_by_path == {"-": {"end_wait_s": 0.001}}
