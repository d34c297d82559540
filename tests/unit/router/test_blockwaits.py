"""Waits for blocks that engines report (router/blockwaits.py): counted once per request, by
what was in the way, and taken out of the params that go on to the next engine."""

from __future__ import annotations

from typing import Any

from agentkv_server.router.blockwaits import BlockWaitTally
from agentkv_server.router.metrics import RouterMetrics
from agentkv_server.testing import conversation


def waited(seconds: float, beside_retained_s: float, request_id: str = "d-1") -> dict[str, Any]:
    return {
        "remote_request_id": request_id,
        "remote_num_tokens": 40,
        "agentkv_waited_for_blocks_seconds": seconds,
        "agentkv_waited_beside_retained_seconds": beside_retained_s,
    }


def count(metrics: RouterMetrics, role: str, beside: str) -> float:
    labels = {"role": role, "beside": beside}
    return (
        metrics.registry.get_sample_value("agentkv_engine_blocks_wait_seconds_count", labels) or 0
    )


def test_a_wait_beside_holdings_is_counted_as_theirs_and_taken_out() -> None:
    metrics = RouterMetrics()
    params = waited(3.0, 2.5)

    BlockWaitTally(metrics).record("decode", params)

    assert count(metrics, "decode", "retained") == 1 and count(metrics, "decode", "running") == 0
    labels = {"role": "decode", "beside": "retained"}
    assert metrics.registry.get_sample_value("agentkv_engine_blocks_wait_seconds_sum", labels) == 3
    assert params == {"remote_request_id": "d-1", "remote_num_tokens": 40}


def test_the_same_request_seen_twice_counts_once_per_role() -> None:
    metrics = RouterMetrics()
    tally = BlockWaitTally(metrics)

    tally.record("decode", waited(1.0, 0.0))  # the answer
    tally.record("decode", waited(1.0, 0.0))  # the holding report of the same step
    tally.record("prefill", waited(1.0, 0.0))  # an engine of the other role, same id
    tally.record("decode", waited(1.0, 0.0, request_id="d-2"))

    assert count(metrics, "decode", "running") == 2 and count(metrics, "prefill", "running") == 1


def test_params_without_a_wait_or_with_a_bad_one_count_nothing() -> None:
    metrics = RouterMetrics()
    tally = BlockWaitTally(metrics)

    for params in ({"remote_num_tokens": 4}, None, waited(-1.0, 0.0), [1, 2]):
        tally.record("decode", params)

    assert count(metrics, "decode", "running") == count(metrics, "decode", "retained") == 0


async def test_a_streamed_turns_wait_is_counted_once_and_never_sent_on(make_router) -> None:
    router = await make_router()
    router.decode[0].blocks_wait = (2.0, 1.5)
    series = 'agentkv_engine_blocks_wait_seconds_count{beside="retained",role="decode"}'

    first = await router.chat(conversation(1, 300), session="s1", stream=True)
    router.decode[0].blocks_wait = None
    second = await router.chat(conversation(2, 300), session="s1")

    assert first.status_code == second.status_code == 200
    assert "agentkv_waited" not in first.text
    assert await router.metric(series) == 1  # answer and report: one request
    assert second.headers["x-agentkv-kv-path"] == "reuse"
    pulled = router.prefill[0].completions()[-1].kv_params
    assert not any(key.startswith("agentkv_waited") for key in pulled)
