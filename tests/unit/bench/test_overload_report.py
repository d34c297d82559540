"""The overload report's rows and issue 48's bars, from synthetic turns (bench/overload_report.py)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from agentkv_server.bench import cli
from agentkv_server.bench.capacity import Capacity
from agentkv_server.bench.overload import BURST, STEADY, OverloadWorkload
from agentkv_server.bench.overload_report import (
    OVERLOAD_PLOT,
    check_bars,
    is_overload,
    merge_sweeps,
    summarize_overload,
    write_overload_report,
)
from agentkv_server.bench.records import (
    REFUSAL_CODE,
    Attempt,
    RunWindow,
    SweepResult,
    TenantTurn,
    TurnRecord,
)
from agentkv_server.bench.report import JSON_NAME, MARKDOWN_NAME
from agentkv_server.errors import ConfigError

WORKLOAD = OverloadWorkload()  # a 140 s offered window, a 30 s objective
SERVED = Attempt(200, 0.01, queue_s=1.0, queue_priority="new")
REFUSED = Attempt(503, 0.02, REFUSAL_CODE, retry_after_s=3.0, should_retry=True)


def turn(
    mode: str, load: float, label: str, number: int, ttft: float | None, *,
    sent: float = 10.0, session: int = 0, tries: tuple[Attempt, ...] = (SERVED,),
) -> TenantTurn:  # fmt: skip
    record = TurnRecord(
        mode, 0, 1000, session, number, 0.0, ttft_s=ttft, latency_s=None if ttft is None else ttft,
        prompt_tokens=1100, reused_tokens=1000 if number > 1 else 0,
        kv_path=None if mode == "aggregated" else ("local" if number > 1 else "recompute"),
        sent_s=sent, error=None if ttft is not None else "no answer",
    )  # fmt: skip
    return TenantTurn(record, label, tries, None if label == STEADY else 0, load)


def run(mode: str, load: float, *, steady: float, followup: float, good: int,
        refused: int = 0, failed: int = 0, down: float | None = 0.0) -> list[TenantTurn]:  # fmt: skip
    """A run: the steady tenant's follow-ups, ``good`` burst turns within the objective, the
    burst's follow-ups, turns refused on every try and accepted turns that failed."""
    turns = [turn(mode, load, STEADY, n, steady) for n in (2, 3)]
    turns += [turn(mode, load, BURST, 1, 2.0, session=i) for i in range(good)]
    turns += [turn(mode, load, BURST, 2, followup, session=i) for i in range(good)]
    turns += [turn(mode, load, BURST, 1, None, tries=(REFUSED,) * 3) for _ in range(refused)]
    turns += [turn(mode, load, BURST, 1, None, tries=(SERVED,)) for _ in range(failed)]
    WINDOWS.append(RunWindow(mode, 0, f"x{load:g}", 5, 150.0, load=load, burst_size=4,
                             offered_tokens_per_s=load * 300 + 60, refused=refused * 3.0,
                             queued=2.0, marked_down=down))  # fmt: skip
    return turns


WINDOWS: list[RunWindow] = []


@pytest.fixture
def result() -> SweepResult:
    WINDOWS.clear()
    turns = [
        *run("agentkv", 0.0, steady=0.5, followup=0.5, good=0),
        *run("agentkv", 1.0, steady=0.6, followup=0.5, good=10),
        *run("agentkv", 2.0, steady=0.7, followup=1.0, good=10, refused=8),
        *run("agentkv", 4.0, steady=0.7, followup=1.1, good=10, refused=30),
        *run("aggregated", 0.0, steady=0.5, followup=0.5, good=0, down=None),
        *run("aggregated", 1.0, steady=0.6, followup=0.5, good=10, down=None),
        *run("aggregated", 2.0, steady=9.0, followup=9.0, good=6, failed=2, down=None),
        *run("aggregated", 4.0, steady=20.0, followup=40.0, good=2, failed=9, down=None),
    ]
    config = {"overload": json.loads(json.dumps(asdict(WORKLOAD))), "model": "m",
              "capacity": Capacity(300.0, "measured").to_dict(), "measures": "overload"}  # fmt: skip
    return SweepResult(config, tuple(turns), tuple(WINDOWS))


def test_rows_count_what_each_run_offered_served_refused_and_failed(result: SweepResult) -> None:
    rows = {(r.mode, r.load): r for r in summarize_overload(result)}
    assert list(rows)[:4] == [
        ("agentkv", 0.0),
        ("agentkv", 1.0),
        ("agentkv", 2.0),
        ("agentkv", 4.0),
    ]
    base, over = rows[("agentkv", 1.0)], rows[("agentkv", 4.0)]
    assert base.offered == pytest.approx(1.2)  # 360 tokens/s offered on 300
    # 2 steady follow-ups, 10 first turns and 10 follow-ups, all within the objective
    assert base.good == 22 and base.goodput_per_s == pytest.approx(22 / WORKLOAD.window_s)
    assert (over.figures.refused, over.refusals, over.slow_refusals) == (30, 90, 0)
    assert (over.refusal_p50_s, over.refusals_without_retry_after) == (0.02, 0)
    assert over.figures.failed == 0 and over.marked_down == 0 and over.router_refused == 90
    assert (base.cold_ttft_p50_s, base.cold_queue_p99_s) == (2.0, 1.0)
    assert base.steady_followup_p99_s == 0.6 and base.figures.followup_p99_s == 0.6
    assert base.figures.reuse_share == 1.0  # the router's local path
    late = rows[("aggregated", 4.0)]
    assert late.figures.failed == 9 and late.marked_down is None
    assert late.good == 2 + 2  # its steady follow-ups (20 s) and two first turns in time


def test_turns_past_the_objective_or_the_window_are_no_goodput(result: SweepResult) -> None:
    slow = turn("agentkv", 1.0, BURST, 1, 31.0)
    after = turn("agentkv", 1.0, BURST, 1, 1.0, sent=WORKLOAD.window_s - 0.5)
    more = SweepResult(result.config, (*result.turns, slow, after), result.windows)
    row = next(r for r in summarize_overload(more) if (r.mode, r.load) == ("agentkv", 1.0))
    assert row.good == 22 and row.figures.served == 24


def test_each_bar_passes_fails_or_says_it_was_not_measured(result: SweepResult) -> None:
    checks = {(c.mode, c.bar.split(" at ")[0]): c for c in check_bars(summarize_overload(result))}
    assert all(c.passed for (mode, _), c in checks.items() if mode == "agentkv"), checks
    verdicts = {bar: c.passed for (mode, bar), c in checks.items() if mode == "aggregated"}
    assert verdicts == {
        "0 accepted turns fail": False,
        "0 engines marked down": None,  # no router to count them
        "every refusal within 1 s, with Retry-After": True,  # none
        "follow-up TTFT p99": False,
        "goodput": False,
        "steady tenant's follow-up p99": False,
    }
    goodput = checks[("agentkv", "goodput")]
    assert goodput.detail.endswith("= 1.00x")


def test_a_late_refusal_or_one_without_retry_after_fails_its_bar(result: SweepResult) -> None:
    late = Attempt(503, 1.5, REFUSAL_CODE, retry_after_s=1.0)
    bare = Attempt(503, 0.01, REFUSAL_CODE)
    extra = [turn("agentkv", 2.0, BURST, 1, None, tries=(late, bare))]
    rows = summarize_overload(SweepResult(result.config, (*result.turns, *extra), result.windows))
    (check,) = [c for c in check_bars(rows) if c.mode == "agentkv" and "refusal" in c.bar]
    assert check.passed is False and "1 late, 1 without Retry-After" in check.detail


def test_bars_of_loads_not_run_are_not_measured(result: SweepResult) -> None:
    alone = [t for t in result.turns if t.load == 2.0]
    rows = summarize_overload(SweepResult(result.config, tuple(alone), result.windows[2:3]))
    assert {c.passed for c in check_bars(rows)} == {None}


def test_the_report_is_written_and_rendered_again_from_its_json(
    result: SweepResult, tmp_path: Path
) -> None:
    written = write_overload_report(result, tmp_path / "run")
    assert {p.name for p in written} == {JSON_NAME, MARKDOWN_NAME, OVERLOAD_PLOT}
    data = json.loads((tmp_path / "run" / JSON_NAME).read_text())
    assert is_overload(data) and len(data["rows"]) == 8 and len(data["checks"]) == 12
    markdown = (tmp_path / "run" / MARKDOWN_NAME).read_text()
    assert "Capacity: 300 prompt tokens/s (measured)" in markdown
    assert "| 4x | aggregated | 4.20x |" in markdown and "**fail**" in markdown
    write_overload_report(SweepResult.from_dict(data), tmp_path / "again")
    assert (tmp_path / "again" / MARKDOWN_NAME).read_text() == markdown


def test_runs_asked_for_apart_are_reported_together(result: SweepResult, tmp_path: Path) -> None:
    """One mode and load at a time, each on the first run's --capacity: one report."""
    parts = []
    for mode, load in dict.fromkeys((w.mode, w.load) for w in result.windows):
        config = {**result.config, "modes": [mode]}
        config["overload"] = {**config["overload"], "loads": [load]}
        turns = tuple(t for t in result.turns if (t.turn.mode, t.load) == (mode, load))
        windows = tuple(w for w in result.windows if (w.mode, w.load) == (mode, load))
        parts.append(SweepResult(config, turns, windows))
    merged = merge_sweeps(parts)
    assert merged.config["modes"] == ["agentkv", "aggregated"]
    assert merged.config["overload"]["loads"] == [0.0, 1.0, 2.0, 4.0]
    assert summarize_overload(merged) == summarize_overload(result)
    paths = []
    for index, part in enumerate(parts):
        write_overload_report(part, tmp_path / str(index))
        paths.append(str(tmp_path / str(index) / JSON_NAME))
    parser = argparse.ArgumentParser()
    cli.configure(parser)
    assert cli.run(parser.parse_args(["--from-json", *paths, "--out", str(tmp_path / "all")])) == 1
    assert "| 4x | aggregated | 4.20x |" in (tmp_path / "all" / MARKDOWN_NAME).read_text()


def test_runs_on_different_capacities_do_not_go_together(result: SweepResult) -> None:
    other = {**result.config, "capacity": Capacity(250.0, "measured").to_dict()}
    with pytest.raises(ConfigError, match="--capacity"):
        merge_sweeps([result, SweepResult(other, result.turns, result.windows)])
    shorter = {**result.config, "overload": {**result.config["overload"], "bursts": 2}}
    with pytest.raises(ConfigError, match="apart from --loads"):
        merge_sweeps([result, SweepResult(shorter, result.turns, result.windows)])
