"""The third path: a turn continues on its decode holder, chosen by predicted TTFT and budget."""

from __future__ import annotations

import logging

import pytest

from agentkv_server.router import (
    AlwaysPolicy,
    CostModelPolicy,
    KVPath,
    NeverPolicy,
    TurnLoad,
    UpstreamPolicy,
)
from agentkv_server.router.sessions import Holding
from agentkv_server.settings import CostModelSettings, LocalPathSettings, RetentionSettings
from agentkv_server.testing.harness import conversation, words

NOW = 1000.0
LOCAL_ON = {"enabled": True}


def held(tokens: int, remaining_s: float = 100.0) -> Holding:
    return Holding("s", "http://d", "m", {}, tokens, NOW + remaining_s, NOW - 1)


def cost_model(**local: object) -> CostModelPolicy:
    cost = CostModelSettings(
        prefill_tokens_per_s=2000,
        pull_tokens_per_s=50000,
        pull_overhead_s=0.05,
    )
    return CostModelPolicy(cost, RetentionSettings(), LocalPathSettings(**local))


def idle(new_tokens: int) -> TurnLoad:
    return TurnLoad(new_tokens=new_tokens, holder_running=0)


# -- the decision ------------------------------------------------------------------------


def test_short_follow_up_continues_on_the_holder():
    decision = cost_model().decide(held(3000), NOW, idle(150))
    assert (decision.path, decision.reason) == (KVPath.LOCAL, "local_fastest")
    assert not decision.reuse  # no prefill engine pulls


def test_new_part_over_the_limit_goes_to_a_prefill_engine():
    policy = cost_model(max_new_tokens=512)
    assert policy.decide(held(3000), NOW, idle(512)).path is KVPath.LOCAL
    decision = policy.decide(held(3000), NOW, idle(513))
    assert (decision.path, decision.reason) == (KVPath.PULL, "new_part_too_long")


def test_stall_budget_applies_only_while_the_holder_decodes_others():
    policy = cost_model(max_stall_s=0.1)  # 0.1 s at 2000 tok/s: 200 new tokens
    assert policy.decide(held(3000), NOW, TurnLoad(300, holder_running=0)).path is KVPath.LOCAL
    assert policy.decide(held(3000), NOW, TurnLoad(200, holder_running=4)).path is KVPath.LOCAL
    decision = policy.decide(held(3000), NOW, TurnLoad(300, holder_running=4))
    assert (decision.path, decision.reason) == (KVPath.PULL, "stall_over_budget")


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


def tool_result(history: list[dict], n_words: int) -> list[dict]:
    return [*history, {"role": "assistant", "content": "w0 w1 w2 w3"},
            {"role": "tool", "content": words(n_words, "t")}]  # fmt: skip


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
    # The local turn's KV is the session's holding now; the old lease was released.
    holding = await router.state.store.take("s1")
    assert holding is not None and holding.decode_url == holder.url
    assert holding.num_tokens == (500 + 2) + (2 + 2) + (4 + 2) + (20 + 2) + 4  # prompt, output
    await router.state.keeper.drain()  # releases run in the background
    assert old_id in holder.released
    assert await router.metric('agentkv_turns_total{path="local"}') == 1
    assert await router.metric("agentkv_reused_tokens_total") == held
    assert "local (local_fastest)" in caplog.text
    assert "turn local: plan=" in caplog.text


async def test_long_tool_result_is_pulled_to_prefill(make_router):
    router = await make_router(local={"enabled": True, "max_new_tokens": 100})
    first = conversation(1, 500)
    await router.chat(first, session="s1")

    response = await router.chat(tool_result(first, 300), session="s1")

    assert response.headers["x-agentkv-kv-path"] == "reuse"
    assert len(router.prefill[0].pulled) == 1


async def test_busy_holder_keeps_a_mid_size_part_off_its_decode_batch(make_router):
    # The stub prefills at 0.1 ms/token: 200 new tokens stall the holder's batch ~20 ms.
    router = await make_router(local={"enabled": True, "max_stall_s": 0.005})
    first = conversation(1, 500)
    await router.chat(first, session="s1")
    engine = router.state.decode.get(router.decode[0].url)
    assert engine is not None

    with engine.busy():  # a sequence of another session decoding on the holder
        response = await router.chat(tool_result(first, 200), session="s1")
    assert response.headers["x-agentkv-kv-path"] == "reuse"

    second = tool_result(first, 200)
    response = await router.chat(tool_result(second, 200), session="s1")  # holder idle again
    assert response.headers["x-agentkv-kv-path"] == "local"


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
