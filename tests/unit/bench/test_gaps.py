"""Slow decoder gaps put beside the agent turns' steps they overlapped (bench/gaps.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agentkv_server.bench.gaps import gap_causes
from agentkv_server.bench.records import BenchResult, DecodeRecord, TurnRecord
from agentkv_server.bench.report import render_markdown
from agentkv_server.bench.stats import summarize


def _turn(turn: int, path: str, sent: float, **steps: float) -> TurnRecord:
    ttft = steps.pop("ttft")
    return TurnRecord(
        "agentkv",
        0,
        1000,
        0,
        turn,
        0.0,
        ttft_s=ttft,
        kv_path=path,
        sent_s=sent,
        ended_s=sent + ttft + 1.0,
        **steps,
    )


# One decoder, sent at 0 s, first chunk at 1 s, then 100 ms gaps with three slow ones: at
# 2.0-2.5 s (a cold first turn on P, 1.05-3.95 s, then D 3.95-4.15 s and its answer to 5.15 s),
# 5.5-6.0 s (a local prefill, 5.05-6.15 s, then its answer to 7.15 s) and 9.0-9.6 s (beside no
# turn's step).
GAPS = (0.1,) * 10 + (0.5,) + (0.1,) * 30 + (0.5,) + (0.1,) * 30 + (0.6,) + (0.1,) * 5
TURNS = [
    _turn(1, "recompute", 1.05, plan_s=0.0, prefill_s=2.9, decode_s=0.2, ttft=3.1),
    _turn(2, "local", 4.95, plan_s=0.1, decode_s=1.1, ttft=1.2),
]
DECODER = DecodeRecord("agentkv", 0, 1000, 0, 0, ttft_s=1.0, gaps_s=GAPS, sent_s=0.0)


def test_each_slow_gap_is_put_beside_the_steps_it_overlapped() -> None:
    (causes,) = gap_causes(TURNS, [DECODER])
    assert causes.threshold_s == pytest.approx(0.2)  # twice the median gap
    assert (causes.slow, causes.slow_s) == (3, pytest.approx(1.6))
    assert causes.by_step == {
        "first turn on P": 1,
        "D after P": 0,
        "local prefill": 1,
        "answer on D": 0,
        "none": 1,
    }
    # Of 78 gaps: 26 beside the P step, 3 beside D's after it (one of them also beside P),
    # 8 beside the local prefill, 11 beside each answer (4 of them also beside a step before
    # the answer), and the other 24 beside none.
    assert causes.gaps_by_step == {
        "first turn on P": 26,
        "D after P": 3,
        "local prefill": 8,
        "answer on D": 22,
        "none": 24,
    }


def test_a_pull_counts_its_step_on_p_and_ds_first_byte_after_it() -> None:
    pull = _turn(2, "reuse", 1.55, plan_s=0.0, prefill_s=0.4, decode_s=0.4, ttft=0.8)
    (causes,) = gap_causes([pull], [DECODER])
    # The first slow gap (2.0-2.5 s) overlaps D's step after the pull's P step (1.95-2.35 s)
    # and the answer after it (to 3.35 s).
    assert causes.by_step == {"pull on P": 0, "D after P": 1, "answer on D": 1, "none": 2}


def test_a_gap_beside_two_answers_at_once_counts_under_both_answer_columns() -> None:
    # Two pulls whose answers (8.5-9.5 s and 8.7-9.7 s) both overlap the slow gap at 9.0-9.6 s.
    pulls = [
        _turn(2, "reuse", sent, plan_s=0.0, prefill_s=0.3, decode_s=0.2, ttft=0.5)
        for sent in (8.0, 8.2)
    ]
    (causes,) = gap_causes(pulls, [DECODER])
    assert causes.by_step["answer on D"] == causes.by_step["2+ answers on D"] == 1
    # Both answers run from 8.7 s: three 100 ms gaps, then the slow one.
    assert causes.gaps_by_step["2+ answers on D"] == 4


def test_decoders_recorded_without_a_send_time_are_left_out() -> None:
    assert gap_causes(TURNS, [replace(DECODER, sent_s=None)]) == []


def test_the_report_has_a_row_per_mode() -> None:
    result = BenchResult({}, tuple(TURNS), (DECODER,))
    text = render_markdown(result, summarize(list(TURNS)))
    assert (
        "| agentkv | 3 | 200 | 1.6 | 1 of 26 | 1 of 8 | 0 of 0 | 0 of 0 | 0 of 3 | 0 of 22 "
        "| 0 of 0 | 1 of 24 |" in text
    )
