"""``agentkv bench --quick`` end to end on real CPU engines: every mode runs, every output is
written. A smoke test: it asserts what was measured and written, never how fast."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentkv_server.bench.modes import MODES
from agentkv_server.bench.records import BenchResult
from agentkv_server.bench.report import JSON_NAME, MARKDOWN_NAME, SPEEDUP_PLOT, TTFT_PLOT
from agentkv_server.bench.workload import PRESETS

pytestmark = pytest.mark.engine


def test_quick_bench_runs_every_mode_end_to_end(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "agentkv_server.cli",
        "bench",
        "--quick",
        "--out",
        str(tmp_path),
    ]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=600)
    logs = "\n".join(f"{p.name}:\n{p.read_text()[-3000:]}" for p in tmp_path.glob("*.log"))
    assert done.returncode == 0, f"{done.stderr[-3000:]}\n{logs}"

    assert {JSON_NAME, MARKDOWN_NAME, TTFT_PLOT, SPEEDUP_PLOT} <= {
        p.name for p in tmp_path.iterdir()
    }
    result = BenchResult.from_dict(json.loads((tmp_path / JSON_NAME).read_text()))
    workload = PRESETS["quick"].workload
    per_run = workload.sessions * workload.turns * len(workload.history_tokens)
    for mode in MODES:
        records = [r for r in result.records if r.mode == mode]
        assert len(records) == per_run and all(r.ok for r in records), mode
        # real engines report prompt sizes; each turn's prompt extends the previous one
        for session in {(r.history_tokens, r.session) for r in records}:
            sizes = [r.prompt_tokens for r in sorted(records, key=lambda r: r.turn)
                     if (r.history_tokens, r.session) == session]  # fmt: skip
            assert all(s is not None for s in sizes) and sizes == sorted(sizes), (mode, sizes)
        assert all(r.decode_kv_usage is not None for r in records), mode
    routed = [r for r in result.records if r.mode != "aggregated"]
    assert all(r.kv_path in {"local", "reuse", "recompute", "fallback"} for r in routed)
    summary = (tmp_path / MARKDOWN_NAME).read_text()
    assert all(f"| {mode} |" in summary for mode in MODES)
