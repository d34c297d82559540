"""The third path: a turn continues on its decode holder, chosen by predicted TTFT and budget."""

from __future__ import annotations

import asyncio
import logging

import pytest

from agentkv_server.router import (
    AlwaysPolicy,
    CostModelPolicy,
    KVPath,
    NeverPolicy,
    PrefillSample,
    TurnLoad,
    UpstreamPolicy,
)
from agentkv_server.router.placement import TAIL_WINDOW_GAPS, StepTimes
from agentkv_server.router.sessions import Holding
from agentkv_server.settings import CostModelSettings, LocalPathSettings, RetentionSettings
from agentkv_server.testing import ManualClock
from agentkv_server.testing.harness import conversation, plan_reason, tool_result

NOW = 1000.0
LOCAL_ON = {"enabled": True}


def held(tokens: int, remaining_s: float = 100.0) -> Holding:
    return Holding("s", "http://d", "m", {}, tokens, NOW + remaining_s, NOW - 1)


def cost_model(**local: object) -> CostModelPolicy:
    """The cost model at 2000 tokens/s; the holder prefills a new part in one step unless the
    test gives ``slice_tokens``."""
    cost = CostModelSettings(
        prefill_tokens_per_s=2000,
        pull_tokens_per_s=50000,
        pull_overhead_s=0.05,
    )
    local = {"slice_tokens": 0, **local}
    return CostModelPolicy(cost, RetentionSettings(), LocalPathSettings.model_validate(local))


def idle(new_tokens: int) -> TurnLoad:
    return TurnLoad(new_tokens=new_tokens, holder_running=0)


# -- the decision ------------------------------------------------------------------------


def test_short_follow_up_continues_on_the_holder():
    decision = cost_model().decide(held(3000), NOW, idle(150))
    assert (decision.path, decision.reason) == (KVPath.LOCAL, "local_fastest")
    assert not decision.reuse  # no prefill engine pulls


def test_history_in_the_host_tier_continues_on_its_engine_within_the_local_limits():
    policy = cost_model(max_new_tokens=512)
    decision = policy.decide_from_host_tier(3000, idle(150))
    assert (decision.path, decision.reason) == (KVPath.LOCAL, "host_tier")
    # Never a pull: the tier is not the engine's KV cache, which is all NIXL reads.
    decision = policy.decide_from_host_tier(3000, idle(513))
    assert (decision.path, decision.reason) == (KVPath.RECOMPUTE, "new_part_too_long")
    decision = cost_model(enabled=False).decide_from_host_tier(3000, idle(150))
    assert decision.path is KVPath.RECOMPUTE


def test_over_the_stall_budget_history_in_the_host_tier_weighs_its_recompute_against_the_stall():
    """Refused, such a turn recomputes its whole history on P (no pull): it goes local when
    that saves more seconds than its slices add to the holder's sequences together."""
    policy = cost_model()  # 3,000 tokens recompute in 1.5 s; each slice adds 0.3 s here

    def stalling(running: int, prefill_wait_s: float = 0.0) -> TurnLoad:
        return TurnLoad(150, running, holder_added_s=0.3, prefill_wait_s=prefill_wait_s)

    decision = policy.decide_from_host_tier(3000, stalling(running=2))  # 0.6 s against ~1.2 s
    assert (decision.path, decision.reason) == (KVPath.LOCAL, "host_tier_over_budget")
    decision = policy.decide_from_host_tier(3000, stalling(running=10))  # 3 s against ~1.2 s
    assert (decision.path, decision.reason) == (KVPath.RECOMPUTE, "stall_over_budget")
    decision = policy.decide_from_host_tier(3000, stalling(running=10, prefill_wait_s=5.0))
    assert decision.path is KVPath.LOCAL  # P's queue makes the recompute the costlier


def test_new_part_over_the_limit_goes_to_a_prefill_engine():
    policy = cost_model(max_new_tokens=512)
    assert policy.decide(held(3000), NOW, idle(512)).path is KVPath.LOCAL
    decision = policy.decide(held(3000), NOW, idle(513))
    assert (decision.path, decision.reason) == (KVPath.PULL, "new_part_too_long")


def test_stall_budget_applies_only_while_the_holder_decodes_others():
    policy = cost_model(max_stall_s=0.1)  # 0.1 s at 2000 tok/s: 200 new tokens
    # A pull of 30,000 tokens costs 0.65 s: local saves more than 0.1 s x 4 sequences.
    assert policy.decide(held(30_000), NOW, TurnLoad(300, holder_running=0)).path is KVPath.LOCAL
    assert policy.decide(held(30_000), NOW, TurnLoad(200, holder_running=4)).path is KVPath.LOCAL
    decision = policy.decide(held(30_000), NOW, TurnLoad(300, holder_running=4))
    assert (decision.path, decision.reason) == (KVPath.PULL, "stall_over_budget")


def test_within_the_budget_a_local_turn_must_save_more_than_it_costs_the_holders_sessions():
    """Found on the two-decoder bench: 4k-token follow-ups went local at 1.56-1.61 s where
    pulls took 1.50-1.64 s, each of their three slices adding ~0.3 s to both decoders' steps,
    and 20 and 32 of the 29 and 44 gaps in the decoders' slowest 1% were beside them."""
    policy = cost_model(max_stall_s=0.5, slice_tokens=64)
    for _ in range(30):  # pulls of 4000 tokens from the busy holder: 1.2 s
        policy.observe(PrefillSample(160, 4000, 1.2 + 160 / 2000, holder_busy=True))
    busy_4k = TurnLoad(160, holder_running=2, holder_added_s=0.3)
    local = policy.predicted_local(busy_4k)  # 3 slices of 0.3 s: 0.9 s, ~0.38 s faster
    assert local.seconds == pytest.approx(0.9)
    assert policy.others_delay_s(busy_4k, local) == pytest.approx(0.3 * 3 * 2)
    decision = policy.decide(held(4000), NOW, busy_4k)
    assert (decision.path, decision.reason) == (KVPath.PULL, "local_slows_others")
    # Idle, the holder slows nobody; queued, P would cost the turn more than the slices do.
    assert policy.decide(held(4000), NOW, idle(160)).path is KVPath.LOCAL
    queued = TurnLoad(160, holder_running=2, holder_added_s=0.3, prefill_wait_s=2.0)
    decision = policy.decide(held(4000), NOW, queued)
    assert (decision.path, decision.reason) == (KVPath.LOCAL, "local_fastest")
    # A history in the host tier is priced the same way against its recompute.
    decision = policy.decide_from_host_tier(3000, busy_4k)  # 0.67 s saved, 1.8 s added
    assert (decision.path, decision.reason) == (KVPath.RECOMPUTE, "local_slows_others")
    assert policy.decide_from_host_tier(3000, idle(160)).path is KVPath.LOCAL


def test_over_the_stall_budget_a_turn_still_goes_local_when_p_would_keep_it_waiting_longer():
    """Found on the pressure preset: follow-ups the budget sent to P waited 5.8-7.5 s there
    behind cold first turns, where a local turn took ~1 s and cost each of the holder's few
    running sequences a few tenths of a second per step."""
    policy = cost_model(max_stall_s=0.1)  # 300 new tokens in one step: 0.15 s added per step
    queued = TurnLoad(300, holder_running=4, prefill_wait_s=5.0)  # 4.74 s saved, 0.6 s added
    decision = policy.decide(held(3000), NOW, queued)
    assert (decision.path, decision.reason) == (KVPath.LOCAL, "local_over_budget")
    assert decision.added_itl_s == pytest.approx(0.15)
    crowded = TurnLoad(300, holder_running=40, prefill_wait_s=5.0)  # 6 s added
    assert policy.decide(held(3000), NOW, crowded).reason == "stall_over_budget"


def test_over_the_stall_budget_only_ps_queue_is_held_against_the_budget():
    """Found on the two-decoder bench: with P idle, pulls of 4k-token histories from the busy
    holder took ~2 s against ~1.3 s local, and counting those seconds sent 9 of 18 such
    follow-ups local over the budget; the decoders' TPOT p99 went from 1.46x to 2.27x
    recompute's. A pull's own time is what the budget already weighs."""
    policy = cost_model(max_stall_s=0.1)  # 300 new tokens in one step: 0.15 s added per step
    for _ in range(30):  # pulls of 3000 held tokens from a busy holder take 3 s
        policy.observe(PrefillSample(300, 3000, 3.0, holder_busy=True))
    idle_p = TurnLoad(300, holder_running=2)  # 0.3 s added in all, ~2 s saved by P's path
    assert policy.decide(held(3000), NOW, idle_p).reason == "stall_over_budget"
    queued = TurnLoad(300, holder_running=2, prefill_wait_s=1.0)
    assert policy.decide(held(3000), NOW, queued).reason == "local_over_budget"


def busy(new_tokens: int) -> TurnLoad:
    return TurnLoad(new_tokens=new_tokens, holder_running=2)


def test_sliced_prefill_adds_one_slice_per_step_to_the_holders_sequences():
    """On a busy holder the engine prefills ``slice_tokens`` per decode step, so the budget
    bounds one slice's time, not the whole new part's (300 tokens at 2000 tok/s: 150 ms)."""
    unsliced = cost_model(max_stall_s=0.05)
    decision = unsliced.decide(held(3000), NOW, busy(300))
    assert (decision.path, decision.reason) == (KVPath.PULL, "stall_over_budget")

    sliced = cost_model(max_stall_s=0.05, slice_tokens=64)  # 64 tokens: 32 ms per step
    local = sliced.predicted_local(busy(300))
    assert local.added_itl_s == pytest.approx(64 / 2000)
    assert sliced.slices(300) == 5
    assert local.seconds == pytest.approx(5 * 64 / 2000)  # no handoff measured yet
    # Unmeasured, the slices are priced at that bound: 32 ms x 5 slices x 2 sequences.
    decision = sliced.decide(held(30_000), NOW, busy(300))  # a pull of 0.8 s: 0.64 s saved
    assert (decision.path, decision.reason) == (KVPath.LOCAL, "local_fastest")
    assert decision.added_itl_s == pytest.approx(0.032)
    decision = sliced.decide(held(3000), NOW, busy(300))  # a pull of 0.26 s: 0.1 s saved
    assert (decision.path, decision.reason) == (KVPath.PULL, "local_slows_others")
    assert sliced.predicted_local(idle(300)).added_itl_s == 0.0  # an idle holder: one step


def test_busy_holders_local_time_is_learned_per_slice():
    """Each slice rides on one of the holder's decode steps, so a sliced prefill takes as many
    of its steps: once measured slow, busy follow-ups pull while idle ones stay local."""
    policy = cost_model(max_stall_s=0.05, slice_tokens=64)  # a pull of 30,000 tokens: 0.8 s
    assert policy.decide(held(30_000), NOW, busy(300)).path is KVPath.LOCAL
    for _ in range(30):  # 5 slices in 1.5 s: the holder steps every 0.3 s
        policy.observe_local(300, 1.5, holder_busy=True)
    assert policy.predicted_local(busy(300)).seconds == pytest.approx(1.5, rel=0.05)
    assert policy.predicted_local(busy(100)).seconds == pytest.approx(0.6, rel=0.05)
    assert policy.decide(held(30_000), NOW, busy(300)).path is KVPath.PULL
    assert policy.decide(held(30_000), NOW, idle(300)).path is KVPath.LOCAL


def test_what_slices_add_to_the_holders_steps_is_taken_from_its_streams():
    """The rate bound counts a slice's whole prefill time; a decode step that carries it
    shares the work of reading the weights, so the holder's streams show less. Once they have
    shown it, the budget is checked against what they showed (scaled to a shorter part)."""
    policy = cost_model(max_stall_s=0.02, slice_tokens=64)  # bound: 64 / 2000 = 32 ms
    unseen = policy.decide(held(30_000), NOW, busy(300))
    assert (unseen.path, unseen.added_itl_s) == (KVPath.LOCAL, pytest.approx(0.032))  # tried
    seen = TurnLoad(new_tokens=300, holder_running=2, holder_added_s=0.015)
    decision = policy.decide(held(30_000), NOW, seen)
    assert (decision.path, decision.added_itl_s) == (KVPath.LOCAL, pytest.approx(0.015))
    over = TurnLoad(new_tokens=300, holder_running=2, holder_added_s=0.025)
    assert policy.decide(held(30_000), NOW, over).reason == "stall_over_budget"
    short = TurnLoad(new_tokens=32, holder_running=2, holder_added_s=0.015)
    assert policy.predicted_local(short).added_itl_s == pytest.approx(0.0075)


def test_step_times_tell_a_holders_plain_steps_from_those_carrying_a_prefill():
    steps = StepTimes()
    assert steps.added_s(1000) is None
    for _ in range(200):
        steps.observe(0.080)
    assert steps.added_s(1000) is None  # no step with a prefill seen yet
    with steps.local_prefill(1000):
        for _ in range(200):
            steps.observe(0.130)
    assert steps.local_prefills == 0
    assert steps.added_s(1000) == pytest.approx(0.050, abs=0.001)


def test_one_local_prefill_is_enough_to_show_what_its_slices_cost():
    """Measured on the two-decoder bench: a local turn over 4k tokens of history made three
    decode steps of each decoder ~0.43 s instead of ~0.08 s, and two more local turns followed,
    under a budget of 0.2 s. A running mean of gaps that started at the window's first gap (a
    step before the first slice) had moved to 0.079 s of added delay after those steps."""
    steps = StepTimes()
    for _ in range(200):
        steps.observe(0.080)
    with steps.local_prefill(4200):
        steps.observe(0.080)  # the step before the first slice
        for _ in range(6):
            steps.observe(0.380)
    added = steps.added_s(4200)
    assert added is not None and added > 0.2  # over the default budget: the next one pulls
    policy = cost_model(max_stall_s=0.2, slice_tokens=64)
    load = TurnLoad(new_tokens=180, holder_running=3, holder_added_s=added)
    assert policy.decide(held(4000), NOW, load).reason == "stall_over_budget"


def test_step_times_count_their_recent_gaps_beside_a_local_prefill():
    steps = StepTimes()
    assert steps.window_gaps is None  # none of its streams relayed here: no tail to count
    for _ in range(100):
        steps.observe(0.080)
    with steps.local_prefill(1000):
        for _ in range(6):
            steps.observe(0.200)
    with steps.pull_read(1000):  # a pull's read slows no gap of the holder's tail
        steps.observe(0.085)
    assert (steps.slowed_gaps, steps.window_gaps) == (6, 107)  # a share of the gaps seen
    for _ in range(TAIL_WINDOW_GAPS - 10):
        steps.observe(0.080)
    assert (steps.slowed_gaps, steps.window_gaps) == (6, TAIL_WINDOW_GAPS)  # still in
    for _ in range(10):
        steps.observe(0.080)
    assert steps.slowed_gaps == 0  # out of the window


def tail(slowed_gaps: int, *, running: int = 2, wait_s: float = 5.0) -> TurnLoad:
    """A follow-up of 150 new tokens behind P's queue of ``wait_s``, its holder decoding
    ``running`` sequences whose last 2000 gaps ran ``slowed_gaps`` beside local prefills."""
    return TurnLoad(150, running, prefill_wait_s=wait_s, slowed_gaps=slowed_gaps, window_gaps=2000)


def test_local_turns_slow_at_most_a_share_of_the_holders_recent_gaps():
    """Found beside four agent sessions: P's queue of cold first turns sent 34 of 72
    follow-ups local (within the stall budget, or over it behind the queue), which slowed 98
    of the two decoders' 5427 gaps; their TPOT p99 was 2.81x recompute's. A p99 moves only
    once more than 1 % of the gaps are slow, whatever each one's delay."""
    policy = cost_model(max_slowed_share=0.005, slice_tokens=64)  # 10 of 2000 gaps
    assert policy.slices(150) == 3  # 3 slices x 2 sequences: 6 gaps
    assert policy.decide(held(3000), NOW, tail(4)).path is KVPath.LOCAL
    decision = policy.decide(held(3000), NOW, tail(5))
    assert (decision.path, decision.reason) == (KVPath.PULL, "tail_over_budget")
    crowded = tail(0, running=4)  # 12 gaps: more than the share allows at once
    assert policy.decide(held(3000), NOW, crowded).reason == "tail_over_budget"
    assert policy.decide(held(3000), NOW, tail(500, running=0)).path is KVPath.LOCAL  # idle
    uncounted = TurnLoad(150, 2, prefill_wait_s=5.0, slowed_gaps=500)  # no window: no share
    assert policy.decide(held(3000), NOW, uncounted).path is KVPath.LOCAL


def test_over_the_stall_budget_ps_queue_does_not_outweigh_the_tail_budget():
    policy = cost_model(max_stall_s=0.01, max_slowed_share=0.005)  # 150 tokens: 75 ms a step
    assert policy.decide(held(3000), NOW, tail(0)).reason == "local_over_budget"
    decision = policy.decide(held(3000), NOW, tail(9))
    assert (decision.path, decision.reason) == (KVPath.PULL, "tail_over_budget")
    host_tier = policy.decide_from_host_tier(3000, tail(9))
    assert (host_tier.path, host_tier.reason) == (KVPath.RECOMPUTE, "tail_over_budget")
    never = cost_model(max_slowed_share=0.0)
    assert never.decide(held(3000), NOW, tail(0)).reason == "tail_over_budget"
    assert never.decide(held(3000), NOW, tail(0, running=0)).path is KVPath.LOCAL


def test_what_slices_add_grows_with_the_context_they_attend_to():
    steps = StepTimes()
    for _ in range(200):
        steps.observe(0.080)
    with steps.local_prefill(4000):
        for _ in range(6):
            steps.observe(0.380)
    at_4k, at_1k = steps.added_s(4000), steps.added_s(1000)
    assert at_4k is not None and at_1k is not None
    assert at_4k == pytest.approx(0.300, rel=0.05)
    assert at_1k == pytest.approx(at_4k / 4, rel=0.1)  # one measurement: in proportion
    for _ in range(10):  # measured at 1k too: a fixed part and a part per context token
        with steps.local_prefill(1000):
            for _ in range(6):
                steps.observe(0.180)
    assert steps.added_s(1000) == pytest.approx(0.100, rel=0.1)
    assert steps.added_s(4000) > steps.added_s(1000) + 0.05


def test_overlapping_local_prefills_are_one_measurement_of_their_contexts_together():
    steps = StepTimes()
    for _ in range(200):
        steps.observe(0.080)
    with steps.local_prefill(1000):
        with steps.local_prefill(3000):
            for _ in range(6):
                steps.observe(0.380)
        steps.observe(0.380)
    assert steps.local_prefills == 0
    assert steps.added_s(4000) == pytest.approx(0.300, rel=0.05)


def test_step_times_measure_what_a_pull_costs_each_running_sequence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = ManualClock(now=10.0)
    monkeypatch.setattr("agentkv_server.router.placement.time.monotonic", clock)
    steps = StepTimes()
    for _ in range(200):
        steps.observe(0.080)
    assert steps.read_delay_s(4000) is None
    with steps.pull_read(4000):
        for _ in range(10):
            steps.observe(0.120)
        clock.now += 1.2
    # Each sequence took 10 steps in 1.2 s where 15 plain ones fit: 0.4 s of delay.
    assert steps.read_delay_s(4000) == pytest.approx(0.4, rel=0.05)
    assert steps.read_delay_s(1000) == pytest.approx(0.1, rel=0.1)  # in proportion to the read
    assert steps.plain_s == pytest.approx(0.080)  # the pull's gaps are not plain steps
    assert steps.added_s(4000) is None  # nor a local prefill's


def test_a_pull_that_slows_the_holders_sessions_more_than_it_saves_recomputes():
    """A pull (0.16 s here) against a recompute of the whole history (1.55 s): the read's
    delay to each of the holder's running sequences, times their number, is priced in."""
    policy = cost_model(enabled=False)
    cheap = TurnLoad(100, holder_running=2, read_delay_s=0.5)  # 0.16 + 1.0 s < 1.55 s
    assert policy.decide(held(3000), NOW, cheap).path is KVPath.PULL
    dear = TurnLoad(100, holder_running=2, read_delay_s=0.8)  # 0.16 + 1.6 s > 1.55 s
    decision = policy.decide(held(3000), NOW, dear)
    assert (decision.path, decision.reason) == (KVPath.RECOMPUTE, "pull_slows_others")
    alone = TurnLoad(100, holder_running=0, read_delay_s=0.8)  # nobody decoding to slow
    assert policy.decide(held(3000), NOW, alone).path is KVPath.PULL


def test_a_recompute_is_priced_against_the_turns_sharing_its_prefill_engine():
    """Where P is the bottleneck, the history a recompute computes there delays every turn
    in flight on it or held for it: a pull that slows the holder's sessions wins then."""
    policy = cost_model(enabled=False)
    idle_p = TurnLoad(100, holder_running=2, read_delay_s=0.8)  # 0.16 + 1.6 s > 1.55 s
    busy_p = TurnLoad(100, holder_running=2, read_delay_s=0.8, prefill_sharing=3)

    assert policy.decide(held(3000), NOW, idle_p).path is KVPath.RECOMPUTE
    decision = policy.decide(held(3000), NOW, busy_p)  # 1.76 s < 1.55 + 3 x ~1.5 s
    assert (decision.path, decision.reason) == (KVPath.PULL, "pull_cheaper")


def test_pulls_from_busy_holders_are_learned_apart():
    """A busy holder serves P's read between its decode steps: those pulls are slower, and
    must not make pulls from idle holders look slow (or the reverse)."""
    policy = cost_model()
    idle_before = policy.predicted_pull_s(3000)
    for _ in range(30):
        policy.observe(PrefillSample(100, 3000, 0.05 + 2.0, holder_busy=True))
    assert policy.predicted_pull_s(3000, holder_busy=True) > 10 * idle_before
    assert policy.predicted_pull_s(3000) == pytest.approx(idle_before)
    decision = policy.decide(held(3000), NOW, TurnLoad(new_tokens=600, holder_running=2))
    assert (decision.path, decision.reason) == (KVPath.RECOMPUTE, "new_part_too_long")
    assert policy.decide(held(3000), NOW, idle(600)).path is KVPath.PULL


def test_refused_local_with_a_tiny_history_recomputes():
    decision = cost_model(max_new_tokens=10).decide(held(40), NOW, idle(300))
    assert (decision.path, decision.reason) == (KVPath.RECOMPUTE, "new_part_too_long")


def test_measured_slow_local_prefill_sends_mid_size_parts_to_pull():
    policy = cost_model()
    assert policy.decide(held(3000), NOW, idle(400)).path is KVPath.LOCAL
    for _ in range(30):  # the holder measured at 5 ms/token with a prefix hit: 10x slower
        policy.observe_local(400, 2.0)
    assert policy.predicted_local_s(400) == pytest.approx(2.0, rel=0.05)
    assert policy.decide(held(3000), NOW, idle(400)).path is KVPath.PULL


def test_local_is_compared_with_the_decode_step_a_pull_still_needs():
    """A local turn's measured time ends at D's first byte; a pull's P step is followed by a
    D step of its own. Found on the cpu preset: with the P step alone as the pull's cost, half
    of the 1000-token follow-ups pulled (0.87-1.19 s) where local answered in 0.60-0.71 s."""
    policy = cost_model()
    for _ in range(30):  # the holder prefills 160 new tokens in 0.3 s
        policy.observe_local(160, 0.3)
    assert policy.decide(held(1200), NOW, idle(160)).path is KVPath.PULL  # 0.3 s vs 0.15 s
    policy.observe_handoff(0.25)  # D's step after P: 0.25 s to its first byte
    assert policy.handoff_s == pytest.approx(0.25)
    assert policy.decide(held(1200), NOW, idle(160)).path is KVPath.LOCAL


def test_the_handoff_is_a_running_mean():
    policy = cost_model()
    policy.observe_handoff(1.0)
    for _ in range(50):
        policy.observe_handoff(0.2)
    assert policy.handoff_s == pytest.approx(0.2, abs=0.01)


def test_local_turns_without_new_tokens_keep_the_prior_rate():
    """A session that resends its prompt (a retry) has no new tokens: every local sample is
    at zero tokens, which fixes no slope. Found by `agentkv bench router`: every later
    decision divided by zero (HTTP 500 for each of the session's turns)."""
    policy = cost_model()
    for _ in range(5):
        policy.observe_local(0, 0.002)
    assert policy.decide(held(3000), NOW, idle(0)).path == "local"
    assert policy.predicted_local_s(400) == pytest.approx(0.002 + 400 / 2000, rel=0.05)


def test_unknown_new_part_or_disabled_local_never_goes_local():
    assert cost_model().decide(held(3000), NOW, None).path is KVPath.PULL
    assert not cost_model(enabled=False).considers_local
    assert cost_model(enabled=False).decide(held(3000), NOW, idle(10)).path is KVPath.PULL


def test_expiring_holding_is_not_continued_on():
    decision = cost_model().decide(held(3000, remaining_s=0.5), NOW, idle(10))
    assert (decision.path, decision.reason) == (KVPath.RECOMPUTE, "expiring")


@pytest.mark.parametrize(
    ("policy", "path"),
    [
        (AlwaysPolicy(CostModelSettings(), RetentionSettings()), KVPath.PULL),
        (UpstreamPolicy(), KVPath.PULL),
        (NeverPolicy(), KVPath.RECOMPUTE),
    ],
)
def test_other_policies_never_go_local(policy, path):
    assert not policy.considers_local
    assert policy.decide(held(3000), NOW, idle(10)).path == path


# -- through the router ------------------------------------------------------------------


async def test_follow_up_goes_local_without_prefill_or_transfer(make_router, caplog):
    caplog.set_level(logging.DEBUG, logger="agentkv_server.router.orchestrator")
    router = await make_router(local=LOCAL_ON)
    first = conversation(1, 500)
    await router.chat(first, session="s1")
    holder = router.decode[0]
    (old_id,) = holder.retained
    prefill_steps = len(router.prefill[0].completions())

    response = await router.chat(tool_result(first, 20), session="s1")

    assert response.status_code == 200
    assert response.headers["x-agentkv-kv-path"] == "local"
    held = 500 + 2 + 2 + 2 + 4
    assert response.headers["x-agentkv-reused-tokens"] == str(held)  # the engine's cached count
    assert len(router.prefill[0].completions()) == prefill_steps  # no P step
    assert router.prefill[0].pulled == []
    local = holder.completions()[-1].kv_params
    assert "remote_engine_id" not in local and "do_remote_prefill" not in local
    assert local["agentkv_ticket"]
    # The step released the holding it continues (shared as it arrives: a prefix hit).
    assert local["agentkv_release"] == [old_id]
    # The local turn's KV is the session's holding now; the old lease was released.
    holding = await router.state.store.take("s1")
    assert holding is not None and holding.decode_url == holder.url
    assert holding.num_tokens == (500 + 2) + (2 + 2) + (4 + 2) + (20 + 2) + 4  # prompt, output
    assert holder.released == [old_id]
    assert await router.metric('agentkv_turns_total{path="local"}') == 1
    assert await router.metric("agentkv_reused_tokens_total") == held
    assert "local (local_fastest)" in caplog.text
    assert "turn local: plan=" in caplog.text


async def test_long_tool_result_is_pulled_to_prefill(make_router):
    router = await make_router(local={"enabled": True, "max_new_tokens": 100})
    first = conversation(1, 500)
    cold = await router.chat(first, session="s1")

    response = await router.chat(tool_result(first, 300), session="s1")

    assert response.headers["x-agentkv-kv-path"] == "reuse"
    assert len(router.prefill[0].pulled) == 1
    # Each turn's plan says why: the first had nothing held; this one's new part was too long.
    assert plan_reason(cold) == "none_held"
    assert plan_reason(response) == "new_part_too_long"
    decisions = 'agentkv_path_decisions_total{path="reuse",reason="new_part_too_long"}'
    assert await router.metric(decisions) == 1


async def held_session(router):  # type: ignore[no-untyped-def]
    """A first turn of 500 words held on the only decode engine, and that engine."""
    first = conversation(1, 500)
    await router.chat(first, session="s1")
    engine = router.state.decode.get(router.decode[0].url)
    assert engine is not None
    return first, engine


async def test_a_pull_teaches_the_holder_what_its_reads_cost_its_streams(make_router):
    router = await make_router(local={"enabled": True, "max_new_tokens": 100})
    first, engine = await held_session(router)
    prefill = router.state.prefill.get(router.prefill[0].url)
    assert prefill is not None
    for _ in range(50):  # the holder's streams: plain steps
        engine.steps.observe(0.008)

    pulled = asyncio.create_task(router.chat(tool_result(first, 300), session="s1"))
    while not prefill.inflight:  # P's step, reading from the holder
        await asyncio.sleep(0.001)
    for _ in range(5):
        engine.steps.observe(0.016)
    response = await pulled

    assert response.headers["x-agentkv-kv-path"] == "reuse"
    delay = engine.steps.read_delay_s(600)
    assert delay is not None and delay > 0
    assert engine.steps.plain_s == pytest.approx(0.008)


async def test_busy_holder_keeps_a_mid_size_part_off_its_decode_batch(make_router):
    # The stub prefills at 0.1 ms/token: 200 new tokens stall the holder's batch ~20 ms.
    router = await make_router(local={"enabled": True, "max_stall_s": 0.005, "slice_tokens": 0})
    first, engine = await held_session(router)

    with engine.busy():  # a sequence of another session decoding on the holder
        response = await router.chat(tool_result(first, 200), session="s1")
    assert response.headers["x-agentkv-kv-path"] == "reuse"

    second = tool_result(first, 200)
    response = await router.chat(tool_result(second, 200), session="s1")  # holder idle again
    assert response.headers["x-agentkv-kv-path"] == "local"


async def test_busy_holder_takes_a_sliced_part_and_says_what_it_costs_its_batch(make_router):
    # 200 new tokens at the stub's 0.1 ms/token: ~20 ms in one step (over the budget: the test
    # above), 4 ms in slices of 40, and tried while the holder's streams have shown no cost,
    # as it saves more than that bound's ~25 ms: a pull costs 0.1 s more here.
    router = await make_router(
        local={"enabled": True, "max_stall_s": 0.005, "slice_tokens": 40},
        cost={"pull_overhead_s": 0.1},
    )
    first, engine = await held_session(router)

    with engine.busy():
        response = await router.chat(tool_result(first, 200), session="s1")

    assert response.headers["x-agentkv-kv-path"] == "local"
    timing = dict(
        entry.strip().split(";dur=") for entry in response.headers["server-timing"].split(",")
    )
    assert float(timing["stall"]) > 0  # ms per decode step of the holder's batch (predicted)
    decisions = 'agentkv_path_decisions_total{path="local",reason="local_fastest"}'
    assert await router.metric(decisions) == 1
    assert await router.metric("agentkv_local_added_itl_seconds_count") == 1


async def test_a_local_turn_is_priced_with_the_local_prefills_already_on_its_holder(make_router):
    """Two local turns at once put two slices in each of the holder's steps. Measured on the
    two-decoder bench: two 1k-token follow-ups went local together and the decoders' steps took
    0.40-0.41 s where one such turn's took 0.22-0.23 s, under a budget of 0.2 s added."""
    # At the stubs' scale (0.1 ms a token): 2.5 ms added at 1000 tokens, ~1.8 ms for this
    # turn's ~730 alone, ~5.6 ms beside another of 1500: a budget of 3 ms takes one, not both.
    # (The share of gaps beside local prefills aside: a window of 2000 gaps is not simulated.)
    local = {"enabled": True, "max_stall_s": 0.003, "slice_tokens": 40, "max_slowed_share": 1}
    router = await make_router(local=local)
    first, engine = await held_session(router)
    for _ in range(50):  # the holder's streams: plain steps, then a ~1000-token local prefill
        engine.steps.observe(0.008)
    with engine.steps.local_prefill(1000):
        for _ in range(6):
            engine.steps.observe(0.0105)

    with engine.busy():
        alone = await router.chat(tool_result(first, 200), session="s1")
    assert (alone.headers["x-agentkv-kv-path"], plan_reason(alone)) == ("local", "local_fastest")

    second = tool_result(first, 200)
    with engine.busy(), engine.steps.local_prefill(1500):  # another session's, prefilling now
        stacked = await router.chat(tool_result(second, 200), session="s1")
    assert (stacked.headers["x-agentkv-kv-path"], plan_reason(stacked)) == (
        "reuse",
        "stall_over_budget",
    )


async def test_a_holder_whose_recent_gaps_ran_beside_local_prefills_sends_the_turn_to_p(
    make_router,
):
    router = await make_router(local={"enabled": True, "slice_tokens": 40})
    first, engine = await held_session(router)
    for _ in range(50):
        engine.steps.observe(0.008)
    with engine.steps.local_prefill(1000):  # 10 of its 60 gaps: the share is spent
        for _ in range(10):
            engine.steps.observe(0.0085)

    with engine.busy():
        response = await router.chat(tool_result(first, 200), session="s1")

    assert (response.headers["x-agentkv-kv-path"], plan_reason(response)) == (
        "reuse",
        "tail_over_budget",
    )
    decisions = 'agentkv_path_decisions_total{path="reuse",reason="tail_over_budget"}'
    assert await router.metric(decisions) == 1
    share = f'agentkv_local_slowed_gap_share{{engine="{engine.url}"}}'
    assert await router.metric(share) == pytest.approx(10 / 60)
    for _ in range(TAIL_WINDOW_GAPS):  # its tail clean again: local
        engine.steps.observe(0.008)
    assert await router.metric(share) == 0
    with engine.busy():
        again = await router.chat(tool_result(tool_result(first, 200), 200), session="s1")
    assert again.headers["x-agentkv-kv-path"] == "local"


@pytest.mark.parametrize(
    ("peer_measured", "path", "reason"),
    [(False, "reuse", "local_slows_others"), (True, "local", "local_fastest")],
)
async def test_a_holder_not_yet_measured_is_priced_by_what_the_other_decoder_measured(
    make_router, peer_measured, path, reason
):
    """Until the holder's streams have shown what slices cost, the other decode engines' do.
    With a pull 10 ms slower than the local turn: at the bound (a slice's whole prefill time
    added to each step) the turn would cost the holder's sequence more than it saves, and
    pulls; at what the other decoder measured (0.4 ms a step for this prompt) it goes local."""
    router = await make_router(
        n_decode=2,  # (the tail budget aside: 50 gaps seen leave no share for 5 slices)
        local={"enabled": True, "max_stall_s": 0.005, "slice_tokens": 40, "max_slowed_share": 1},
        cost={"pull_overhead_s": 0.01},
    )
    first = conversation(1, 500)
    await router.chat(first, session="s1")
    (holder,) = [router.state.decode.get(d.url) for d in router.decode if d.requests]
    (peer,) = [e for e in router.state.decode.engines if e is not holder]
    assert holder is not None
    for engine in (holder, peer):  # both decoders' streams: plain steps
        for _ in range(50):
            engine.steps.observe(0.008)
    if peer_measured:  # a local prefill of 1000 tokens on the other decoder added 0.5 ms a step
        with peer.steps.local_prefill(1000):
            for _ in range(6):
                peer.steps.observe(0.0085)

    with holder.busy():
        response = await router.chat(tool_result(first, 200), session="s1")

    assert (response.headers["x-agentkv-kv-path"], plan_reason(response)) == (path, reason)
    assert holder.steps.added_s(1000) is None  # the holder's own cost: still unmeasured


async def test_streamed_local_turn_teaches_the_local_rate(make_router):
    router = await make_router(local=LOCAL_ON)
    first = conversation(1, 300)
    await router.chat(first, session="s1", stream=True)
    policy = router.state.policy
    assert isinstance(policy, CostModelPolicy)
    before = policy.predicted_local_s(100)

    response = await router.chat(tool_result(first, 100), session="s1", stream=True)

    assert response.headers["x-agentkv-kv-path"] == "local"
    assert response.text.rstrip().endswith("data: [DONE]")
    assert "decode;dur=" in response.headers["server-timing"]
    assert policy.predicted_local_s(100) != before
    assert await router.state.store.take("s1") is not None  # reported by the holder


async def test_streamed_turn_after_a_prefill_step_teaches_the_handoff(make_router):
    router = await make_router(local=LOCAL_ON)
    policy = router.state.policy
    assert isinstance(policy, CostModelPolicy)
    assert policy.handoff_s == 0.0

    response = await router.chat(conversation(1, 300), session="s1", stream=True)

    assert response.headers["x-agentkv-kv-path"] == "recompute"  # P, then D read its blocks
    assert policy.handoff_s > 0.0


@pytest.mark.parametrize("fault", ["error", "disconnect"])
async def test_holder_failing_a_local_turn_is_recomputed_elsewhere(make_router, fault):
    router = await make_router(n_decode=2, local=LOCAL_ON)
    first = conversation(1, 500)
    await router.chat(first, session="s1")
    holder, other = router.decode if router.decode[0].retained else list(reversed(router.decode))
    holder.faults.append(fault)
    prefill_steps = len(router.prefill[0].completions())

    response = await router.chat(tool_result(first, 20), session="s1")

    assert response.status_code == 200
    assert response.headers["x-agentkv-kv-path"] == "fallback"
    cold = router.prefill[0].completions()[prefill_steps:]
    assert [step.kv_params.get("remote_engine_id") for step in cold] == [None]
    assert other.completions()  # served by the other decode engine
    holding = await router.state.store.take("s1")
    assert holding is not None and holding.decode_url == other.url


async def test_dead_holder_is_never_planned_local(make_router):
    router = await make_router(n_decode=2, local=LOCAL_ON)
    first = conversation(1, 500)
    await router.chat(first, session="s1")
    holder = router.decode[0] if router.decode[0].retained else router.decode[1]
    await holder.stop()

    response = await router.chat(tool_result(first, 20), session="s1")

    assert response.status_code == 200
    assert response.headers["x-agentkv-kv-path"] in ("fallback", "recompute")
    assert router.prefill[0].pulled == []


async def test_never_policy_does_not_count_tokens(make_router):
    router = await make_router(policy="never", local=LOCAL_ON)
    first = conversation(1, 500)
    await router.chat(first, session="s1")
    response = await router.chat(tool_result(first, 20), session="s1")

    assert response.headers["x-agentkv-kv-path"] == "recompute"
    assert not any(r.path == "/tokenize" for e in router.cluster.engines for r in e.requests)
