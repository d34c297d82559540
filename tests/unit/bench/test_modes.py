"""Each mode's router policy: ``upstream-best`` is ``upstream`` that also learns streamed turns."""

from __future__ import annotations

import time

import httpx
import pytest

from agentkv_server.bench.modes import MODES, Deployment, ends_sessions, mode_settings, serve_mode
from agentkv_server.router import make_policy
from agentkv_server.router.sessions import Holding
from agentkv_server.router.turn import KVPath, TurnHints
from agentkv_server.settings import Settings

NOW = time.time()


def held(tokens: int) -> Holding:
    return Holding("s", "http://d", "m", {}, tokens, NOW + 300, NOW - 1)


def policy(name: str):  # type: ignore[no-untyped-def]
    return make_policy(Settings(decode_urls=("http://d",), policy=name))  # type: ignore[arg-type]


def test_upstream_best_keeps_upstreams_threshold_and_fixed_retention() -> None:
    best, upstream = policy("upstream-best"), policy("upstream")
    assert best.name == "upstream-best"
    for tokens in (63, 64, 100_000):
        assert best.decide(held(tokens), NOW) == upstream.decide(held(tokens), NOW)
    assert best.decide(held(64), NOW).path is KVPath.PULL
    hints = [TurnHints(), TurnHints(next_turn_seconds=1.0), TurnHints(session_end=True)]
    assert {best.retention_s(h) for h in hints} == {480.0}
    assert not best.considers_local


def test_only_upstream_best_asks_decode_engines_to_report_streamed_turns() -> None:
    """The ticket rides with the decode step's params: what makes a streamed holding known."""
    assert policy("upstream-best").sends_hints and not policy("upstream").sends_hints


def test_the_upstream_modes_announce_no_session_end() -> None:
    assert [m for m in MODES if not ends_sessions(m)] == ["upstream-best", "upstream"]
    assert MODES[-2:] == ("upstream-best", "upstream")  # the modes that leave KV retained


@pytest.mark.parametrize(("mode", "ends"), [("upstream-best", False), ("agentkv", True)])
async def test_serve_mode_runs_the_modes_policy(mode: str, ends: bool) -> None:
    deployment = Deployment("m", ("http://p",), ("http://d",), ("http://d",), 0, "secret")
    serving = serve_mode(mode, deployment)  # type: ignore[arg-type]
    async with serving as target, httpx.AsyncClient() as http:
        health = (await http.get(f"{target.base_urls[0]}/health")).json()
    assert target.ends_sessions is ends
    assert health.get("policy") == mode


@pytest.mark.parametrize("mode", ["upstream", "upstream-best", "agentkv", "recompute"])
def test_only_the_modes_imitating_vllms_proxy_send_every_turn_at_once(mode: str) -> None:
    """vLLM's proxy holds nothing back: the upstream modes' routers admit every turn."""
    tuned = {"admission": {"max_wait_s": 30.0}}
    deployment = Deployment(
        "m", ("http://p",), ("http://d",), ("http://d",), 0, "s", "127.0.0.1", tuned
    )
    admission = mode_settings(mode, deployment).admission  # type: ignore[arg-type]
    assert admission.enabled is not mode.startswith("upstream")
    assert admission.max_wait_s == 30.0


async def test_the_modes_routers_take_the_deployments_settings_but_not_over_benchs_own() -> None:
    """``AGENTKV_*`` variables reach bench's routers as they reach ``agentkv router``
    (bench/cli.py reads them): a setting of their own applies, the policy stays the mode's."""
    tuned = {"max_body_bytes": 1024, "policy": "never"}
    deployment = Deployment(
        "m", ("http://p",), ("http://d",), ("http://d",), 0, "s", "127.0.0.1", tuned
    )
    async with serve_mode("agentkv", deployment) as target, httpx.AsyncClient() as http:
        url = target.base_urls[0]
        health = (await http.get(f"{url}/health")).json()
        big = await http.post(f"{url}/v1/chat/completions", content=b"x" * 2048)
    assert health.get("policy") == "agentkv"
    assert big.status_code == 413 and "1024" in big.text
