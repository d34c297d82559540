from __future__ import annotations

import json
from pathlib import Path

from agentkv_server.bench.records import BenchResult, TurnRecord
from agentkv_server.bench.report import (
    JSON_NAME,
    MARKDOWN_NAME,
    SPEEDUP_PLOT,
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
