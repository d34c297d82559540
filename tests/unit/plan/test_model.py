"""Physics sanity of the cluster model: costs move the way the hardware says they must."""

from __future__ import annotations

import dataclasses

import pytest

from agentkv_server.plan import SERVINGS, ClusterModel
from agentkv_server.plan.catalog import ITL_SLO

HISTORIES = [2048 * 2**i for i in range(7)]


@pytest.fixture(params=sorted(SERVINGS))
def model(request) -> ClusterModel:
    return ClusterModel(SERVINGS[request.param])


def test_pull_cost_grows_with_history(model) -> None:
    pulls = [model.pull_s(h) for h in HISTORIES]
    loads = [model.kv_load_s(h) for h in HISTORIES]
    assert pulls == sorted(pulls) and len(set(pulls)) == len(pulls)
    assert loads == sorted(loads) and len(set(loads)) == len(loads)


def test_recompute_grows_superlinearly(model) -> None:
    # Attention's quadratic term (the sparse-attention indexer's for GLM) takes over from 16k.
    for short in HISTORIES[3:-1]:
        assert model.prefill_s(2 * short, 0) > 2 * model.prefill_s(short, 0)
    assert model.prefill_s(HISTORIES[-1], 0) > 2.2 * model.prefill_s(HISTORIES[-2], 0)


def test_pull_grows_slower_than_recompute(model) -> None:
    gains = [model.recompute_s(h) / model.pull_s(h) for h in HISTORIES]
    assert gains == sorted(gains)
    assert gains[-1] > 2


def test_recompute_beats_pull_on_short_histories(model) -> None:
    # A pull pays a fixed handover; recomputing 2k tokens on 8 H200s is cheaper.
    assert model.recompute_s(2048) < model.pull_s(2048)


def test_session_limit_is_the_decode_memory(model) -> None:
    for history in HISTORIES:
        limit = model.session_limit(history)
        per_session = history + model.workload.new_tokens + model.workload.output_tokens
        capacity = model.kv_capacity_tokens()
        assert limit * per_session <= capacity < (limit + 1) * per_session
    limits = [model.session_limit(h) for h in HISTORIES]
    assert limits == sorted(limits, reverse=True) and limits[-1] >= 1


def test_over_the_memory_limit_only_recompute_is_left(model) -> None:
    history = HISTORIES[-1]
    over = model.follow_up(history, model.session_limit(history) + 1)
    assert over.seconds["pull"] is None and over.seconds["holder"] is None
    assert over.best == "recompute"
    at_limit = model.follow_up(history, model.session_limit(history))
    assert at_limit.seconds["pull"] is not None


def test_weights_leave_room_for_kv_and_the_capacity_follows_hbm(model) -> None:
    capacity = model.kv_capacity_tokens()
    bigger = ClusterModel(
        model.serving, gpu=dataclasses.replace(model.gpu, hbm_bytes=model.gpu.hbm_bytes * 1.5)
    )
    assert 0 < capacity < bigger.kv_capacity_tokens()


def test_a_loaded_decode_engine_slows_the_holder_path(model) -> None:
    history = 32768
    alone = model.follow_up(history, 1)
    loaded = model.follow_up(history, model.session_limit(history))
    assert loaded.seconds["holder"] > alone.seconds["holder"]
    assert alone.holder_allowed


def test_policy_picks_the_fastest_path_the_itl_budget_allows(model) -> None:
    for row in model.sweep(HISTORIES, 3):
        allowed = {
            p: s
            for p, s in row.seconds.items()
            if s is not None and (p != "holder" or row.holder_allowed)
        }
        assert row.seconds[row.best] == min(allowed.values())
        assert row.margins()[row.best] == 1.0


def test_a_tighter_itl_budget_turns_the_holder_path_away() -> None:
    serving = SERVINGS["qwen3-32b"]
    workload = dataclasses.replace(ClusterModel(serving).workload, new_tokens=8192)
    loose = ClusterModel(serving, workload=workload)
    strict = ClusterModel(
        serving, workload=workload, slo=dataclasses.replace(ITL_SLO, itl_budget_s=0.001)
    )
    assert loose.follow_up(16384, 1).best == "holder"  # nobody else to stall
    assert strict.follow_up(16384, 20).best != "holder"


def test_faster_links_make_pulls_cheaper() -> None:
    serving = SERVINGS["glm-5-fp8"]
    slow = ClusterModel(serving)
    fast = ClusterModel(serving, link=dataclasses.replace(slow.link, efficiency=1.0))
    assert fast.pull_s(65536) < slow.pull_s(65536)
    assert fast.recompute_s(65536) == pytest.approx(slow.recompute_s(65536), rel=1e-3)
