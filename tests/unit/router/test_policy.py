"""Reuse decisions: a cost model from measured rates, not a fixed token threshold."""

from __future__ import annotations

import pytest

from agentkv_server.router import (
    AlwaysPolicy,
    CostModelPolicy,
    KVPath,
    NeverPolicy,
    PrefillSample,
    TurnHints,
    UpstreamPolicy,
    make_policy,
)
from agentkv_server.router.policy import Decision
from agentkv_server.router.sessions import Holding
from agentkv_server.settings import CostModelSettings, RetentionSettings, Settings

NOW = 1000.0


def held(tokens: int, remaining_s: float = 100.0) -> Holding:
    return Holding("s", "http://d", "m", {}, tokens, NOW + remaining_s, NOW - 1)


@pytest.fixture
def policy() -> CostModelPolicy:
    cost = CostModelSettings(
        prefill_tokens_per_s=2000, pull_tokens_per_s=50000, pull_overhead_s=0.05
    )
    return CostModelPolicy(cost, RetentionSettings())


def test_tiny_history_is_recomputed(policy: CostModelPolicy):
    decision = policy.decide(held(40), NOW)
    assert not decision.reuse and decision.reason == "recompute_cheaper"


def test_long_history_is_pulled(policy: CostModelPolicy):
    assert policy.decide(held(3000), NOW).reuse


def test_holding_about_to_expire_is_skipped(policy: CostModelPolicy):
    decision = policy.decide(held(3000, remaining_s=0.5), NOW)
    assert not decision.reuse and decision.reason == "expiring"


def test_measured_slow_pulls_turn_reuse_off(policy: CostModelPolicy):
    assert policy.decide(held(1000), NOW).reuse
    for _ in range(30):  # pulls measured at 1 ms/token, slower than recompute (0.5 ms/token)
        policy.observe(PrefillSample(computed_tokens=10, pulled_tokens=1000, seconds=1.05))
    assert not policy.decide(held(1000), NOW).reuse


def test_measured_slow_prefill_makes_small_pulls_worth_it(policy: CostModelPolicy):
    assert not policy.decide(held(80), NOW).reuse
    for _ in range(30):  # prefill measured at 10 ms/token
        policy.observe(PrefillSample(computed_tokens=500, pulled_tokens=0, seconds=5.0))
    assert policy.prefill_s_per_token == pytest.approx(0.01, rel=0.01)
    assert policy.decide(held(80), NOW).reuse


def test_small_samples_teach_nothing(policy: CostModelPolicy):
    before = policy.prefill_s_per_token
    policy.observe(PrefillSample(computed_tokens=5, pulled_tokens=0, seconds=10.0))
    assert policy.prefill_s_per_token == before


@pytest.mark.parametrize(
    ("hints", "expected"),
    [
        (TurnHints(), 120.0),
        (TurnHints(next_turn_seconds=1.0), 62.0),  # x 2 + 60 s of slack
        (TurnHints(next_turn_seconds=0.0), 60.0),
        (TurnHints(next_turn_seconds=10_000.0), 600.0),
        (TurnHints(next_turn_seconds=5.0, session_end=True), 0.0),
    ],
)
def test_retention_from_hints(policy: CostModelPolicy, hints: TurnHints, expected: float):
    assert policy.retention_s(hints) == expected


def test_retention_is_clamped_to_the_minimum():
    policy = CostModelPolicy(CostModelSettings(), RetentionSettings(slack_s=0, min_s=5))
    assert policy.retention_s(TurnHints(next_turn_seconds=0.1)) == 5.0


def test_upstream_policy_is_a_fixed_threshold_and_ttl():
    policy = UpstreamPolicy()
    assert not policy.decide(held(63), NOW).reuse
    assert policy.decide(held(64), NOW).reuse
    assert policy.retention_s(TurnHints(next_turn_seconds=1.0, session_end=True)) == 480.0
    assert policy.sends_hints is False


def test_never_policy_recomputes_and_keeps_nothing():
    policy = NeverPolicy()
    assert not policy.decide(held(100_000), NOW).reuse
    assert policy.retention_s(TurnHints(next_turn_seconds=5.0)) == 0.0


def test_always_policy_pulls_what_the_cost_model_would_recompute(policy: CostModelPolicy):
    always = AlwaysPolicy(CostModelSettings(), RetentionSettings())
    for _ in range(5):  # learning that recomputing is cheap changes nothing
        always.observe(PrefillSample(computed_tokens=4000, pulled_tokens=0, seconds=0.001))
    assert not policy.decide(held(40), NOW).reuse
    assert always.decide(held(40), NOW) == Decision(KVPath.PULL, "always")
    assert always.decide(held(40, remaining_s=0.5), NOW).reason == "expiring"
    assert always.retention_s(TurnHints(next_turn_seconds=None)) == RetentionSettings().default_s
    settings = Settings(decode_urls=("http://d",), policy="always")
    assert make_policy(settings).name == "always"
