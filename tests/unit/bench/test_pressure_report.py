"""The pressure report's rows from turn records (bench/pressure_report.py)."""

from __future__ import annotations

from agentkv_server.bench.pressure_report import render_pressure_markdown, summarize_pressure
from agentkv_server.bench.records import BenchResult, TurnRecord


def followup(session: int, reason: str, reused: int) -> TurnRecord:
    return TurnRecord(
        mode="agentkv", repeat=1, history_tokens=1000, session=session, turn=2,
        tool_latency_s=1.0, ttft_s=0.5, prompt_tokens=1000, reused_tokens=reused,
        kv_path="recompute" if reused == 0 else "local", kv_reason=reason, pressure_sessions=3,
    )  # fmt: skip


def test_follow_ups_loaded_back_from_the_host_tier_count_as_reused_and_are_named():
    result = BenchResult(
        config={},
        records=(
            followup(0, "local_fastest", 900),
            followup(1, "host_tier", 990),
            followup(2, "released_live_turn", 0),
        ),
    )
    (row,) = summarize_pressure(result)
    assert (row.reused, row.from_host_tier, row.followups) == (2, 1, 3)
    assert row.missed == {"released_live_turn": 1}
    assert "67% (2/3, 1 from the host tier)" in render_pressure_markdown(result, [row])
