"""The path sweep's pure parts: KV bytes per token, engine counters, this process's use, how
costs grow, and the report (the sweep itself runs against stubs in test_cli.py)."""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from agentkv_server.bench.paths import (
    BYTES_METRIC,
    COST_PLOT,
    LOADED_METRIC,
    TTFT_METRIC,
    PathSweep,
    PathTurn,
    ProcessMeter,
    growth,
    is_path_sweep,
    kv_bytes_per_token,
    loglog_slope,
    model_kv_bytes_per_token,
    parse_engine_counters,
    render_path_markdown,
    router_log,
    write_path_report,
)
from agentkv_server.bench.report import JSON_NAME, MARKDOWN_NAME
from agentkv_server.bench.transfers import TRANSFER_METRIC
from agentkv_server.bundle.model import PRESETS as MODEL_PRESETS

TINY_LONG_CONFIG = {
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "hidden_size": 256,
    "dtype": "float32",
}


def test_kv_bytes_per_token_of_tiny_long_matches_its_preset() -> None:
    assert kv_bytes_per_token(TINY_LONG_CONFIG) == 8192
    assert kv_bytes_per_token(TINY_LONG_CONFIG) == MODEL_PRESETS["tiny-long"].kv_bytes_per_token()


def test_kv_bytes_per_token_counts_kv_heads_head_dim_and_dtype() -> None:
    # SmolLM2-135M's shape: grouped-query attention, an explicit head_dim, bf16.
    config = {
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_size": 576,
        "head_dim": 64,
        "torch_dtype": "bfloat16",
    }
    assert kv_bytes_per_token(config) == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(config, "float32") == 2 * 30 * 3 * 64 * 4


def test_model_kv_bytes_per_token_reads_the_model_directory(tmp_path: Path) -> None:
    assert model_kv_bytes_per_token(tmp_path) is None  # no config.json
    (tmp_path / "config.json").write_text(json.dumps(TINY_LONG_CONFIG))
    assert model_kv_bytes_per_token(tmp_path) == 8192
    assert model_kv_bytes_per_token(None) is None


def engine_metrics(*, loaded: float, reads: list[tuple[float, int]], ttfts: list[float]) -> str:
    """An engine's /metrics: tokens loaded from another engine, NIXL reads (seconds, bytes),
    first-token delays, over two engine labels as vLLM's data-parallel engines export them."""
    registry = CollectorRegistry()
    hits = Counter(LOADED_METRIC, "hits", ["engine"], registry=registry)
    hits.labels("0").inc(loaded / 2)
    hits.labels("1").inc(loaded / 2)
    xfer = Histogram(TRANSFER_METRIC, "xfer", ["engine"], registry=registry)
    moved = Histogram(BYTES_METRIC, "bytes", ["engine"], registry=registry)
    for seconds, size in reads:
        xfer.labels("0").observe(seconds)
        moved.labels("0").observe(size)
    ttft = Histogram(TTFT_METRIC, "ttft", ["engine"], registry=registry)
    for seconds in ttfts:
        ttft.labels("1").observe(seconds)
    return generate_latest(registry).decode()


def test_engine_counters_subtract_to_one_turn() -> None:
    before = parse_engine_counters(engine_metrics(loaded=100, reads=[(0.1, 800)], ttfts=[1.0]))
    after = parse_engine_counters(
        engine_metrics(loaded=32100, reads=[(0.1, 800), (0.5, 262_144_000)], ttfts=[1.0, 3.0])
    )
    turn = after - before
    assert turn.loaded_tokens == 32000  # both engine labels summed
    assert turn.transfers.reads == 1 and turn.transfers.seconds == pytest.approx(0.5)
    assert turn.transferred_bytes == 262_144_000
    assert turn.first_tokens == 1 and turn.mean_ttft_s == pytest.approx(3.0)


def test_engine_without_the_metrics_counts_zero_and_has_no_ttft() -> None:
    counters = parse_engine_counters("# HELP up up\n# TYPE up gauge\nup 1\n")
    assert counters.loaded_tokens == 0 and counters.transfers.reads == 0
    assert counters.mean_ttft_s is None


def test_process_meter_sees_the_window_cpu_and_memory() -> None:
    meter = ProcessMeter()
    held = b"x" * (64 * 1024 * 1024)  # written: resident
    sum(range(2_000_000))
    use = meter.read()
    assert use.cpu_s > 0
    assert use.rss_growth_bytes is not None and use.rss_growth_bytes >= 60 * 1024 * 1024
    del held
    later = ProcessMeter().read()  # a new window forgets the earlier peak
    assert later.rss_growth_bytes is not None and later.rss_growth_bytes < 60 * 1024 * 1024


def test_router_log_captures_the_routers_debug_decisions() -> None:
    logger = logging.getLogger("agentkv_server.router.orchestrator")
    level = logging.getLogger("agentkv_server.router").level
    with router_log() as lines:
        logger.debug("session %s: %s (%s)", "s1", "KVPath.PULL", "new_part_too_long")
    logger.debug("after the window")
    assert lines == ["DEBUG session s1: KVPath.PULL (new_part_too_long)"]
    assert logging.getLogger("agentkv_server.router").level == level  # restored


def turn(
    history: int, forced: str, seconds: float, *, path: str | None = None, **fields: object
) -> PathTurn:
    """A measured turn; the prompt is the history plus a little."""
    paths = {"first": "recompute", "local": "local", "reuse": "reuse", "recompute": "recompute"}
    policy = {"local": "agentkv", "recompute": "never"}.get(forced, "always")
    base = PathTurn(
        history, 1, forced, policy, kv_path=path or paths[forced], prompt_tokens=history,
        seconds=seconds, router_cpu_s=0.01, router_rss_peak_bytes=200_000_000,
        router_rss_growth_bytes=1_000_000,
    )  # fmt: skip
    return replace(base, **fields)  # type: ignore[arg-type]


HISTORIES = (8000, 32000, 64000, 128000)


@pytest.fixture
def sweep() -> PathSweep:
    """Recompute quadratic in the history, local flat, the pull linear in bytes and seconds."""
    turns = []
    for h in HISTORIES:
        turns += [
            turn(h, "first", 1e-9 * h * h),
            turn(h, "local", 0.3, plan_s=0.01),
            turn(h, "reuse", 0.5 + h / 50000, pulled_tokens=h, pull_bytes=8192 * h, pull_s=h / 1e5),
            turn(h, "recompute", 1e-9 * h * h),
        ]
    return PathSweep({"command": "agentkv bench --preset long", "model": "agentkv-tiny-long",
                      "kv_bytes_per_token": 8192, "duration_s": 1234.5}, tuple(turns))  # fmt: skip


def test_loglog_slope_of_a_power_law() -> None:
    assert loglog_slope([(x, 3 * x**2) for x in (1, 4, 16)]) == pytest.approx(2.0)
    assert loglog_slope([(x, 5.0) for x in (1, 4, 16)]) == pytest.approx(0.0)


def test_growth_tells_quadratic_from_linear_and_flat(sweep: PathSweep) -> None:
    found = {(g.forced, g.cost): g for g in growth(sweep.turns)}
    recompute = found[("recompute", "turn s")]
    assert recompute.exponent == pytest.approx(2.0)
    assert recompute.ratio == pytest.approx(256.0) and recompute.tokens_ratio == 16.0
    assert recompute.verdict == "worse than linear"
    assert found[("reuse", "pull MB")].verdict == "linear"
    assert found[("reuse", "pull MB")].values == (8192 * 8000 / 1e6, 8192 * 128000 / 1e6)
    assert found[("local", "turn s")].verdict == "flat"
    assert ("local", "pull s") not in found  # never pulled: nothing to fit


def test_growth_leaves_out_noise(sweep: PathSweep) -> None:
    """Sub-millisecond plan steps and a few pages of RSS are noise, not a growth to report."""
    noisy = [
        replace(t, plan_s=2e-4 * (1 + i % 4), router_rss_growth_bytes=4096 * (i + 1))
        for i, t in enumerate(sweep.turns)
    ]
    costs = {(g.forced, g.cost) for g in growth(noisy)}
    assert ("recompute", "plan s") not in costs and ("first", "router RSS growth MB") not in costs
    assert ("recompute", "router CPU s") in costs


def test_growth_leaves_out_failed_turns_and_single_sizes(sweep: PathSweep) -> None:
    failed = replace(sweep.turns[-1], error="HTTP 502", seconds=None)
    turns = [*sweep.turns[:-1], failed]
    recompute = next(g for g in growth(turns) if (g.forced, g.cost) == ("recompute", "turn s"))
    assert recompute.tokens == (8000, 64000)
    assert growth([turn(8000, "first", 1.0)]) == []


def test_markdown_has_a_row_per_turn_and_the_growth(sweep: PathSweep) -> None:
    text = render_path_markdown(sweep)
    assert "8192 bytes of KV per token; 1234.5 s in all" in text
    row = next(line for line in text.splitlines() if line.startswith("| 128000 | reuse |"))
    # prompt, seconds, plan, pulled tokens, pull MB and s, P->D, CPU, RSS, TTFTs
    assert row == (
        "| 128000 | reuse | reuse | 128000 | 3.06 | n/a | 128000 | 1048.6 | 1.280 | n/a "
        "| 0.010 | 200 (+1) | n/a | n/a |"
    )
    turn_s = next(line for line in text.splitlines() if line.startswith("| turn s |"))
    # first, local, reuse, recompute: quadratic in bold, flat, linear plus a fixed part
    assert turn_s.startswith("| turn s | **256.0x, k 2.00** | 1.0x, k 0.00 | 4.6x, k 0.")
    assert "| prompt tokens | 16.0x (8000 - 128000) |" in text
    assert "did not take the forced path" not in text


def test_markdown_explains_a_turn_off_its_path_with_the_routers_log(sweep: PathSweep) -> None:
    why = ("DEBUG session s: KVPath.PULL (new_part_too_long) held=128000 new=600",)
    odd = turn(128000, "local", 2.0, path="reuse", router_log=why)
    failed = replace(turn(64000, "recompute", 0.0), seconds=None, kv_path=None, error="HTTP 502")
    text = render_path_markdown(replace(sweep, turns=(*sweep.turns, odd, failed)))
    assert "- history 128000, turn 1 `local` took `reuse`. " + why[0] in text
    assert "- history 64000, turn 1 `recompute` failed: HTTP 502." in text
    assert "| 64000 | recompute | FAILED |" in text


def test_report_files_round_trip(tmp_path: Path, sweep: PathSweep) -> None:
    paths = write_path_report(sweep, tmp_path)
    assert {p.name for p in paths} == {JSON_NAME, MARKDOWN_NAME, COST_PLOT}
    assert (tmp_path / COST_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / JSON_NAME).read_text())
    assert is_path_sweep(data) and not is_path_sweep({"config": {}, "records": []})
    assert PathSweep.from_dict(data).turns == sweep.turns
    verdicts = {(g["forced"], g["cost"]): g["verdict"] for g in data["growth"]}
    assert verdicts[("first", "turn s")] == "worse than linear"
