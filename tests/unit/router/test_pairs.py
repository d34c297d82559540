"""Pair health: a (P, D) pair whose KV reads fail is avoided, retried later, and recovers."""

from __future__ import annotations

from typing import Any

import pytest

from agentkv_server.errors import ConfigError
from agentkv_server.router.metrics import RouterMetrics
from agentkv_server.router.pairs import PairHealth, take_kv_load
from agentkv_server.router.placement import EnginePool
from agentkv_server.settings import PairSettings, load_settings
from agentkv_server.testing import InProcessRouter, ManualClock, conversation

P, P2 = "http://p0", "http://p1"
D1, D2 = "http://d1", "http://d2"


def health(
    clock: ManualClock, metrics: RouterMetrics | None = None, **settings: float
) -> PairHealth:
    return PairHealth(PairSettings(**settings), metrics=metrics, clock=clock)


def test_a_failed_transfer_makes_the_pair_bad_until_its_retry_time() -> None:
    clock = ManualClock()
    pairs = health(clock)

    pairs.record(P, D1, ok=False)

    assert pairs.state(P, D1) == "bad"
    assert pairs.state(P, D2) == "good"  # pairs are independent
    assert pairs.state(P2, D1) == "good"
    clock.now += 9.9
    assert pairs.state(P, D1) == "bad"
    clock.now += 0.1
    assert pairs.state(P, D1) == "retry"


def test_failures_in_a_row_double_the_wait_up_to_the_maximum() -> None:
    clock = ManualClock()
    pairs = health(clock)
    waits = []
    for _ in range(7):
        pairs.record(P, D1, ok=False)
        failed_at = clock.now
        while pairs.state(P, D1) != "retry":
            clock.now += 1.0
        waits.append(clock.now - failed_at)

    assert waits == [10, 20, 40, 80, 160, 160, 160]


def test_one_good_transfer_makes_a_bad_pair_good_at_once() -> None:
    clock = ManualClock()
    pairs = health(clock)
    for _ in range(3):
        pairs.record(P, D1, ok=False)

    pairs.record(P, D1, ok=True)

    assert pairs.state(P, D1) == "good"
    pairs.record(P, D1, ok=False)  # and the backoff starts again from retry_s
    clock.now += 10.0
    assert pairs.state(P, D1) == "retry"


def decode_pool() -> EnginePool:
    return EnginePool("decode", [D1, D2], last_resort=True)


def test_a_decode_engine_whose_pair_with_p_is_bad_is_avoided() -> None:
    pairs = health(ManualClock())
    pool = decode_pool()
    pairs.record(P, D1, ok=False)

    picked = {pairs.pick(pool, P).url for _ in range(4)}

    assert picked == {D2}
    assert pairs.pick(pool, P, prefer=D1).url == D2  # not even as the holder
    assert {pairs.pick(pool, P2).url for _ in range(4)} == {D1, D2}  # another P's pairs
    assert {pool.pick().url for _ in range(4)} == {D1, D2}  # the pool alone would use it


def test_a_bad_pair_is_used_when_no_good_pair_exists() -> None:
    pairs = health(ManualClock())
    pool = decode_pool()
    pairs.record(P, D1, ok=False)
    pairs.record(P, D2, ok=False)

    assert {pairs.pick(pool, P).url for _ in range(4)} == {D1, D2}
    assert pairs.pick(pool, P, prefer=D1).url == D1


def test_engine_health_comes_before_pair_health() -> None:
    pairs = health(ManualClock())
    pool = decode_pool()
    pairs.record(P, D2, ok=False)
    pool.get(D1).healthy = False  # D1 forms the good pair but is down

    assert pairs.pick(pool, P).url == D2
    pool.get(D2).healthy = False  # all down: the pool's last resort, least loaded
    assert pairs.pick(pool, P) is not None


def test_a_pair_past_its_retry_time_gets_one_turn_per_wait() -> None:
    clock = ManualClock()
    pairs = health(clock)
    pool = decode_pool()
    pairs.record(P, D1, ok=False)
    clock.now += 10.0

    looked = pairs.pick(pool, P, trial=False)  # a step that moves no KV over the pair
    assert (looked.url, pairs.state(P, D1)) == (D1, "retry")
    trial = pairs.pick(pool, P, prefer=D2)  # the trial goes first, even over a preference
    after = [pairs.pick(pool, P).url for _ in range(3)]
    clock.now += 10.0  # its outcome never came (no report): tested again after the same wait

    assert trial.url == D1
    assert after == [D2] * 3
    assert pairs.pick(pool, P).url == D1
    pairs.record(P, D1, ok=False)  # the trial failed: twice the wait
    clock.now += 19.0
    assert pairs.state(P, D1) == "bad"


def test_a_prefill_engine_is_picked_by_its_pair_with_the_holder() -> None:
    pairs = health(ManualClock())
    pool = EnginePool("prefill", [P, P2])
    pairs.record(P, D1, ok=False)

    assert {pairs.pick(pool, D1).url for _ in range(4)} == {P2}
    assert {pairs.pick(pool, D2).url for _ in range(4)} == {P, P2}
    assert {pairs.pick(pool, None).url for _ in range(4)} == {P, P2}


def loaded(outcome: str) -> dict[str, Any]:
    return {"remote_num_tokens": 5, "agentkv_kv_load": outcome, "agentkv_kv_load_from": "p-id"}


def test_the_outcome_is_read_from_params_and_taken_out_of_them() -> None:
    params = loaded("failed")
    assert take_kv_load(params) is False
    assert params == {"remote_num_tokens": 5}
    synchronous = {**loaded("ok"), "agentkv_kv_load_sync": True}
    assert take_kv_load(synchronous) is True
    assert synchronous == {"remote_num_tokens": 5}
    assert take_kv_load({"remote_num_tokens": 5}) is None
    assert take_kv_load(loaded("later")) is None
    assert take_kv_load(None) is None


def test_a_ticketed_step_counts_once_from_its_answer_or_its_report() -> None:
    metrics = RouterMetrics()
    pairs = health(ManualClock(), metrics)
    pairs.expect("t1", P, D1)

    pairs.record_ticket("t1", loaded("failed"))  # the answer
    pairs.record_ticket("t1", loaded("failed"))  # the report of the same step
    pairs.record_ticket("t2", loaded("failed"))  # a ticket it did not issue (another replica's)

    assert pairs.state(P, D1) == "bad"
    failed = {"prefill": P, "decode": D1, "outcome": "failed"}
    assert metrics.registry.get_sample_value("agentkv_pair_transfers_total", failed) == 1


def test_metrics_show_each_pairs_health_and_transfers() -> None:
    metrics = RouterMetrics()
    pairs = PairHealth(
        PairSettings(), metrics=metrics, pairs=[(P, D1), (P, D2)], clock=ManualClock()
    )

    def healthy(decode: str) -> float | None:
        return metrics.registry.get_sample_value(
            "agentkv_pair_healthy", {"prefill": P, "decode": decode}
        )

    assert (healthy(D1), healthy(D2)) == (1, 1)  # every pair from the start
    pairs.record(P, D1, ok=False)
    assert (healthy(D1), healthy(D2)) == (0, 1)
    pairs.record(P, D1, ok=True)
    assert healthy(D1) == 1
    ok = {"prefill": P, "decode": D1, "outcome": "ok"}
    assert metrics.registry.get_sample_value("agentkv_pair_transfers_total", ok) == 1


def test_settings_defaults_and_order() -> None:
    defaults = load_settings({"decode_urls": [D1]}).pairs
    assert (defaults.retry_s, defaults.max_retry_s) == (10.0, 160.0)
    with pytest.raises(ConfigError, match="retry_s must not exceed max_retry_s"):
        load_settings({"decode_urls": [D1], "pairs": {"retry_s": 20, "max_retry_s": 10}})


# -- through the router, in front of stub engines -------------------------------------------


def pair_metric(router: InProcessRouter, name: str, decode: int, **labels: str) -> str:
    """One series of a pair metric of P 0 and D ``decode`` (labels as /metrics sorts them)."""
    labels |= {"prefill": router.prefill[0].url, "decode": router.decode[decode].url}
    return name + "{" + ",".join(f'{key}="{labels[key]}"' for key in sorted(labels)) + "}"


async def turn_on(router: InProcessRouter, **body: Any) -> int:
    """One P/D turn; the index of the decode engine that served it."""
    before = [len(engine.completions()) for engine in router.decode]
    response = await router.chat(conversation(1, 100), **body)
    assert response.status_code == 200
    assert "agentkv_kv_load" not in response.text
    served = [len(e.completions()) - n for e, n in zip(router.decode, before, strict=True)]
    assert sorted(served) == [0, 1]
    return served.index(1)


async def test_turns_avoid_a_pair_whose_reads_fail_then_retry_it_and_recover(make_router):
    router = await make_router(n_decode=2)
    clock = ManualClock()
    router.state.orchestrator.pairs.clock = clock
    d1 = router.decode[0]
    d1.kv_load_fails = True
    served = [await turn_on(router) for _ in range(2)]  # idle D engines take turns
    assert served.count(0) == 1
    healthy_d1 = pair_metric(router, "agentkv_pair_healthy", 0)
    assert await router.metric(healthy_d1) == 0
    assert await router.metric(pair_metric(router, "agentkv_pair_healthy", 1)) == 1
    failed = pair_metric(router, "agentkv_pair_transfers_total", 0, outcome="failed")
    assert await router.metric(failed) == 1

    avoided = [await turn_on(router) for _ in range(4)]

    assert avoided == [1] * 4
    d1.kv_load_fails = False  # the link is back; the router learns it only by trying
    clock.now += 10.0
    trial = await turn_on(router)
    assert trial == 0
    assert await router.metric(healthy_d1) == 1
    ok = pair_metric(router, "agentkv_pair_transfers_total", 0, outcome="ok")
    assert await router.metric(ok) == 1
    assert sorted([await turn_on(router) for _ in range(2)]) == [0, 1]  # both pairs in use


async def test_a_streamed_turns_outcome_comes_in_its_holding_report(make_router):
    # vLLM's chat stream carries no kv_transfer_params: D's connector reports them.
    router = await make_router(n_decode=2)
    for engine in router.decode:
        engine.kv_load_fails = True

    served = await turn_on(router, session="s1", stream=True)

    assert await router.metric(pair_metric(router, "agentkv_pair_healthy", served)) == 0
    assert await router.metric(pair_metric(router, "agentkv_pair_healthy", 1 - served)) == 1
    failed = pair_metric(router, "agentkv_pair_transfers_total", served, outcome="failed")
    assert await router.metric(failed) == 1
    assert await router.metric("agentkv_sessions_held") == 1  # the holding still counts


async def test_a_pull_goes_through_a_prefill_engine_whose_pair_with_the_holder_works(
    make_router,
):
    router = await make_router(n_prefill=2)
    holder = router.decode[0]
    holder.kv_load_fails = True
    await router.chat(conversation(1, 500), session="s1")
    bad_p = next(i for i, engine in enumerate(router.prefill) if engine.completions())
    holder.kv_load_fails = False

    pulls = [await router.chat(conversation(turn, 500), session="s1") for turn in (2, 3)]

    assert [r.headers["x-agentkv-kv-path"] for r in pulls] == ["reuse", "reuse"]
    assert len(router.prefill[bad_p].completions()) == 1
    good_p = router.prefill[1 - bad_p]
    assert len(good_p.completions()) == 2  # both pulls went the other way
    # The holding's params, sent on to P, no longer carry the outcome D returned with them.
    assert "agentkv_kv_load" not in good_p.completions()[0].kv_params
