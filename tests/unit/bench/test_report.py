from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from agentkv_server.bench.records import BenchResult, DecodeRecord, TurnRecord
from agentkv_server.bench.report import (
    JSON_NAME,
    MARKDOWN_NAME,
    SPEEDUP_PLOT,
    TRADE_PLOT,
    TTFT_PLOT,
    render_markdown,
    write_report,
)
from agentkv_server.bench.stats import summarize

CONFIG = {"command": "agentkv bench --quick", "model": "agentkv-tiny", "repeats": 2}


def test_writes_json_plots_and_markdown(tmp_path: Path, records: list[TurnRecord]) -> None:
    paths = write_report(BenchResult(CONFIG, tuple(records)), tmp_path / "out")
    assert {p.name for p in paths} == {JSON_NAME, TTFT_PLOT, SPEEDUP_PLOT, MARKDOWN_NAME}
    for plot in (TTFT_PLOT, SPEEDUP_PLOT):
        assert (tmp_path / "out" / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_json_round_trips_the_records(tmp_path: Path, records: list[TurnRecord]) -> None:
    write_report(BenchResult(CONFIG, tuple(records)), tmp_path)
    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert BenchResult.from_dict(data) == BenchResult(CONFIG, tuple(records))
    modes = {m["mode"]: m for m in data["summary"]["modes"]}
    assert modes["agentkv"]["speedup"] == 4.0
    assert data["records"][0]["recomputed_tokens"] == 1000


def test_markdown_names_every_mode_with_its_ratio(records: list[TurnRecord]) -> None:
    text = render_markdown(BenchResult(CONFIG, tuple(records)), summarize(records))
    assert "`agentkv bench --quick`" in text
    agentkv_row = next(line for line in text.splitlines() if line.startswith("| agentkv |"))
    assert "4.00x" in agentkv_row and "| 12 | 1 |" in agentkv_row
    assert "| 4000 |" in text  # the per-history table


def test_report_of_failed_run_still_renders(tmp_path: Path) -> None:
    failed = TurnRecord("agentkv", 0, 100, 0, 1, 0.0, error="connection refused")
    paths = write_report(BenchResult(CONFIG, (failed,)), tmp_path)
    assert "n/a" in (tmp_path / MARKDOWN_NAME).read_text()
    assert len(paths) == 4


def with_decoding(records: list[TurnRecord]) -> BenchResult:
    decodes = (
        DecodeRecord("recompute", 0, 1000, 0, 0, ttft_s=0.2, gaps_s=(0.02,) * 99 + (0.05,)),
        DecodeRecord("agentkv", 0, 1000, 0, 0, ttft_s=0.2, gaps_s=(0.02,) * 98 + (0.3, 0.3)),
        DecodeRecord("agentkv", 0, 4000, 0, 0, ttft_s=0.2, gaps_s=(0.03,) * 10, complete=True),
    )
    return BenchResult(CONFIG, tuple(records), decodes)


def test_decoding_sessions_add_the_trade_table_and_plot(
    tmp_path: Path, records: list[TurnRecord]
) -> None:
    result = with_decoding(records)
    paths = write_report(result, tmp_path)
    assert TRADE_PLOT in {p.name for p in paths}
    assert (tmp_path / TRADE_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / MARKDOWN_NAME).read_text()
    trade = text[text.index("TPOT p50 (ms)") :]
    agentkv_row = next(line for line in trade.splitlines() if line.startswith("| agentkv |"))
    # 110 gaps: p50 20 ms, p99 the 109th = 300 ms, max 300 ms; p99 over recompute's 20 ms.
    assert "| 20 | 300 | 300 | 15.00x | 0.0" in agentkv_row and "| 110 | 0 |" in agentkv_row
    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert BenchResult.from_dict(data) == result
    modes = {m["mode"]: m for m in data["summary"]["modes"]}
    assert modes["agentkv"]["tpot"]["p99"] == 0.3
    # Delay per turn: 2 x 280 ms + 10 x 10 ms over the gaps' median, over 12 answered turns.
    assert modes["agentkv"]["tpot_delay_per_turn_s"] == pytest.approx(0.66 / 12)


def test_without_decoding_sessions_no_trade_table(
    tmp_path: Path, records: list[TurnRecord]
) -> None:
    paths = write_report(BenchResult(CONFIG, tuple(records)), tmp_path)
    assert TRADE_PLOT not in {p.name for p in paths}
    assert "TPOT" not in (tmp_path / MARKDOWN_NAME).read_text()


def test_breakdown_table_has_a_row_per_path(make_turn: Callable[..., TurnRecord]) -> None:
    turns = [
        make_turn("agentkv", 1, 2.0),
        replace(make_turn("agentkv", 2, 0.2), kv_path="local", plan_s=0.001, decode_s=0.25),
        replace(make_turn("agentkv", 3, 0.9), kv_path="reuse", prefill_s=0.5, decode_s=0.3),
    ]
    text = render_markdown(BenchResult(CONFIG, tuple(turns)), summarize(turns))
    assert "| agentkv | local | 1 | 0.001 | n/a | 0.250 | n/a |" in text
    assert "| agentkv | reuse | 1 | n/a | 0.500 | 0.300 | n/a |" in text
