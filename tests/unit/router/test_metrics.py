"""The fixed metric names are exposed and count what happened."""

from __future__ import annotations

from agentkv_server.testing import conversation

NAMES = (
    "agentkv_turns_total",
    "agentkv_reused_tokens_total",
    "agentkv_recomputed_tokens_total",
    "agentkv_ttft_seconds",
    "agentkv_sessions_held",
    "agentkv_prefill_queue_seconds",
    "agentkv_engine_errors_total",
)


async def test_metric_names_are_exposed_from_the_start(make_router):
    router = await make_router()
    response = await router.client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    for name in NAMES:
        assert f"# TYPE {name.removesuffix('_total')}" in response.text


async def test_metrics_count_turns_tokens_and_sessions(make_router):
    router = await make_router()
    await router.chat(conversation(1, 500), session="s1")
    await router.chat(conversation(2, 500), session="s1", stream=True)
    router.decode[0].retained.clear()
    await router.chat(conversation(3, 500), session="s1")

    assert await router.metric('agentkv_turns_total{path="recompute"}') == 1
    assert await router.metric('agentkv_turns_total{path="reuse"}') == 1
    assert await router.metric('agentkv_turns_total{path="fallback"}') == 1
    assert await router.metric("agentkv_reused_tokens_total") == 510
    # prompts: 506 cold, 516 - 510 reused, 526 recomputed after the failed pull
    assert await router.metric("agentkv_recomputed_tokens_total") == 506 + 6 + 526
    assert await router.metric('agentkv_ttft_seconds_count{path="reuse"}') == 1
    assert await router.metric("agentkv_sessions_held") == 1


async def test_engine_errors_are_counted_by_role_and_kind(make_router):
    router = await make_router(n_decode=2)
    router.decode[0].faults.append("error")
    await router.chat(conversation(1, 50))
    assert await router.metric('agentkv_engine_errors_total{kind="status",role="decode"}') == 1
