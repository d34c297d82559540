"""Engines' KV transfer totals from their /metrics, and how the report sums them per mode."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

from agentkv_server.bench.records import BenchResult, TransferRecord, TurnRecord
from agentkv_server.bench.report import render_markdown
from agentkv_server.bench.stats import summarize
from agentkv_server.bench.transfers import TRANSFER_METRIC, TransferTotals, parse_transfer_totals


def metrics_text(reads: list[float], *, engines: tuple[str, ...] = ("0",)) -> str:
    """What a vLLM engine exports: the NIXL histogram per engine label, beside other metrics."""
    registry = CollectorRegistry()
    Gauge("vllm:kv_cache_usage_perc", "usage", ["engine"], registry=registry).labels("0").set(0.1)
    histogram = Histogram(
        TRANSFER_METRIC, "xfer", ["engine", "model_name"], registry=registry, buckets=[0.01, 0.1]
    )
    for engine in engines:
        histogram.labels(engine, "m")  # present from start-up, with no read yet
    for index, seconds in enumerate(reads):
        histogram.labels(engines[index % len(engines)], "m").observe(seconds)
    return generate_latest(registry).decode()


def test_totals_sum_every_engine_label() -> None:
    totals = parse_transfer_totals(metrics_text([0.02, 0.04, 0.03], engines=("0", "1")))
    assert totals is not None and totals.reads == 3
    assert totals.seconds == pytest.approx(0.09)


def test_no_read_yet_is_zero_and_no_histogram_is_none() -> None:
    assert parse_transfer_totals(metrics_text([])) == TransferTotals(0, 0.0)
    assert parse_transfer_totals("# HELP up up\n# TYPE up gauge\nup 1\n") is None


def test_totals_subtract_to_a_window() -> None:
    before = parse_transfer_totals(metrics_text([0.02]))
    after = parse_transfer_totals(metrics_text([0.02, 0.05, 0.07]))
    assert before is not None and after is not None
    window = after - before
    assert window.reads == 2 and window.seconds == pytest.approx(0.12)


def test_report_gives_reads_and_mean_per_role(make_turn: Callable[..., TurnRecord]) -> None:
    turns: list[TurnRecord] = [make_turn("agentkv", 1, 1.0), make_turn("agentkv", 2, 0.5)]
    transfers = (
        TransferRecord("agentkv", 0, 1000, "prefill", 2, 0.1),
        TransferRecord("agentkv", 0, 4000, "prefill", 2, 0.3),
        TransferRecord("agentkv", 0, 1000, "decode", 0, 0.0),
    )
    summary = summarize(turns, transfers=transfers)
    agentkv = summary.mode("agentkv")
    assert agentkv is not None
    assert agentkv.transfers["prefill"].reads == 4
    assert agentkv.transfers["prefill"].seconds == pytest.approx(0.4)
    text = render_markdown(BenchResult({}, tuple(turns), transfers=transfers), summary)
    assert "| agentkv | 4 | 100 | 0 | n/a |" in text
    result = BenchResult({}, tuple(turns), transfers=transfers)
    assert BenchResult.from_dict(result.to_dict()) == result
