"""A prefill engine's backlog as the local path's choice sees it: steps in flight times the
time a step takes to serve, its wait in the queue excluded."""

from __future__ import annotations

import pytest

from agentkv_server.router import CostModelPolicy, KVPath, TurnLoad
from agentkv_server.router.placement import Engine
from agentkv_server.router.sessions import Holding
from agentkv_server.settings import CostModelSettings, LocalPathSettings, RetentionSettings

NOW = 1000.0


def test_a_step_that_waited_counts_only_its_service(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([10.0, 12.0, 14.0])
    monkeypatch.setattr("agentkv_server.router.placement.time.monotonic", lambda: next(clock))
    engine = Engine("http://p", "prefill")
    engine.inflight = 3  # this step and two queued behind it
    engine.observe_step(2.0)  # found P idle: 2 s of service
    engine.inflight = 2
    engine.observe_step(4.0)  # waited 2 s behind the first: served in 2
    engine.inflight = 1
    engine.observe_step(6.0)
    assert engine.step_s == pytest.approx(2.0)
    engine.inflight = 4
    assert engine.backlog_s == pytest.approx(8.0)
    assert Engine("http://q", "prefill").backlog_s == 0.0  # nothing measured yet


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
