"""Planned sessions sent as agents' clients send them, per tenant and with openai's retries, on
stub engines: straight to an engine that refuses as an overloaded router does, and through the
modes' routers with the tenants' keys (bench/tenant_runner.py, bench/sweep.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
from aiohttp import web

from agentkv_server.bench.modes import Deployment, serve_mode
from agentkv_server.bench.overload import TENANT_KEYS, OverloadWorkload, router_settings
from agentkv_server.bench.planned import PlannedSession
from agentkv_server.bench.pressure import SessionPlan
from agentkv_server.bench.records import REFUSAL_CODE, SweepResult
from agentkv_server.bench.runner import Target
from agentkv_server.bench.sweep import run_points
from agentkv_server.bench.tenant_runner import TenantRunner
from agentkv_server.bench.turn_figures import reused
from agentkv_server.bench.workload import WordTokenizer, Workload
from agentkv_server.settings import Settings
from agentkv_server.testing import StubCluster, StubEngine, http_reporter

MODEL = "stub-model"
SECRET = "tenant-runner-secret"
TEXTS = Workload(sessions=1, turns=3, history_tokens=(300,), new_tokens=5, output_tokens=3)


class Admitting(StubEngine):
    """Refuses the tries of the sessions named in ``refuse`` (id suffix -> tries left to
    refuse; a turn number after ``@``: only that turn's) as an overloaded router does."""

    refuse: dict[str, int]

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        session = request.headers.get("x-session-id", "")
        turn = request.headers.get("x-agentkv-turn", "1")
        for name, left in self.refuse.items():
            suffix, _, only = name.partition("@")
            if left and session.endswith(suffix) and only in ("", turn):
                self.refuse[name] = left - 1
                body = {"error": {"message": "busy", "type": "server_error",
                                  "code": REFUSAL_CODE}}  # fmt: skip
                headers = {"Retry-After": "0.01", "x-should-retry": "true"}
                return web.json_response(body, status=503, headers=headers)
        return await super()._completion(request)


def planned(key: str, index: int, turns: int, tenant: str = "burst") -> PlannedSession:
    plan = SessionPlan(index, 300, 0.0, (0.01,) * (turns - 1))
    return PlannedSession(plan, tenant, key, TENANT_KEYS[tenant])


@pytest.fixture
async def admitting() -> AsyncIterator[Admitting]:
    cluster = StubCluster(model=MODEL)
    engine = Admitting(cluster, "decode")
    engine.refuse = {}
    await engine.start()
    cluster.engines.append(engine)
    yield engine
    await cluster.close()


async def test_refused_turns_are_retried_recorded_and_end_their_session(
    admitting: Admitting,
) -> None:
    admitting.refuse = {"-never": 9, "-once": 1, "-later@2": 9}
    sessions = [planned("steady", 0, 2, "steady"), planned("never", 1, 2),
                planned("once", 2, 2), planned("later", 3, 3)]  # fmt: skip
    target = Target("aggregated", (admitting.url,), MODEL, tag_body=False)
    turns = await TenantRunner(TEXTS, WordTokenizer()).run(
        target, sessions, salt="t", repeat=0, tag="x2", load=2.0
    )
    by_session = {
        s.key: [(t.turn.turn, t.outcome, len(t.attempts)) for t in turns if t.turn.session == i]
        for i, s in enumerate(sessions)
    }
    assert by_session == {
        "steady": [(1, "served", 1), (2, "served", 1)],
        "never": [(1, "refused", 3)],  # openai's 2 retries, then the session stops
        "once": [(1, "served", 2), (2, "served", 1)],
        "later": [(1, "served", 1), (2, "refused", 3)],  # nothing after the refused follow-up
    }
    once = next(t for t in turns if t.turn.session == 2 and t.turn.turn == 1)
    assert (once.turn.ttft_s or 0) >= 0.01  # the wait before the retry counts
    assert {t.load for t in turns} == {2.0} and {t.label for t in turns} == {"steady", "burst"}
    sent = admitting.completions()
    keys = {r.headers["x-session-id"].rsplit("-", 1)[1]: r.headers["Authorization"] for r in sent}
    assert keys["steady"] == f"Bearer {TENANT_KEYS['steady']}"
    assert keys["once"] == keys["later"] == f"Bearer {TENANT_KEYS['burst']}"
    assert all("-x2-" in r.headers["x-session-id"] for r in sent)


SMALL = OverloadWorkload(
    loads=(0.0, 1.0), objective_s=5.0, history_tokens=(200, 300), new_tokens=5,
    output_tokens=3, turns=(2, 2), bursts=1, burst_period_s=0.4, burst_window_s=0.1,
    lead_in_s=0.1, gap_median_s=0.02, steady_sessions=1, steady_gap_median_s=0.05,
)  # fmt: skip


async def run_routed(
    cluster: StubCluster, workload: OverloadWorkload, mode: str, capacity: float
) -> SweepResult:
    """The workload's points through ``mode``'s router (the tenants' keys, the objective as its
    admission bound) in front of the cluster's prefill and decode engines."""
    prefill, decode = cluster.engines
    settings = router_settings({}, workload)
    deployment = Deployment(
        MODEL, (prefill.url,), (decode.url,), (decode.url,), 0, SECRET, router_settings=settings
    )

    @contextlib.asynccontextmanager
    async def open_target(name: str) -> AsyncIterator[Target]:
        async with serve_mode(name, deployment) as target:  # type: ignore[arg-type]
            cluster.reporter, close = http_reporter(target.base_urls[0], SECRET)
            try:
                yield target
                await cluster.flush_reports()
            finally:
                await close()

    runner = TenantRunner(TEXTS, WordTokenizer())
    points = workload.points(capacity)
    try:
        return await run_points(points, [mode], 1, open_target, runner, "t",
                                progress=lambda line: None, secret=SECRET)  # fmt: skip
    finally:
        await cluster.close()


@pytest.mark.parametrize("mode", ["agentkv", "upstream-best"])
async def test_points_run_through_routers_that_take_the_tenants_keys(
    start_engines: Any, mode: str
) -> None:
    """Each tenant's sessions are its own on the router (a session is ended with its tenant's
    key, which releases what the router held for it, ``upstream-best``'s idle last turns too);
    the router counts what it refused and queued and the engines it marked down."""
    cluster = StubCluster(model=MODEL)
    _, decode = await start_engines(cluster)
    found = await run_routed(cluster, SMALL, mode, capacity=20_000.0)
    assert all(t.outcome == "served" for t in found.turns)
    assert {(t.load, t.label) for t in found.turns} == {(0.0, "steady"), (1.0, "steady"),
                                                         (1.0, "burst")}  # fmt: skip
    follow_ups = [t for t in found.turns if t.turn.turn > 1]
    assert any(reused(t.turn) for t in follow_ups)  # as the tenant's own sessions
    assert decode.retained == {}  # every session ended on its router with its tenant's key
    for window, point in zip(found.windows, SMALL.points(20_000.0)):
        assert window.mode == mode and window.sessions == len(point.sessions)
        if "admission" in Settings.model_fields:
            assert window.marked_down == 0 and window.refused == 0 and window.queued is not None
    assert [w.tag for w in found.windows] == ["x0", "x1"]


@pytest.mark.skipif("admission" not in Settings.model_fields, reason="no admission control")
async def test_a_burst_beyond_the_bound_is_refused_and_counted_alike() -> None:
    """A prefill engine that computes one 400-token prompt in 0.2 s, a 0.3 s bound, and a
    burst of four times what it serves: the router refuses at arrival, each refusal fast and
    with Retry-After, every one of them counted alike by the client and the router."""
    burst = replace(SMALL, loads=(4.0,), objective_s=0.3, history_tokens=(400, 400),
                    burst_period_s=1.0, lead_in_s=0.3, steady_gap_median_s=0.1)  # fmt: skip
    cluster = StubCluster(model=MODEL, prefill_s_per_token=0.0005)
    await cluster.start("prefill", one_prompt_at_a_time=True)
    await cluster.start("decode")
    found = await run_routed(cluster, burst, "agentkv", capacity=1000.0)
    refusals = [a for t in found.turns for a in t.refusals]
    assert refusals and all(a.retry_after_s and a.seconds < 1.0 for a in refusals)
    (window,) = found.windows
    assert window.refused == len(refusals) and window.marked_down == 0
    outcomes = {t.outcome for t in found.turns}
    assert "failed" not in outcomes and {"refused", "served"} <= outcomes
