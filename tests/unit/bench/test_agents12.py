"""Issue 48's twelve agent sessions: their plans, and the report's figures per mode and kind."""

from __future__ import annotations

import json
from pathlib import Path

from agentkv_server.bench.agents12 import KINDS, AgentSessions
from agentkv_server.bench.agents12_report import (
    is_agents,
    summarize_agents,
    write_agents_report,
)
from agentkv_server.bench.records import Attempt, RunWindow, SweepResult, TenantTurn, TurnRecord
from agentkv_server.bench.report import JSON_NAME, MARKDOWN_NAME
from agentkv_server.bench.workload import PRESETS


def test_twelve_sessions_three_seconds_apart_four_of_each_kind() -> None:
    sessions = AgentSessions().planned()
    assert [s.plan.start_s for s in sessions] == [3.0 * i for i in range(12)]
    assert [s.label for s in sessions] == list(KINDS) * 4
    for s in sessions:
        assert s.plan.turns == 5 and s.plan.history_tokens == 2700
        gap = 16.0 if s.label == "slow" else 2.0
        assert s.plan.gaps_s == (gap,) * 4
        assert s.plan.ends is (s.label != "idle")  # idle sessions never announce their end
    assert len({s.key for s in sessions}) == 12


def test_the_preset_is_the_issues_run_on_agentkv_serves_engines() -> None:
    preset = PRESETS["agents12"]
    assert preset.measures == "agents12" and preset.modes == ("agentkv",)
    assert preset.model == "smollm2" and preset.kv_cache_gib == 1
    assert preset.decode_kv_tokens is None and preset.prefill_prefix_cache
    assert (preset.workload.new_tokens, preset.workload.output_tokens) == (100, 16)
    assert "4 sessions" in AgentSessions().describe()


def record(session: int, number: int, *, ttft: float | None, path: str | None) -> TenantTurn:
    turn = TurnRecord(
        "agentkv", 0, 2700, session, number, 2.0, ttft_s=ttft, latency_s=ttft and ttft + 1,
        prompt_tokens=3000, kv_path=path, error=None if ttft else "timed out",
    )  # fmt: skip
    tries = (Attempt(None, 600.0, error="ReadTimeout"),) * 3 if ttft is None else ()
    return TenantTurn(turn, KINDS[session % 3], tries)


def test_rows_per_mode_and_kind(tmp_path: Path) -> None:
    turns = [
        record(0, 1, ttft=2.0, path="recompute"),
        record(0, 2, ttft=0.2, path="local"),
        record(1, 1, ttft=2.5, path="recompute"),
        record(1, 2, ttft=1.5, path="recompute"),
        record(2, 1, ttft=2.0, path="recompute"),
        record(2, 2, ttft=None, path=None),
    ]
    window = RunWindow("agentkv", 0, "agents12", 3, 60.0, marked_down=1.0)
    result = SweepResult({"model": "m", "measures": "agents12"}, tuple(turns), (window,))
    everything, fast, slow, idle = summarize_agents(result)
    assert (everything.kind, everything.figures.turns, everything.figures.failed) == (None, 6, 1)
    assert everything.figures.retried == 1 and everything.marked_down == 1.0
    assert (everything.figures.reused, everything.figures.followups) == (1, 2)
    assert (everything.figures.followup_p50_s, everything.figures.followup_p99_s) == (0.2, 1.5)
    assert everything.figures.e2e_max_s == 3.5
    assert (fast.figures.reuse_share, slow.figures.reuse_share) == (1.0, 0.0)
    assert idle.figures.failed == 1 and idle.figures.followups == 0
    write_agents_report(result, tmp_path)
    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert is_agents(data) and [r["kind"] for r in data["rows"]] == [None, *KINDS]
    markdown = (tmp_path / MARKDOWN_NAME).read_text()
    assert "| agentkv | all | 6 | 1 | 0 | 1 | 0.200 / 1.500 | 50% (1/2) |" in markdown
    assert markdown.rstrip().endswith("| - |")  # engines are counted per mode, not per kind
