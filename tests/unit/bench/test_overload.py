"""The overload workload: two tenants, bursts sized to the offered load, drawn from the seed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agentkv_server.bench.overload import (
    BURST,
    STEADY,
    TENANT_KEYS,
    OverloadWorkload,
    router_settings,
)
from agentkv_server.bench.workload import PRESETS
from agentkv_server.errors import ConfigError
from agentkv_server.router.auth import tenant_id
from agentkv_server.settings import Settings

WORKLOAD = OverloadWorkload(seed=3)
CAPACITY = 300.0  # prompt tokens/s


def test_load_zero_is_the_steady_tenant_alone_through_the_whole_window() -> None:
    sessions = WORKLOAD.sessions(0.0, CAPACITY)
    assert [s.label for s in sessions] == [STEADY] * WORKLOAD.steady_sessions
    for s in sessions:
        assert s.api_key == TENANT_KEYS[STEADY] and s.burst is None and s.plan.ends
        assert s.plan.start_s < WORKLOAD.lead_in_s / 2  # done before the first burst
        last = s.plan.start_s + sum(s.plan.gaps_s)
        assert WORKLOAD.window_s <= last <= WORKLOAD.window_s + 10 * WORKLOAD.steady_gap_median_s


def test_bursts_arrive_within_their_window_beside_the_steady_sessions() -> None:
    sessions = WORKLOAD.sessions(2.0, CAPACITY)
    bursts = [s for s in sessions if s.label == BURST]
    size = WORKLOAD.burst_size(2.0, CAPACITY)
    assert len(bursts) == WORKLOAD.bursts * size and size > 1
    for s in bursts:
        assert s.burst is not None and s.api_key == TENANT_KEYS[BURST]
        opens = WORKLOAD.lead_in_s + s.burst * WORKLOAD.burst_period_s
        assert opens <= s.plan.start_s <= opens + WORKLOAD.burst_window_s
        assert WORKLOAD.turns[0] <= s.plan.turns <= WORKLOAD.turns[1]
        assert all(0 < gap <= 10 * WORKLOAD.gap_median_s for gap in s.plan.gaps_s)
    assert len({s.key for s in sessions}) == len({s.plan.index for s in sessions}) == len(sessions)


def test_a_burst_is_the_same_at_every_load_and_across_modes() -> None:
    """Burst b's first N sessions are drawn from the seed and their place, never the load."""
    low, high = WORKLOAD.sessions(1.0, CAPACITY), WORKLOAD.sessions(4.0, CAPACITY)
    per_burst = WORKLOAD.burst_size(1.0, CAPACITY)
    for burst in range(WORKLOAD.bursts):
        mine = [s for s in low if s.burst == burst]
        assert mine == [s for s in high if s.burst == burst][:per_burst]
    assert replace(WORKLOAD, seed=4).sessions(1.0, CAPACITY) != low


@pytest.mark.parametrize("load", [1.0, 2.0, 4.0])
def test_the_offered_work_is_the_load_times_the_capacity(load: float) -> None:
    """Sized on a session's expected work; what the draws offer stays within a session of it
    per burst period."""
    size = WORKLOAD.burst_size(load, CAPACITY)
    steady = WORKLOAD.steady_tokens_per_s()
    sized = steady + size * WORKLOAD.mean_burst_work / WORKLOAD.burst_period_s
    slack = WORKLOAD.mean_burst_work / WORKLOAD.burst_period_s
    assert abs(sized - load * CAPACITY) <= slack / 2
    offered = WORKLOAD.offered_tokens_per_s(WORKLOAD.sessions(load, CAPACITY))
    assert abs(offered - load * CAPACITY) < 2 * slack
    assert WORKLOAD.burst_size(4.0, CAPACITY) >= 2 * WORKLOAD.burst_size(2.0, CAPACITY) - 1


def test_a_sessions_work_is_what_a_reusing_stack_computes() -> None:
    (session,) = [s for s in WORKLOAD.sessions(1.0, CAPACITY) if s.key == "b0s0"]
    plan, w = session.plan, WORKLOAD
    followups = (plan.turns - 1) * (w.new_tokens + w.output_tokens)
    assert w.work_tokens(plan) == plan.history_tokens + w.new_tokens + followups


def test_points_name_each_load_and_what_it_offered() -> None:
    points = WORKLOAD.points(CAPACITY)
    assert [(p.tag, p.load) for p in points] == [("x0", 0.0), ("x1", 1.0), ("x2", 2.0), ("x4", 4.0)]
    assert points[0].burst_size == 0 and points[2].burst_size == WORKLOAD.burst_size(2, CAPACITY)
    assert all(p.offered_tokens_per_s for p in points)


def test_the_routers_take_both_keys_the_deadline_and_the_objective_as_admission_bound() -> None:
    workload = replace(WORKLOAD, objective_s=12.0, turn_timeout_s=50.0)
    settings = router_settings({"timeouts": {"connect_s": 3}}, workload)
    parsed = Settings.model_validate({**settings, "decode_urls": ["http://d"]})
    keys = [key.get_secret_value() for key in parsed.api_keys]
    assert keys == [TENANT_KEYS[STEADY], TENANT_KEYS[BURST]]
    assert tenant_id(keys[0]) != tenant_id(keys[1])
    assert (parsed.timeouts.connect_s, parsed.timeouts.first_token_s) == (3, 50.0)
    assert workload.client_timeout_s > 50.0  # the router's 504 comes first
    if "admission" in Settings.model_fields:
        assert settings["admission"] == {"max_wait_s": 12.0}
    else:
        assert "admission" not in settings


def test_overrides_take_the_command_lines_meanings() -> None:
    changed = WORKLOAD.with_overrides(
        history_tokens=(500,), turns=(2, 3), loads=(1.0,), bursts=None
    )
    assert changed.history_tokens == (500, 500) and changed.turns == (2, 3)
    assert changed.loads == (1.0,) and changed.bursts == WORKLOAD.bursts
    with pytest.raises(ConfigError):
        WORKLOAD.with_overrides(history_tokens=(1, 2, 3))


@pytest.mark.parametrize(
    "fields",
    [{"loads": ()}, {"loads": (-1.0,)}, {"history_tokens": (9, 1)}, {"turns": (0, 2)},
     {"objective_s": 0.0}, {"burst_window_s": 50.0}, {"steady_sessions": 0},
     {"steady_gap_median_s": 0.0}, {"turn_timeout_s": 0.0}],
)  # fmt: skip
def test_bad_shapes_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        replace(WORKLOAD, **fields)


def test_the_preset_compares_three_modes_on_the_real_model() -> None:
    preset = PRESETS["overload"]
    assert preset.measures == "overload" and preset.model == "smollm2"
    assert preset.modes == ("aggregated", "agentkv", "upstream-best")
    assert preset.overload is not None and preset.overload.loads == (0.0, 1.0, 2.0, 4.0)
    assert preset.workload.new_tokens == preset.overload.new_tokens
