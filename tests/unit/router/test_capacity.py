"""Retained KV within each decode engine's budget: the value ranking, the budget, releases by
reason, and holdings yielding to live turns (router/capacity.py, through the keeper and the app)."""

from __future__ import annotations

import asyncio
from json import loads
from types import SimpleNamespace
from typing import Any

import pytest

from agentkv_server.router.capacity import CapacityLedger, Held, Released, holding_value
from agentkv_server.router.holdings import HoldingKeeper
from agentkv_server.router.metrics import RouterMetrics
from agentkv_server.router.resilient_store import ResilientStore
from agentkv_server.router.sessions import Holding, InMemoryStore
from agentkv_server.settings import CapacitySettings
from agentkv_server.testing import ManualClock, conversation

URL = "http://d"
S_PER_TOKEN = 5e-4
CAPACITY = {"agentkv_kv_cache_tokens": 10_000, "agentkv_kv_bytes_per_token": 100.0}


def holding(session: str, tokens: int, clock: ManualClock, *, expires_in: float = 600.0) -> Holding:
    params = {"remote_request_id": f"req-{session}", **CAPACITY}
    return Holding(session, URL, "m", params, tokens, clock.now + expires_in, clock.now)


# The settings this file's figures are worked out for (half the KV for holdings; abandoned
# after 3 x the hinted gap + 5 s), whatever the defaults.
WORKED_OUT = {"retained_fraction": 0.5, "abandon_factor": 3.0, "abandon_slack_s": 5.0}


def ledger_with(clock: ManualClock, **settings: object) -> tuple[CapacityLedger, RouterMetrics]:
    metrics = RouterMetrics()
    ledger = CapacityLedger(
        CapacitySettings.model_validate({**WORKED_OUT, **settings}),
        metrics,
        default_gap_s=120.0,
        prefill_s_per_token=lambda: S_PER_TOKEN,
        clock=clock,
    )
    return ledger, metrics


def releases(metrics: RouterMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("agentkv_kv_releases_total", {"reason": reason})
    return value or 0.0


def value(held: Held, now: float) -> float:
    return holding_value(held, now, S_PER_TOKEN, 100.0)


# -- the value of a holding --------------------------------------------------------------


def test_a_session_about_to_return_is_worth_more_than_one_far_off():
    clock = ManualClock()
    soon = Held(holding("a", 2000, clock), clock.now, gap_s=2.0, confidence=1.0)
    far = Held(holding("b", 2000, clock), clock.now, gap_s=300.0, confidence=1.0)

    assert value(soon, clock.now) > 100 * value(far, clock.now)


def test_a_predicted_turn_is_worth_more_than_an_unpredicted_one_at_the_same_gap():
    clock = ManualClock()
    hinted = Held(holding("a", 2000, clock), clock.now, gap_s=10.0, confidence=1.0)
    unknown = Held(holding("b", 2000, clock), clock.now, gap_s=10.0, confidence=0.5)

    assert value(hinted, clock.now) == pytest.approx(2 * value(unknown, clock.now))


def test_a_turn_overdue_loses_its_chance():
    clock = ManualClock()
    held = Held(holding("a", 2000, clock), clock.now, gap_s=10.0, confidence=1.0)

    assert held.chance(clock.now + 10) == 1.0
    assert held.chance(clock.now + 20) == pytest.approx(1.0 / 2.718281828, rel=1e-6)
    assert value(held, clock.now + 30) < value(held, clock.now + 5) / 10


def test_the_value_is_seconds_saved_per_byte_second():
    clock = ManualClock()
    held = Held(holding("a", 2000, clock), clock.now, gap_s=4.0, confidence=1.0)
    # 2000 tokens recompute in 1 s, held 4 s at 200 kB: 1 / 800 000 s per byte-second.
    assert value(held, clock.now) == pytest.approx(1.0 / (2000 * 100.0 * 4.0))


# -- the budget ---------------------------------------------------------------------------


def test_a_holding_that_does_not_fit_releases_the_least_valuable():
    clock = ManualClock()
    ledger, metrics = ledger_with(clock)  # 10 000-token engine: 5 000 for holdings
    assert ledger.add(holding("far", 2000, clock), next_turn_s=300.0) == []
    assert ledger.add(holding("soon", 2000, clock), next_turn_s=2.0) == []

    victims = ledger.add(holding("next", 2000, clock), next_turn_s=5.0)

    assert [victim.session_key for victim in victims] == ["far"]
    assert ledger.engine(URL).held_tokens == 4000
    assert releases(metrics, "pressure") == 1


def test_the_new_holding_itself_goes_when_it_is_worth_least():
    clock = ManualClock()
    ledger, _ = ledger_with(clock)
    ledger.add(holding("a", 2000, clock), next_turn_s=2.0)
    ledger.add(holding("b", 2000, clock), next_turn_s=3.0)

    victims = ledger.add(holding("late", 2000, clock), next_turn_s=None)

    assert [victim.session_key for victim in victims] == ["late"]
    assert set(ledger.engine(URL).held) == {"a", "b"}


def test_holdings_occupy_whole_blocks():
    clock = ManualClock()
    ledger, _ = ledger_with(clock)
    blocks = {**CAPACITY, "agentkv_hash_block_size": 16}
    ledger.add(Holding("a", URL, "m", blocks, 310, clock.now + 600, clock.now), 60.0)
    ledger.add(Holding("b", URL, "m", blocks, 320, clock.now + 600, clock.now), 1.0)

    assert ledger.engine(URL).held_tokens == 320 + 320
    # 630 + 9361 tokens (a 9360-token prompt and its first output token) would fit in 10 000;
    # in whole blocks, 640 + 9376 do not.
    assert [victim.session_key for victim in ledger.make_room(URL, 9360, running=0)] == ["a"]


def test_the_budget_is_the_configured_share_of_the_reported_capacity():
    clock = ManualClock()
    ledger, _ = ledger_with(clock, retained_fraction=0.3)
    ledger.add(holding("a", 100, clock), next_turn_s=1.0)

    (figures,) = ledger.figures()

    assert figures.capacity_tokens == 10_000
    assert figures.budget_tokens == 3000
    assert figures.held_tokens == 100
    assert figures.held_bytes == 100 * 100.0


def test_without_a_known_capacity_nothing_is_shed():
    clock = ManualClock()
    ledger, _ = ledger_with(clock)
    unsized = Holding("a", URL, "m", {}, 50_000, clock.now + 600, clock.now)

    assert ledger.add(unsized, next_turn_s=300.0) == []
    assert ledger.figures()[0].budget_tokens is None


def test_the_configured_capacity_serves_engines_that_report_none():
    clock = ManualClock()
    ledger, _ = ledger_with(clock, engine_tokens=1000)
    ledger.add(Holding("a", URL, "m", {}, 400, clock.now + 600, clock.now), next_turn_s=300.0)

    victims = ledger.add(Holding("b", URL, "m", {}, 400, clock.now + 600, clock.now), 1.0)

    assert [victim.session_key for victim in victims] == ["a"]


def test_a_disabled_ledger_only_counts():
    clock = ManualClock()
    ledger, _ = ledger_with(clock, enabled=False)
    for session in "abcd":
        assert ledger.add(holding(session, 2000, clock), next_turn_s=300.0) == []
    assert ledger.engine(URL).held_tokens == 8000


def test_a_newer_holding_of_a_session_replaces_its_old_one():
    clock = ManualClock()
    ledger, _ = ledger_with(clock)
    ledger.add(holding("a", 2000, clock), next_turn_s=2.0)
    ledger.add(holding("a", 3000, clock), next_turn_s=2.0)

    assert ledger.engine(URL).held_tokens == 3000


# -- live turns ---------------------------------------------------------------------------


def test_a_live_turn_that_does_not_fit_beside_the_holdings_makes_them_yield():
    clock = ManualClock()
    ledger, metrics = ledger_with(clock)
    ledger.add(holding("far", 2000, clock), next_turn_s=300.0)
    ledger.add(holding("soon", 2000, clock), next_turn_s=2.0)

    assert ledger.make_room(URL, 5000, running=0) == []  # 4000 held + 5000 fit in 10 000
    victims = ledger.make_room(URL, 7000, running=0)

    assert [victim.session_key for victim in victims] == ["far"]
    assert releases(metrics, "live_turn") == 1


def test_running_steps_count_against_the_room():
    clock = ManualClock()
    ledger, _ = ledger_with(clock)
    ledger.add(holding("far", 2000, clock), next_turn_s=300.0)
    ledger.add(holding("soon", 2000, clock), next_turn_s=2.0)

    assert ledger.make_room(URL, 3000, running=0) == []  # teaches a step's size: 3000
    victims = ledger.make_room(URL, 3000, running=1)  # 4000 held + 3001 + 1 x 3000 > 10 000

    assert [victim.session_key for victim in victims] == ["far"]


def test_steps_sent_with_a_ticket_count_at_their_own_size_until_recorded():
    """Found by the connector's waits for blocks on the pressure preset: several large steps
    at once on a decode engine outgrew the mean step size the rule counted them at."""
    clock = ManualClock()
    ledger, _ = ledger_with(clock)
    ledger.add(holding("far", 2000, clock), next_turn_s=300.0)
    ledger.add(holding("soon", 2000, clock), next_turn_s=2.0)
    assert ledger.make_room(URL, 100, running=0) == []  # the mean step: 100 tokens
    assert ledger.make_room(URL, 3000, running=0, step="t1") == []  # 4000 + 3001 fit

    # 4000 held + 3001 + t1's 3001 > 10 000 (at the mean, 1144, it would have fitted)
    victims = ledger.make_room(URL, 3000, running=1, step="t2")

    assert [victim.session_key for victim in victims] == ["far"]
    ledger.step_ended("t1")
    ledger.step_ended("t2")
    ledger.add(holding("t2-session", 3000, clock), next_turn_s=2.0)  # t2's KV, now held
    assert ledger.make_room(URL, 3000, running=0) == []  # 5000 held + 3001: t1 is gone


def test_a_step_counts_the_answer_it_may_grow_by():
    """A running step that decodes past its prompt's last block takes one more beside the
    holdings: with 32-token answers and 128-token blocks, a quarter of the steps do."""
    clock = ManualClock()
    ledger, _ = ledger_with(clock)
    ledger.add(holding("far", 2000, clock), next_turn_s=300.0)
    ledger.add(holding("soon", 2000, clock), next_turn_s=2.0)

    assert ledger.make_room(URL, 5900, running=0) == []  # nothing says how long: 4000 + 5901
    victims = ledger.make_room(URL, 5900, running=0, output_limit=200)  # 4000 + 6100

    assert [victim.session_key for victim in victims] == ["far"]


def test_a_step_without_a_limit_counts_twice_the_answers_recorded_so_far():
    clock = ManualClock()
    ledger, _ = ledger_with(clock)
    ledger.make_room(URL, 1000, running=0, step="t1")
    ledger.step_ended("t1", recorded_tokens=1031)  # a 32-token answer: 1000 + 32 - 1 held
    ledger.add(holding("far", 2000, clock), next_turn_s=300.0)
    ledger.add(holding("soon", 2000, clock), next_turn_s=2.0)

    assert ledger.make_room(URL, 5950, running=0, output_limit=16) == []  # 4000 + 5966
    assert ledger.make_room(URL, 5950, running=0) != []  # 4000 + 5950 + 2 x 32 > 10 000


def test_a_step_reserved_but_not_yet_sent_counts_against_the_next():
    # Two turns that make room before either is in flight (running 0 for both).
    clock = ManualClock()
    ledger, _ = ledger_with(clock)
    ledger.add(holding("far", 2000, clock), next_turn_s=300.0)
    assert ledger.make_room(URL, 4000, running=0, step="a") == []  # 2000 + 4001 fit

    victims = ledger.make_room(URL, 4000, running=0, step="b")  # 2000 + 4001 + 4001 do not

    assert [victim.session_key for victim in victims] == ["far"]


def test_a_reservation_whose_end_was_never_seen_is_forgotten():
    clock = ManualClock()
    ledger, _ = ledger_with(clock)
    ledger.add(holding("far", 2000, clock), next_turn_s=300.0)
    ledger.make_room(URL, 4000, running=0, step="lost")  # its step failed: no holding came
    assert ledger.make_room(URL, 4000, running=0) != []  # still counted: "far" goes

    ledger.add(holding("far", 2000, clock), next_turn_s=300.0)
    clock.now += 121.0

    assert ledger.make_room(URL, 4000, running=0) == []  # 2000 + 4001 fit again
    ledger.step_ended("lost")  # a late end of a forgotten step is harmless


def test_a_holding_recorded_after_a_step_made_room_leaves_that_room_to_the_step():
    """A decode step's prefill goes in slices, claiming blocks over many engine steps: a
    holding recorded meanwhile, within the budget, must not take what the step still needs."""
    clock = ManualClock()
    ledger, metrics = ledger_with(clock)
    assert ledger.add(holding("a", 2000, clock), next_turn_s=300.0) == []
    assert ledger.make_room(URL, 6000, running=0, step="t1") == []  # 2000 + 6001 fit

    victims = ledger.add(holding("b", 2000, clock), next_turn_s=2.0)  # 4000 + 6001 do not

    assert [victim.session_key for victim in victims] == ["a"]  # within the budget of 5000
    assert releases(metrics, "live_turn") == 1
    ledger.step_ended("t1")
    assert ledger.add(holding("a", 2000, clock), next_turn_s=300.0) == []


def test_a_holding_taken_for_a_pull_occupies_its_engine_until_read():
    """Found on the pressure preset: a pull queued 7.5 s behind cold prompts on the prefill
    engine kept its holding's blocks on the decode engine, uncounted, while three decode steps
    waited for blocks beside holdings."""
    clock = ManualClock()
    ledger, _ = ledger_with(clock)
    ledger.add(holding("far", 2000, clock), next_turn_s=300.0)
    pulled = holding("pulled", 2000, clock)
    ledger.add(pulled, next_turn_s=2.0)
    ledger.taken("pulled", pulled)
    ledger.pull_started(pulled)

    victims = ledger.make_room(URL, 6000, running=0)  # 2000 held + 2000 read + 6001 > 10 000

    assert [victim.session_key for victim in victims] == ["far"]
    ledger.pull_ended(pulled)
    ledger.add(holding("far", 2000, clock), next_turn_s=300.0)
    assert ledger.make_room(URL, 6000, running=0) == []  # read: 2000 + 6001 fit


def test_a_pull_whose_end_was_never_seen_is_forgotten():
    clock = ManualClock()
    ledger, _ = ledger_with(clock)
    ledger.add(holding("far", 2000, clock), next_turn_s=300.0)
    ledger.pull_started(holding("pulled", 2000, clock))
    assert ledger.make_room(URL, 6000, running=0) != []  # counted: "far" goes
    ledger.add(holding("far", 2000, clock), next_turn_s=300.0)
    clock.now += 121.0

    assert ledger.make_room(URL, 6000, running=0) == []


# -- sweeps, ends, gaps, lost reuse -----------------------------------------------------------


def test_expired_holdings_are_forgotten_and_abandoned_ones_kept_while_there_is_room():
    """Found on the pressure preset: released at once, a holding silent for 10 x a 0.3 s hint
    + 30 s lost its reuse 0.2 s before a 33.2 s tool call ended, with the engine not full."""
    clock = ManualClock()
    ledger, metrics = ledger_with(clock)  # abandoned after 3 x gap + 5 s
    ledger.add(holding("gone", 100, clock, expires_in=10.0), next_turn_s=60.0)
    ledger.add(holding("quiet", 100, clock), next_turn_s=5.0)
    ledger.add(holding("fine", 100, clock), next_turn_s=60.0)

    clock.now += 21.0
    ledger.sweep()

    assert set(ledger.engine(URL).held) == {"quiet", "fine"}
    assert releases(metrics, "expired") == 1
    assert releases(metrics, "abandoned") == 0


def test_an_abandoned_holding_goes_before_any_other_when_room_is_needed():
    clock = ManualClock()
    ledger, metrics = ledger_with(clock)
    ledger.add(holding("quiet", 2000, clock), next_turn_s=5.0)
    ledger.add(holding("far", 2000, clock), next_turn_s=3000.0)
    clock.now += 21.0  # quiet is abandoned (3 x 5 + 5 s), yet still worth more than far
    assert value(ledger.engine(URL).held["quiet"], clock.now) > value(
        ledger.engine(URL).held["far"], clock.now
    )

    victims = ledger.make_room(URL, 7000, running=0)  # 4000 held + 7001 > 10 000

    assert [victim.session_key for victim in victims] == ["quiet"]
    assert releases(metrics, "abandoned") == 1
    assert releases(metrics, "live_turn") == 0


def test_a_holding_without_a_client_hint_is_never_abandoned():
    """Its gap is a guess from the fleet or from its own last gap (tool gaps are heavy-tailed):
    a slow tool is not an abandoned agent. Its value decays with the silence instead."""
    clock = ManualClock()
    ledger, metrics = ledger_with(clock)
    fast = holding("fast", 100, clock)
    ledger.add(fast, next_turn_s=None)
    clock.now += 2.0
    ledger.taken("fast", fast)  # the fleet's gaps: 2 s
    ledger.add(holding("new", 2000, clock, expires_in=600.0), next_turn_s=None)
    ledger.add(holding("fast", 2000, clock, expires_in=600.0), next_turn_s=None)  # measured: 2 s

    clock.now += 300.0  # far past 3 x 2 s + 5 s
    victims = ledger.make_room(URL, 7000, running=0)

    assert len(victims) == 1
    assert releases(metrics, "live_turn") == 1
    assert releases(metrics, "abandoned") == 0


def test_a_session_end_is_counted_once():
    clock = ManualClock()
    ledger, metrics = ledger_with(clock)
    ledger.add(holding("a", 100, clock), next_turn_s=5.0)

    ledger.ended("a")
    ledger.ended("a")

    assert releases(metrics, "session_end") == 1
    assert ledger.engine(URL).held_tokens == 0


def test_a_measured_gap_predicts_the_next_turn_without_a_hint():
    clock = ManualClock()
    ledger, _ = ledger_with(clock)
    first = holding("a", 100, clock)
    ledger.add(first, next_turn_s=None)
    clock.now += 4.0
    ledger.taken("a", first)

    ledger.add(holding("a", 200, clock), next_turn_s=None)
    ledger.add(holding("b", 200, clock), next_turn_s=None)

    entries = ledger.engine(URL).held
    assert (entries["a"].gap_s, entries["a"].confidence) == (4.0, 0.75)
    assert (entries["b"].gap_s, entries["b"].confidence) == (4.0, 0.5)  # every session's mean


def test_a_turn_that_finds_its_holding_gone_for_pressure_counts_as_lost_reuse():
    clock = ManualClock()
    ledger, metrics = ledger_with(clock)
    ledger.add(holding("far", 3000, clock), next_turn_s=300.0)
    ledger.add(holding("soon", 3000, clock), next_turn_s=2.0)  # "far" goes

    assert ledger.taken("far", None) == Released(3000, "pressure")  # the turn's plan says so
    assert ledger.taken("far", None) is None  # counted once

    sample = metrics.registry.get_sample_value
    assert sample("agentkv_reuse_lost_to_pressure_total", {}) == 1
    assert sample("agentkv_reuse_lost_to_pressure_tokens_total", {}) == 3000


# -- a host tier below the engine's KV cache keeps what was released for room ----------------------


def host_tier_holding(session: str, tokens: int, clock: ManualClock, host_tokens: int) -> Holding:
    params = {"remote_request_id": f"req-{session}", "agentkv_host_tier_tokens": host_tokens}
    return Holding(session, URL, "m", {**params, **CAPACITY}, tokens, clock.now + 600, clock.now)


def test_a_holding_released_for_room_on_an_engine_with_a_host_tier_is_found_there():
    clock = ManualClock()
    ledger, metrics = ledger_with(clock)
    far = host_tier_holding("far", 3000, clock, host_tokens=50_000)
    ledger.add(far, next_turn_s=300.0)
    ledger.add(host_tier_holding("soon", 3000, clock, 50_000), next_turn_s=2.0)  # "far" goes

    assert ledger.taken("far", None) == Released(3000, "pressure", far)
    sample = metrics.registry.get_sample_value
    assert sample("agentkv_reuse_lost_to_pressure_total", {}) == 0  # not lost: in the tier
    assert ledger.engine(URL).spilled_tokens == 0  # the turn took it


def test_the_host_tier_keeps_the_newest_released_kv_that_fits_it():
    clock = ManualClock()
    ledger, metrics = ledger_with(clock)
    # Two holdings of 3,000 tokens go for room, one after the other, into a tier of 4,000.
    for name, next_turn_s in [("a", 300.0), ("b", 2.0), ("c", 1.0)]:
        ledger.add(host_tier_holding(name, 3000, clock, host_tokens=4000), next_turn_s)
        clock.now += 1.0

    first, second = ledger.taken("a", None), ledger.taken("b", None)
    assert first is not None and first.in_host_tier is None  # pushed out by "b"
    assert second is not None and second.in_host_tier is not None
    assert metrics.registry.get_sample_value("agentkv_reuse_lost_to_pressure_total", {}) == 1


# -- the keeper takes what the ledger names out of the store before releasing it -----------------


class Engine:
    """Records the release requests the keeper sends."""

    def __init__(self) -> None:
        self.released: list[str] = []

    async def fetch(self, url: str, timeout: Any, *, json: bytes) -> SimpleNamespace:
        self.released += loads(json)["kv_transfer_params"]["agentkv_release"]
        return SimpleNamespace(status=200)


async def keeper_with_ledger() -> tuple[HoldingKeeper, ResilientStore, Engine]:
    metrics = RouterMetrics()
    store = ResilientStore(
        InMemoryStore(max_sessions=100, ticket_ttl_s=60),
        metrics=metrics,
        timeout_s=1,
        retry_after_s=1,
    )
    ledger = CapacityLedger(
        CapacitySettings.model_validate(WORKED_OUT),
        metrics,
        default_gap_s=120.0,
        prefill_s_per_token=lambda: S_PER_TOKEN,
    )
    engine = Engine()
    keeper = HoldingKeeper(
        store,
        engine,  # type: ignore[arg-type]
        safety_margin_s=0,
        release_timeout_s=1,
        releases_enabled=True,
        ledger=ledger,
    )
    return keeper, store, engine


async def hold(keeper: HoldingKeeper, session: str, tokens: int, next_turn_s: float) -> None:
    ticket = await keeper.issue(session, URL, "m", 600.0, streamed=False, next_turn_s=next_turn_s)
    params = {"remote_request_id": f"req-{session}", "remote_num_tokens": tokens, **CAPACITY}
    await keeper.record(ticket.ticket, params)


async def test_the_keeper_releases_the_holding_the_ledger_names_and_forgets_it():
    keeper, store, engine = await keeper_with_ledger()
    await hold(keeper, "far", 3000, next_turn_s=300.0)

    await hold(keeper, "soon", 3000, next_turn_s=2.0)
    await keeper.drain()

    assert engine.released == ["req-far"]
    assert await store.take("far") is None
    assert await store.take("soon") is not None


async def test_a_holding_a_turn_took_meanwhile_is_left_to_that_turn():
    keeper, store, engine = await keeper_with_ledger()
    await hold(keeper, "far", 3000, next_turn_s=300.0)
    assert await store.take("far") is not None  # a turn took it, unknown to the ledger yet

    await hold(keeper, "soon", 3000, next_turn_s=2.0)
    await keeper.drain()

    assert engine.released == []  # the turn may be pulling it


# -- through the router ---------------------------------------------------------------------


def hints(next_turn_s: float) -> dict[str, str]:
    return {"x-agentkv-next-turn-seconds": str(next_turn_s)}


async def test_the_router_releases_the_far_off_session_when_the_decode_engine_is_full(make_router):
    router = await make_router(capacity=WORKED_OUT)
    decode = router.decode[0]
    decode.kv_capacity_tokens = 2000  # holdings may fill 1000: three 310-token sessions
    await router.chat(conversation(1, 300), session="far", headers=hints(300.0))
    (far_id,) = decode.retained
    for session, next_s in (("a", 2.0), ("b", 3.0)):
        await router.chat(conversation(1, 300), session=session, headers=hints(next_s))
    assert await router.metric("agentkv_kv_held_tokens") == 930

    await router.chat(conversation(1, 300), session="c", headers=hints(4.0))
    await router.state.keeper.drain()

    assert far_id in decode.released
    assert await router.state.store.count() == 3
    assert await router.metric("agentkv_kv_held_tokens") == 930
    assert await router.metric("agentkv_kv_budget_tokens") == 1000
    assert await router.metric('agentkv_kv_releases_total{reason="pressure"}') == 1

    again = await router.chat(conversation(2, 300), session="far", headers=hints(300.0))

    assert again.headers["x-agentkv-kv-path"] == "recompute"
    assert 'desc="released_pressure"' in again.headers["server-timing"]
    assert await router.metric("agentkv_reuse_lost_to_pressure_total") == 1


async def test_a_turn_whose_holding_went_to_the_host_tier_continues_on_its_engine(make_router):
    router = await make_router(capacity=WORKED_OUT, local={"enabled": True})
    decode = router.decode[0]
    decode.kv_capacity_tokens = 2000  # as above: "far" goes when "c" comes
    decode.host_tier_tokens = 10_000
    await router.chat(conversation(1, 300), session="far", headers=hints(300.0))
    (far_id,) = decode.retained
    for session, next_s in (("a", 2.0), ("b", 3.0), ("c", 4.0)):
        await router.chat(conversation(1, 300), session=session, headers=hints(next_s))
    await router.state.keeper.drain()
    assert far_id in decode.released

    prefill_steps = len(router.prefill[0].requests)
    again = await router.chat(conversation(2, 300), session="far", headers=hints(300.0))
    await router.state.keeper.drain()

    assert again.headers["x-agentkv-kv-path"] == "local"
    assert 'desc="host_tier"' in again.headers["server-timing"]
    assert len(router.prefill[0].requests) == prefill_steps  # no P step
    assert decode.released.count(far_id) == 1  # released once, for room; never again
    assert await router.metric("agentkv_reuse_lost_to_pressure_total") == 0
    decided = 'agentkv_path_decisions_total{path="local",reason="host_tier"}'
    assert await router.metric(decided) == 1


async def test_a_turn_the_policy_keeps_off_the_host_tier_says_why_and_recomputes(make_router):
    router = await make_router(capacity=WORKED_OUT, local={"enabled": True, "max_new_tokens": 0})
    decode = router.decode[0]
    decode.kv_capacity_tokens, decode.host_tier_tokens = 2000, 10_000
    await router.chat(conversation(1, 300), session="far", headers=hints(300.0))
    for session, next_s in (("a", 2.0), ("b", 3.0), ("c", 4.0)):
        await router.chat(conversation(1, 300), session=session, headers=hints(next_s))
    await router.state.keeper.drain()

    again = await router.chat(conversation(2, 300), session="far", headers=hints(300.0))

    assert again.headers["x-agentkv-kv-path"] == "recompute"
    assert 'desc="new_part_too_long"' in again.headers["server-timing"]
    assert await router.metric("agentkv_reuse_lost_to_pressure_total") == 1


async def test_a_pulled_holding_counts_on_its_engine_until_the_prefill_step_ends(make_router):
    router = await make_router(policy="always")
    decode = router.decode[0]
    await router.chat(conversation(1, 300), session="s1", headers=hints(2.0))
    router.prefill[0].delay_s = 0.5  # the pull waits behind other prompts
    reads = router.state.ledger.engine(decode.url).reads

    turn = asyncio.create_task(router.chat(conversation(2, 300), session="s1", headers=hints(2.0)))
    await asyncio.sleep(0.25)
    during = dict(reads)
    again = await turn

    assert again.headers["x-agentkv-kv-path"] == "reuse"
    assert [tokens for tokens, _ in during.values()] == [310]
    assert reads == {}


async def test_upstream_at_its_best_keeps_every_holding_as_vllms_proxy_would(make_router):
    """vLLM's proxy knows nothing of capacity: its engines keep every turn 480 s. Found on the
    pressure preset, where upstream-best's holdings went through agentkv's ledger and were
    released for room, which flattered it."""
    router = await make_router(policy="upstream-best", capacity=WORKED_OUT)
    decode = router.decode[0]
    decode.kv_capacity_tokens = 2000  # the same four sessions as above, over agentkv's budget
    for session in ("far", "a", "b", "c"):
        await router.chat(conversation(1, 300), session=session)
    await router.state.keeper.drain()

    assert decode.released == []
    assert await router.state.store.count() == 4
    assert await router.metric('agentkv_kv_releases_total{reason="pressure"}') == 0


async def test_a_decode_step_that_would_not_fit_beside_holdings_releases_them_first(make_router):
    router = await make_router()
    decode = router.decode[0]
    decode.kv_capacity_tokens = 2000
    await router.chat(conversation(1, 300), session="far", headers=hints(300.0))
    (far_id,) = decode.retained

    # 1010 prompt tokens beside 310 held fit in 2000; 1810 do not.
    await router.chat(conversation(1, 1000))
    assert far_id not in decode.released
    await router.chat(conversation(1, 1800))
    await router.state.keeper.drain()

    assert far_id in decode.released
    # Released by the step itself: the engine frees it as the step arrives, with no request
    # of its own to wait for (which waited for blocks itself on a full engine).
    step = decode.requests[-1]
    assert step.kv_params["agentkv_release"] == [far_id]
    assert step.kv_params["agentkv_retention_seconds"] == 0  # a sessionless step keeps none
    assert len(decode.completions()) == 3  # the step is a completion, not a release only
    assert await router.metric('agentkv_kv_releases_total{reason="live_turn"}') == 1


async def test_a_decode_step_makes_room_for_the_answer_it_may_grow_by(make_router):
    router = await make_router()
    decode = router.decode[0]
    decode.kv_capacity_tokens = 2000
    await router.chat(conversation(1, 300), session="far", headers=hints(300.0), max_tokens=400)
    (far_id,) = decode.retained

    # 1010 prompt tokens and a 4-token answer beside the ~710 held fit in 2000; a 400-token
    # one (max_completion_tokens, the newer name, bounds it as max_tokens does) does not.
    await router.chat(conversation(1, 1000))
    assert far_id not in decode.released
    await router.chat(conversation(1, 1000), max_tokens=None, max_completion_tokens=400)
    await router.state.keeper.drain()

    assert decode.requests[-1].kv_params["agentkv_release"] == [far_id]


async def test_the_holdings_a_failed_decode_step_carried_are_released_on_their_own(make_router):
    router = await make_router()
    decode = router.decode[0]
    decode.kv_capacity_tokens = 2000
    await router.chat(conversation(1, 300), session="far", headers=hints(300.0))
    (far_id,) = decode.retained
    decode.faults = ["bad_request"]  # refused before the engine's scheduler saw the step

    refused = await router.chat(conversation(1, 1800))
    await router.state.keeper.drain()

    assert refused.status_code == 400
    assert decode.released == [far_id]
    assert decode.requests[-1].kv_params == {"agentkv_release": [far_id]}


async def test_deleting_a_session_counts_a_session_end_release(make_router):
    router = await make_router()
    await router.chat(conversation(1, 300), session="s1", headers=hints(5.0))

    await router.client.delete("/v1/sessions/s1")

    assert await router.metric('agentkv_kv_releases_total{reason="session_end"}') == 1
    assert await router.metric("agentkv_kv_held_tokens") == 0


async def test_an_abandoned_session_stays_until_a_decode_step_needs_its_room(make_router):
    router = await make_router(capacity={"abandon_factor": 1.0, "abandon_slack_s": 0.0})
    decode = router.decode[0]
    decode.kv_capacity_tokens = 2000
    await router.chat(conversation(1, 300), session="s1", headers=hints(0.01))
    (held_id,) = decode.retained
    ledger = router.state.ledger
    entry = ledger.engine(decode.url).held["s1"]
    ledger._clock = lambda: entry.recorded_at + 1.0  # a second late for a 10 ms gap

    router.state.keeper.sweep()
    await router.chat(conversation(1, 1000))  # fits beside it
    await router.state.keeper.drain()
    assert decode.released == []
    assert await router.state.store.count() == 1

    await router.chat(conversation(1, 1800))  # does not
    await router.state.keeper.drain()

    assert decode.released == [held_id]
    assert await router.state.store.count() == 0
    assert await router.metric('agentkv_kv_releases_total{reason="abandoned"}') == 1
    assert await router.metric('agentkv_kv_releases_total{reason="live_turn"}') == 0
