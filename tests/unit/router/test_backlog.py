"""A prefill engine's backlog as the local path's choice sees it: the service its steps in
flight still need, each priced by the tokens it computes, their waits in the queue excluded."""

from __future__ import annotations

import asyncio

import pytest

from agentkv_server.router import CostModelPolicy, KVPath, TurnHints, TurnLoad
from agentkv_server.router.intake import ClientRequest
from agentkv_server.router.placement import EnginePool
from agentkv_server.router.queue import StepQueue
from agentkv_server.router.sessions import Holding
from agentkv_server.router.tokens import PromptSizes
from agentkv_server.settings import CostModelSettings, LocalPathSettings, RetentionSettings
from agentkv_server.testing import ManualClock
from agentkv_server.testing.harness import conversation, plan_reason, tool_result

NOW = 1000.0


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> ManualClock:
    clock = ManualClock(now=10.0)
    monkeypatch.setattr("agentkv_server.router.queue.time.monotonic", clock)
    return clock


def test_a_step_that_waited_counts_only_its_service(clock: ManualClock) -> None:
    queue = StepQueue()
    assert queue.backlog_s() == 0.0  # nothing served yet: nothing to price a queue by
    with queue.step(1000) as first, queue.step(1000) as second, queue.step(1000) as third:
        clock.now = 12.0
        queue.served(first)  # found P idle: 2 s of service
        clock.now = 14.0
        queue.served(second)  # sent at 10, waited 2 s behind the first: served in 2
        clock.now = 16.0
        queue.served(third)
    assert queue.service_s(1000) == pytest.approx(2.0, rel=0.05)


def test_the_backlog_weighs_each_step_in_flight_by_the_tokens_it_computes(
    clock: ManualClock,
) -> None:
    """Found on the pressure preset: a follow-up's pull waited 13.8 s on P behind other
    sessions' cold first turns, where steps in flight times their mean service (pulls of a
    few hundred tokens among them) predicted a few seconds, too few to send it local."""
    queue = StepQueue()
    for tokens, seconds in [(200, 0.3), (4000, 3.0)] * 5:  # pulls and cold first turns
        with queue.step(tokens) as step:
            clock.now += seconds
            queue.served(step)
    assert queue.service_s(200) == pytest.approx(0.3, abs=0.05)
    assert queue.service_s(4000) == pytest.approx(3.0, abs=0.1)

    with queue.step(4000), queue.step(4000), queue.step(4000):
        assert queue.backlog_s() == pytest.approx(9.0, abs=0.3)
        clock.now += 1.0  # the oldest has been served for a second
        assert queue.backlog_s() == pytest.approx(8.0, abs=0.3)
    with queue.step(200), queue.step(200), queue.step(200):
        assert queue.backlog_s() == pytest.approx(0.9, abs=0.15)
    assert queue.backlog_s() == 0.0


def test_a_prompt_no_engine_counted_is_sized_by_its_body() -> None:
    sizes = PromptSizes(tokens_per_byte=0.25)
    request = ClientRequest("chat", {}, "m", False, "s", TurnHints(), {}, body_bytes=8000)
    assert sizes.estimate(request) == 2000
    for _ in range(50):  # this deployment's prompts run 6 bytes a token
        sizes.observe(request, 8000 // 6)
    assert sizes.estimate(request) == pytest.approx(8000 / 6, rel=0.02)
    sizes.observe(ClientRequest("chat", {}, "m", False, "s", TurnHints(), {}), 100)  # no size
    assert sizes.estimate(request) == pytest.approx(8000 / 6, rel=0.02)


def test_a_queue_on_the_prefill_engines_sends_a_busy_holders_turn_local() -> None:
    """Found on the pressure preset: follow-ups pulled behind other sessions' first turns on P
    (prefill steps of 10-22 s) while their holder could have answered in under a second."""
    policy = CostModelPolicy(
        CostModelSettings(prefill_tokens_per_s=2000, pull_tokens_per_s=50000),
        RetentionSettings(),
        LocalPathSettings(slice_tokens=64, max_stall_s=0.2),
    )
    for _ in range(30):  # the holder, busy, prefills 160 tokens in 1.2 s; a pull costs 0.2 s
        policy.observe_local(160, 1.2, holder_busy=True)
    held = Holding("s", "http://d", "m", {}, 2000, NOW + 300, NOW - 1)
    quiet = TurnLoad(160, holder_running=2, holder_added_s=0.1)
    assert policy.decide(held, NOW, quiet).path is KVPath.PULL
    queued = TurnLoad(160, holder_running=2, holder_added_s=0.1, prefill_wait_s=10.0)
    decision = policy.decide(held, NOW, queued)
    assert (decision.path, decision.reason) == (KVPath.LOCAL, "local_fastest")
    leaving = Holding("s", "http://d", "m", {}, 2000, NOW + 8, NOW - 1)  # gone before P reads
    # Over the budget, 3 slices x 0.5 s x 2 sequences (3 s) cost less than P's queue saves.
    over = TurnLoad(160, holder_running=2, holder_added_s=0.5, prefill_wait_s=10.0)
    assert policy.decide(leaving, NOW, over).reason == "local_over_budget"
    crowded = TurnLoad(160, holder_running=10, holder_added_s=0.5, prefill_wait_s=10.0)
    assert policy.decide(leaving, NOW, crowded).reason == "expiring"  # 15 s would not


async def test_a_long_follow_up_on_p_sends_a_busy_holders_follow_up_local(make_router) -> None:
    """Through the router: another session's follow-up with a long new part, in flight on P,
    is what a follow-up sent to P would wait for (a new session's prompt in flight is not: P
    computes it a slice at a time beside the follow-up).

    A follow-up over the stall budget (its ~200 new tokens in one step stall the holder's ten
    running sequences ~20 ms each) pulls while P is idle, and goes local while P computes the
    other session's 10,000 new tokens (~1 s at the stubs' 0.1 ms a token), which the
    session's own first turn, 500 tokens, taught P's queue to price.
    """
    router = await make_router(local={"enabled": True, "max_stall_s": 0.005, "slice_tokens": 0})
    first = conversation(1, 500)
    await router.chat(first, session="s1")
    await router.chat(first, session="s2")
    holder = router.state.decode.get(router.decode[0].url)
    prefill = router.state.prefill.get(router.prefill[0].url)
    assert holder is not None and prefill is not None

    holder.inflight += 10  # ten sequences of other sessions decoding on the holder
    try:
        idle_p = await router.chat(tool_result(first, 200), session="s1")
        long_follow_up = asyncio.create_task(router.chat(tool_result(first, 10_000), session="s2"))
        while not prefill.inflight:
            await asyncio.sleep(0.005)
        queue_s = await router.metric("agentkv_prefill_queue_seconds")
        second = tool_result(first, 200)
        queued_p = await router.chat(tool_result(second, 200), session="s1")
        await long_follow_up
    finally:
        holder.inflight -= 10

    assert (idle_p.headers["x-agentkv-kv-path"], plan_reason(idle_p)) == (
        "reuse",
        "stall_over_budget",
    )
    assert (queued_p.headers["x-agentkv-kv-path"], plan_reason(queued_p)) == (
        "local",
        "local_over_budget",
    )
    assert 0.5 < queue_s < 2.0  # as scraped: the 10,000 new tokens' ~1 s, and visible
    assert await router.metric("agentkv_prefill_queue_seconds") == 0.0  # once it is served


async def test_the_prefill_rate_is_learned_from_p_s_service_not_its_queue(make_router) -> None:
    """Found on the two-decoder bench: two sessions' cold 4k-token first turns sent together
    (the second waited for the first on P's one core) taught the prefill line an intercept of
    5.5 s, every follow-up at 4k was then predicted to take 5.9 s through P and went local
    beside the decoders. The wait is P's queue, which the policy prices apart."""
    router = await make_router()
    router.prefill[0].one_prompt_at_a_time = True  # ~1 s each: the second waits ~1 s more
    await asyncio.gather(
        router.chat(conversation(1, 10_000), session="a"),
        router.chat(conversation(1, 10_000), session="b"),
    )
    policy = router.state.policy
    assert isinstance(policy, CostModelPolicy)
    assert policy.prefill_s_per_token == pytest.approx(1e-4, rel=0.15)  # the stubs' rate


def test_a_step_goes_to_the_prefill_engine_with_the_shortest_queue_not_the_fewest_steps(
    clock: ManualClock,
) -> None:
    pool = EnginePool("prefill", ["http://p0", "http://p1"])
    cold_first_turns, pulls = pool.engines
    for engine in pool.engines:  # both serve 1000 tokens a second
        with engine.queue.step(1000) as step:
            clock.now += 1.0
            engine.queue.served(step)
    with cold_first_turns.queue.step(4000), pulls.queue.step(200), pulls.queue.step(200):
        cold_first_turns.inflight, pulls.inflight = 1, 2
        assert pool.pick() is pulls
