"""The router's admission and marked-down counts from its /metrics (bench/router_counts.py)."""

from __future__ import annotations

from agentkv_server.bench.router_counts import RouterCounts, parse_router_counts

COUNTED = """\
# HELP agentkv_admission_refused_total Turns refused.
# TYPE agentkv_admission_refused_total counter
agentkv_admission_refused_total{priority="new",tenant="aaaa"} 3.0
agentkv_admission_refused_total{priority="follow_up",tenant="bbbb"} 1.0
agentkv_admission_refused_created{priority="new",tenant="aaaa"} 1.7e9
# HELP agentkv_admission_queued_total Turns held back.
# TYPE agentkv_admission_queued_total counter
# HELP agentkv_engines_marked_down_total Engines marked down.
# TYPE agentkv_engines_marked_down_total counter
agentkv_engines_marked_down_total{role="prefill",kind="hung"} 2.0
"""


def test_every_label_is_summed_and_a_family_without_samples_counts_zero() -> None:
    assert parse_router_counts(COUNTED) == RouterCounts(refused=4.0, queued=0.0, marked_down=2.0)


def test_a_router_without_a_counter_reads_none_not_zero() -> None:
    older = "# TYPE agentkv_turns_total counter\nagentkv_turns_total 5.0\n"
    assert parse_router_counts(older) == RouterCounts(None, None, None)


def test_a_runs_counts_are_the_growth_and_stay_unknown_where_unknown() -> None:
    before, after = RouterCounts(1.0, 0.0, None), RouterCounts(4.0, 2.0, None)
    assert after - before == RouterCounts(3.0, 2.0, None)
