"""The pressure workload: deterministic sessions of the shapes asked for."""

from __future__ import annotations

from dataclasses import replace

import pytest

from agentkv_server.bench.pressure import PressureWorkload
from agentkv_server.bench.workload import PRESETS
from agentkv_server.errors import ConfigError

WORKLOAD = PressureWorkload(
    session_counts=(4, 16), history_tokens=(2000, 6000), turns=(3, 6), new_tokens=150,
    output_tokens=32, gap_median_s=2.0, idle_share=0.25, seed=7,
)  # fmt: skip


def test_the_same_seed_draws_the_same_sessions_and_another_seed_others() -> None:
    assert WORKLOAD.sessions(16) == WORKLOAD.sessions(16)
    other = PressureWorkload(**{**WORKLOAD.__dict__, "seed": 8})
    assert other.sessions(16) != WORKLOAD.sessions(16)


def test_a_session_is_the_same_in_every_sweep_point() -> None:
    assert WORKLOAD.sessions(16)[:4] == WORKLOAD.sessions(4)


def test_sessions_have_the_shapes_asked_for() -> None:
    sessions = WORKLOAD.sessions(200)
    assert [s.index for s in sessions] == list(range(200))
    assert all(2000 <= s.history_tokens <= 6000 and 3 <= s.turns <= 6 for s in sessions)
    assert all(0 <= s.start_s <= 20.0 for s in sessions)
    gaps = sorted(g for s in sessions for g in s.gaps_s)
    assert all(0 < g <= 60.0 for g in gaps)
    median = gaps[len(gaps) // 2]
    assert 1.4 < median < 2.8  # lognormal around its median of 2 s
    assert gaps[int(0.95 * len(gaps))] > 10 * median  # and a heavy tail (sigma 1.5: ~12x)
    idle = sum(not s.ends for s in sessions) / len(sessions)
    assert 0.15 < idle < 0.35
    assert len({s.history_tokens for s in sessions}) > 150  # drawn, not one length


def test_overrides_take_the_command_lines_meanings() -> None:
    changed = WORKLOAD.with_overrides(
        session_counts=(2, 3), history_tokens=(300, 400), turns=2, gap_median_s=0.05
    )
    assert changed.session_counts == (2, 3) and changed.history_tokens == (300, 400)
    assert changed.turns == (2, 2) and changed.start_window_s == pytest.approx(0.5)
    spread = replace(WORKLOAD, start_spread_s=30.0).with_overrides(gap_median_s=0.05)
    assert spread.start_window_s == 30.0  # a spread given stays: it is about arrivals
    assert WORKLOAD.with_overrides(history_tokens=(1000,)).history_tokens == (1000, 1000)
    with pytest.raises(ConfigError):
        WORKLOAD.with_overrides(history_tokens=(1, 2, 3))


@pytest.mark.parametrize(
    "fields",
    [{"session_counts": ()}, {"history_tokens": (6000, 2000)}, {"turns": (0, 3)},
     {"idle_share": 1.5}, {"gap_median_s": 0.0}, {"start_spread_s": -1.0}],
)  # fmt: skip
def test_bad_shapes_are_refused(fields: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        PressureWorkload(**{**WORKLOAD.__dict__, **fields})


def test_the_preset_overfills_its_decode_engines_kv() -> None:
    """The decode engine gets 8,192 tokens of KV (SmolLM2-135M fp32, 46,080 bytes a token:
    0.35 GiB of its 1 GiB): the smallest sweep point's histories fit, the largest's do not."""
    preset = PRESETS["pressure"]
    assert preset.measures == "pressure" and preset.model == "smollm2"
    assert preset.kv_cache_gib == 1 and preset.pressure is not None
    assert preset.decode_kv_tokens == 8192 < 2**30 // 46_080
    counts = preset.pressure.session_counts
    held = {n: sum(s.history_tokens for s in preset.pressure.sessions(n)) for n in counts}
    assert held[min(counts)] < preset.decode_kv_tokens < held[max(counts)]
    assert preset.workload.sessions == max(counts)  # texts for every session
