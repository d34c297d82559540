"""Faults: the client sees an error only when no engine can serve the request."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentkv_server.testing import InProcessRouter, conversation
from agentkv_server.wire import cold_prefill_params


async def mark_down(router: InProcessRouter) -> None:
    """Probe until engines that answer /health badly are marked down."""
    for _ in range(2):
        await router.state.health.check_all()


@pytest.mark.parametrize("probed", [True, False], ids=["probed", "answered-just-now"])
async def test_holder_gone_means_recompute_on_another_decode_engine(make_router, probed):
    """Probed: the holder's liveness probe is refused, so no pull is planned at all. Answered
    just now (no probe): P finds nothing to pull, D's step there is refused."""
    router = await make_router(n_decode=2, faults={"liveness_cache_s": 0.0 if probed else 60.0})
    await router.chat(conversation(1, 500), session="s1")
    holder, other = router.decode if router.decode[0].retained else router.decode[::-1]
    await holder.stop()

    response = await router.chat(conversation(2, 500), session="s1")

    assert response.status_code == 200
    assert response.headers["x-agentkv-kv-path"] == "fallback"
    assert response.headers["x-agentkv-reused-tokens"] == "0"
    assert len(other.completions()) == 1
    assert await router.metric('agentkv_engine_errors_total{kind="connect",role="decode"}') == 1
    planned_pull = router.prefill[0].completions()[-1].kv_params != cold_prefill_params()
    assert planned_pull is not probed


async def test_holder_known_down_is_not_asked_for_a_pull(make_router):
    router = await make_router(n_decode=2)
    await router.chat(conversation(1, 500), session="s1")
    holder = next(engine for engine in router.decode if engine.retained)
    holder.healthy = False
    await mark_down(router)

    response = await router.chat(conversation(2, 500), session="s1")

    assert response.headers["x-agentkv-kv-path"] == "fallback"
    assert router.prefill[0].completions()[-1].kv_params == cold_prefill_params()
    assert len(holder.completions()) == 1


async def test_held_kv_that_vanished_is_a_fallback(make_router):
    router = await make_router()
    await router.chat(conversation(1, 500), session="s1")
    router.decode[0].retained.clear()  # expired or freed on the engine

    response = await router.chat(conversation(2, 500), session="s1")

    assert response.status_code == 200
    assert response.headers["x-agentkv-kv-path"] == "fallback"
    assert response.headers["x-agentkv-reused-tokens"] == "0"
    assert router.prefill[0].completions()[-1].kv_params["remote_engine_id"] is not None


async def test_failed_pull_step_is_retried_cold(make_router):
    router = await make_router()
    await router.chat(conversation(1, 500), session="s1")
    router.prefill[0].faults.append("error")

    response = await router.chat(conversation(2, 500), session="s1")

    assert response.headers["x-agentkv-kv-path"] == "fallback"
    pull, cold = router.prefill[0].completions()[-2:]
    assert pull.kv_params["remote_request_id"] and cold.kv_params == cold_prefill_params()


async def test_stalled_pull_is_retried_cold_without_dropping_the_prefill_engine(make_router):
    # pull_s is the stall limit of a pulling step (other steps keep faults.stall_s, 60 s here)
    slow_stall = FAST_WATCHDOG["faults"] | {"stall_s": 60.0}
    router = await make_router(faults=slow_stall, timeouts={"pull_s": 0.3})
    await router.chat(conversation(1, 500), session="s1")
    router.prefill[0].faults.append("hang")  # as when the holder dies mid-transfer

    stalled = await router.chat(conversation(2, 500), session="s1")
    after = await router.chat(conversation(3, 500), session="s1")

    assert stalled.status_code == 200
    assert stalled.headers["x-agentkv-kv-path"] == "fallback"
    pull, cold = router.prefill[0].completions()[1:3]
    assert pull.kv_params["remote_request_id"] and cold.kv_params == cold_prefill_params()
    assert router.state.prefill.engines[0].healthy is True
    assert after.headers["x-agentkv-kv-path"] == "reuse"
    assert await router.metric('agentkv_engine_errors_total{kind="stall",role="prefill"}') == 1


async def test_unreachable_prefill_engine_is_replaced_by_another(make_router):
    router = await make_router(n_prefill=2)
    down, up = router.prefill
    await down.stop()

    for _ in range(3):
        response = await router.chat(conversation(1, 100))
        assert response.status_code == 200

    assert len(up.completions()) == 3
    assert router.state.prefill.engines[0].healthy is False
    assert await router.metric('agentkv_engine_errors_total{kind="connect",role="prefill"}') == 1


async def test_prefill_engine_whose_core_makes_no_progress_is_left_for_another(make_router):
    """It answers HTTP, but no engine step moves its progress series (a blocked core)."""
    router = await make_router(n_prefill=2, **FAST_WATCHDOG)
    router.prefill[0].faults.append("hang")

    response = await router.chat(conversation(1, 100))

    assert response.status_code == 200
    assert len(router.prefill[1].completions()) == 1
    assert await router.metric('agentkv_engine_errors_total{kind="stall",role="prefill"}') == 1
    marked = 'agentkv_engines_marked_down_total{kind="stall",role="prefill"}'
    assert await router.metric(marked) == 1


async def test_no_prefill_engine_means_decode_only_serving(make_router):
    router = await make_router()
    await router.chat(conversation(1, 500), session="s1")
    await router.prefill[0].stop()

    response = await router.chat(conversation(2, 500), session="s1")

    assert response.status_code == 200
    assert response.headers["x-agentkv-kv-path"] == "fallback"  # a reuse was planned
    decode = router.decode[0].completions()[-1]
    assert "do_remote_prefill" not in decode.kv_params
    assert decode.kv_params["agentkv_ticket"]


async def test_router_without_prefill_engines_serves_decode_only(make_router):
    router = await make_router(n_prefill=0)
    response = await router.chat(conversation(1, 50), stream=True)
    assert response.status_code == 200
    assert response.text.rstrip().endswith("data: [DONE]")


async def test_decode_failure_before_first_token_is_retried_elsewhere(make_router):
    router = await make_router(n_decode=2)
    router.decode[0].faults.append("disconnect")

    response = await router.chat(conversation(1, 50), stream=True)

    assert response.status_code == 200
    assert response.text.rstrip().endswith("data: [DONE]")
    assert len(router.decode[1].completions()) == 1
    assert router.state.decode.engines[0].healthy is False  # until the next health check


async def test_a_dropped_connection_makes_an_engine_suspect_not_lost(make_router):
    """The holder hangs up on a request it had accepted: no new work until its probe passes,
    but only a refused new connection says its process (and the KV it holds) is gone."""
    router = await make_router(n_decode=2)
    await router.chat(conversation(1, 500), session="s1")
    stub = router.decode[0] if router.decode[0].retained else router.decode[1]
    holder = router.state.decode.get(stub.url)
    assert holder is not None
    stub.faults.append("disconnect")

    response = await router.chat(conversation(2, 500), session="s1")

    assert response.status_code == 200
    assert holder.healthy is False and holder.lost_at == 0.0
    assert await router.metric('agentkv_engine_errors_total{kind="disconnect",role="decode"}') == 1
    assert await router.metric('agentkv_engine_errors_total{kind="connect",role="decode"}') == 0


async def test_client_gets_an_error_only_when_every_decode_engine_failed(make_router):
    router = await make_router(n_decode=2)
    router.decode[0].faults.append("error")
    router.decode[1].faults.append("error")

    response = await router.chat(conversation(1, 50), stream=True)

    assert response.status_code == 502
    assert response.json()["error"]["code"] == "engine_failure"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_502_names_the_step_not_the_engine(make_router, caplog, stream):
    """The tenant learns which step failed and that a retry may serve it; the engines' URLs
    and their own error text go to the log (one WARNING line) and the metrics (issue 50)."""
    router = await make_router(n_decode=2)
    for engine in router.decode:
        engine.faults.append("error")

    response = await router.chat(conversation(1, 50), stream=stream)

    assert response.status_code == 502
    assert response.headers["x-should-retry"] == "true"
    message = response.json()["error"]["message"]
    assert "decode step" in message
    for secret in ("http://", "127.0.0.1", "injected engine failure", "HTTP 500"):
        assert secret not in response.text
    failed = [r for r in caplog.records if r.getMessage().startswith("turn failed")]
    assert len(failed) == 1 and failed[0].levelname == "WARNING"
    assert router.decode[1].url in failed[0].getMessage()
    assert await router.metric('agentkv_engine_errors_total{kind="status",role="decode"}') == 2


async def test_non_streamed_decode_failure_is_retried_elsewhere(make_router):
    router = await make_router(n_decode=2)
    router.decode[0].faults.append("error")

    response = await router.chat(conversation(1, 50))

    assert response.status_code == 200
    assert len(router.decode[1].completions()) == 1
    assert await router.metric('agentkv_engine_errors_total{kind="status",role="decode"}') == 1


async def test_engine_refusal_is_passed_back_without_retry(make_router):
    router = await make_router(n_decode=2)
    router.decode[0].faults.append("bad_request")

    response = await router.chat(conversation(1, 50))

    assert response.status_code == 400
    assert response.json()["error"]["message"] == "injected bad request"
    assert router.decode[1].completions() == []


async def test_prefill_refusal_never_reaches_decode(make_router):
    router = await make_router()
    router.prefill[0].faults.append("bad_request")

    response = await router.chat(conversation(1, 50))

    assert response.status_code == 400
    assert router.decode[0].completions() == []


async def test_decode_engine_marked_down_is_still_tried_as_a_last_resort(make_router):
    router = await make_router()
    router.decode[0].healthy = False
    await mark_down(router)
    assert (await router.client.get("/health")).json()["status"] == "unavailable"

    response = await router.chat(conversation(1, 50))

    assert response.status_code == 200


async def test_no_decode_engine_answering_is_an_openai_error(make_router):
    router = await make_router()
    await router.decode[0].stop()

    response = await router.chat(conversation(1, 50))

    assert response.status_code == 502
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


async def test_one_failed_probe_does_not_take_an_engine_out(make_router):
    router = await make_router()
    router.decode[0].healthy = False
    await router.state.health.check_all()
    assert router.state.decode.engines[0].healthy is True
    await router.state.health.check_all()
    assert router.state.decode.engines[0].healthy is False


async def test_health_checks_bring_engines_back(make_router):
    router = await make_router(n_prefill=2)
    router.prefill[1].healthy = False
    await mark_down(router)
    health = (await router.client.get("/health")).json()
    assert health["status"] == "degraded"
    assert [engine["healthy"] for engine in health["prefill"]] == [True, False]

    router.prefill[1].healthy = True
    await router.state.health.check_all()
    assert (await router.client.get("/health")).json()["status"] == "ok"


# The watchdog's deadlines shrunk to stub scale: a test that fails to notice a fault runs into
# the client's 5 s timeout instead.
FAST_WATCHDOG: dict[str, Any] = {
    "faults": {
        "liveness_cache_s": 0.0,
        "liveness_timeout_s": 0.2,
        "progress_every_s": 0.05,
        "stall_s": 0.3,
    },
    "timeouts": {"health_s": 0.2},
}


async def test_holdings_of_an_engine_that_refused_a_connection_are_void(make_router):
    """An engine restarted on the same address has lost its KV, even if it answers again."""
    router = await make_router(**FAST_WATCHDOG)
    engine = router.decode[0]
    for session in ("s1", "s2"):
        await router.chat(conversation(1, 500), session=session)
    port = engine.port
    await engine.stop()
    await router.state.health.check_all()  # one refused connection is enough
    await engine.start(port)  # the stub still has the blocks: only the router can refuse them
    await router.state.health.check_all()
    assert router.state.decode.engines[0].healthy

    responses = [await router.chat(conversation(2, 500), session=s) for s in ("s1", "s2")]

    assert [r.headers["x-agentkv-kv-path"] for r in responses] == ["fallback", "fallback"]
    assert all(r.kv_params == cold_prefill_params() for r in router.prefill[0].completions()[2:])
    assert router.prefill[0].pulled == []


async def test_frozen_holder_is_not_asked_for_a_pull(make_router):
    router = await make_router(n_decode=2, **FAST_WATCHDOG)
    await router.chat(conversation(1, 500), session="s1")
    holder, other = router.decode if router.decode[0].retained else router.decode[::-1]
    holder.frozen = True  # as SIGSTOP: connections are accepted, nothing answers

    response = await router.chat(conversation(2, 500), session="s1")
    holder.frozen = False

    assert response.status_code == 200
    assert response.headers["x-agentkv-kv-path"] == "fallback"
    assert router.prefill[0].completions()[-1].kv_params == cold_prefill_params()
    assert len(other.completions()) == 1
    assert await router.metric('agentkv_engine_errors_total{kind="timeout",role="decode"}') == 1


async def test_decode_step_without_progress_is_aborted_and_served_elsewhere(make_router):
    """Non-streamed: no byte comes back before the answer is complete, so the router reads
    the engine's progress beside it."""
    router = await make_router(n_decode=2, **FAST_WATCHDOG)
    router.decode[0].faults.append("hang")  # answers /metrics, its counters stay flat

    response = await router.chat(conversation(1, 50))

    assert response.status_code == 200
    assert len(router.decode[1].completions()) == 1
    # It might have been waiting on P's KV: the other engine computes the prompt itself.
    assert "do_remote_prefill" not in router.decode[1].completions()[0].kv_params
    assert await router.metric('agentkv_engine_errors_total{kind="stall",role="decode"}') == 1
    assert router.state.decode.engines[0].healthy is False  # suspect...
    await router.state.health.check_all()
    assert router.state.decode.engines[0].healthy is True  # ...until its health probe passes


async def test_frozen_decode_engine_is_left_for_another_before_the_first_chunk(make_router):
    router = await make_router(n_decode=2, **FAST_WATCHDOG)
    router.decode[0].frozen = True

    response = await router.chat(conversation(1, 50), stream=True)
    router.decode[0].frozen = False

    assert response.status_code == 200
    assert response.text.rstrip().endswith("data: [DONE]")
    assert len(router.decode[1].completions()) == 1
    assert await router.metric('agentkv_engine_errors_total{kind="hang",role="decode"}') == 1


async def test_steps_watched_at_once_share_one_progress_read_per_engine(make_router):
    settings = FAST_WATCHDOG | {"faults": FAST_WATCHDOG["faults"] | {"stall_s": 5.0}}
    router = await make_router(**settings)
    router.decode[0].delay_s = 0.5  # ten progress periods: every step is watched

    responses = await asyncio.gather(*(router.chat(conversation(1, 50)) for _ in range(8)))

    assert all(response.status_code == 200 for response in responses)
    # One read per half period at most (about 20), not one per step and period (80).
    assert 0 < router.decode[0].metrics_reads <= 0.5 / 0.025 + 2


async def test_stream_that_stops_midway_is_continued_after_the_stall_deadline(make_router):
    router = await make_router(n_decode=2, **FAST_WATCHDOG)
    router.decode[0].stall_after_chunks = 2  # bytes went out: the stream goes on elsewhere

    response = await router.chat(conversation(1, 50), stream=True)

    assert response.status_code == 200
    assert response.text.count("data: ") == 5 and response.text.endswith("data: [DONE]\n\n")
    assert len(router.decode[1].completions()) == 1
    assert await router.metric('agentkv_engine_errors_total{kind="stream",role="decode"}') == 1
    assert await router.metric("agentkv_streams_resumed_total") == 1
    assert router.state.decode.engines[0].healthy is False


async def test_stream_of_an_engine_frozen_midway_is_continued_long_before_the_stall_deadline(
    make_router,
):
    """Frozen (as SIGSTOP) after two chunks: its silent stream's health probes go unanswered,
    so the stream goes on elsewhere in about a second, not after ``stall_s``."""
    slow_stall = FAST_WATCHDOG | {"faults": FAST_WATCHDOG["faults"] | {"stall_s": 60.0}}
    router = await make_router(n_decode=2, **slow_stall)
    router.decode[0].freeze_after_chunks = 2

    response = await asyncio.wait_for(router.chat(conversation(1, 50), stream=True), 10)
    router.decode[0].frozen = False

    assert response.status_code == 200
    assert response.text.count("data: ") == 5 and response.text.endswith("data: [DONE]\n\n")
    assert len(router.decode[1].completions()) == 1
    assert await router.metric("agentkv_streams_resumed_total") == 1
    assert router.state.decode.engines[0].healthy is False


async def test_stream_that_stops_midway_ends_when_no_engine_can_continue_it(make_router):
    router = await make_router(**FAST_WATCHDOG)
    router.decode[0].stall_after_chunks = 2

    response = await router.chat(conversation(1, 50), stream=True)

    assert response.status_code == 200
    assert response.text.count("data: ") == 2 and "[DONE]" not in response.text
    assert await router.metric('agentkv_engine_errors_total{kind="stream",role="decode"}') == 1
    assert await router.metric("agentkv_streams_resumed_total") == 0


async def test_frozen_prefill_engine_is_left_for_another(make_router):
    router = await make_router(n_prefill=2, **FAST_WATCHDOG)
    router.prefill[0].frozen = True

    response = await router.chat(conversation(1, 100))
    router.prefill[0].frozen = False

    assert response.status_code == 200
    assert len(router.prefill[1].completions()) == 1
    assert router.state.prefill.engines[0].healthy is False
    assert await router.metric('agentkv_engine_errors_total{kind="hang",role="prefill"}') == 1


async def test_pull_queued_on_a_busy_prefill_engine_waits_past_pull_s(make_router):
    """Found on the pressure preset: with twelve sessions' prompts queued on P, pulls that
    waited their turn were given up at pull_s (30 s) as stalled and recomputed, which queued
    more work on the same P. A P whose counters move is busy, not stalled: the pull waits."""
    slow_stall = FAST_WATCHDOG["faults"] | {"stall_s": 60.0}
    router = await make_router(faults=slow_stall, timeouts={"pull_s": 0.3})
    await router.chat(conversation(1, 500), session="s1")
    prefill = router.prefill[0]
    prefill.delay_s = 1.0  # the pull waits behind other prompts, three pull_s long

    async def other_prompts() -> None:
        while True:
            await asyncio.sleep(0.05)
            prefill.prompt_tokens_total += 100  # P computes them meanwhile

    busy = asyncio.create_task(other_prompts())
    try:
        response = await router.chat(conversation(2, 500), session="s1")
    finally:
        busy.cancel()

    assert response.headers["x-agentkv-kv-path"] == "reuse"
    assert len(prefill.pulled) == 1
    assert await router.metric('agentkv_engine_errors_total{kind="stall",role="prefill"}') == 0


async def test_pull_without_progress_is_retried_cold_long_before_the_pull_timeout(make_router):
    router = await make_router(**FAST_WATCHDOG | {"timeouts": {"health_s": 0.2, "pull_s": 60}})
    await router.chat(conversation(1, 500), session="s1")
    router.prefill[0].faults.append("hang")  # as a pull parked on a dead holder

    response = await router.chat(conversation(2, 500), session="s1")

    assert response.status_code == 200
    assert response.headers["x-agentkv-kv-path"] == "fallback"
    pull, cold = router.prefill[0].completions()[1:3]
    assert pull.kv_params["remote_request_id"] and cold.kv_params == cold_prefill_params()
    assert router.state.prefill.engines[0].healthy is True  # the pull stalled, not P
    assert await router.metric('agentkv_engine_errors_total{kind="stall",role="prefill"}') == 1


# Progress reads too far apart to find anything within these tests: only the health probes
# sent as a step starts can.
SLOW_PROGRESS = FAST_WATCHDOG | {"faults": FAST_WATCHDOG["faults"] | {"progress_every_s": 30.0}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_frozen_only_prefill_engine_is_found_by_health_probes_as_the_step_starts(
    make_router, stream
):
    """The only P stops (SIGSTOP) between turns: its step is left after two unanswered health
    probes, not after the progress reads, and the turn is served decode-only."""
    router = await make_router(**SLOW_PROGRESS)
    router.prefill[0].frozen = True

    response = await asyncio.wait_for(router.chat(conversation(1, 100), stream=stream), 10)
    router.prefill[0].frozen = False

    assert response.status_code == 200
    assert "do_remote_prefill" not in router.decode[0].completions()[0].kv_params
    assert router.prefill[0].metrics_reads == 0
    assert router.state.prefill.engines[0].healthy is False
    assert await router.metric('agentkv_engine_errors_total{kind="hang",role="prefill"}') == 1


async def test_the_only_decode_engine_answering_its_probes_late_is_tried_again(make_router):
    """Found on the pressure preset: a busy decode engine's API server left two 0.5 s health
    probes unanswered, the turn's only decode engine was given up as hung, and a cold turn
    failed with 502. It refused nothing: with no other engine, it is tried again."""
    router = await make_router(**SLOW_PROGRESS)
    decode = router.decode[0]
    decode.frozen = True

    async def busy_for_a_moment() -> None:
        await asyncio.sleep(1.5)  # past two unanswered probes, then it answers again
        decode.frozen = False

    thaw = asyncio.create_task(busy_for_a_moment())
    response = await asyncio.wait_for(router.chat(conversation(1, 50)), 10)
    await thaw

    assert response.status_code == 200
    assert await router.metric('agentkv_engine_errors_total{kind="hang",role="decode"}') >= 1


async def test_frozen_decode_engine_is_left_for_another_before_its_progress_is_read(make_router):
    router = await make_router(n_decode=2, **SLOW_PROGRESS)
    router.decode[0].frozen = True

    response = await asyncio.wait_for(router.chat(conversation(1, 50)), 10)
    router.decode[0].frozen = False

    assert response.status_code == 200
    assert len(router.decode[1].completions()) == 1
    assert router.decode[0].metrics_reads == 0
    assert await router.metric('agentkv_engine_errors_total{kind="hang",role="decode"}') == 1


async def test_an_engine_that_answers_its_health_probe_is_not_left(make_router):
    """A slow step on a live engine: the probes beside it pass, the step goes on."""
    router = await make_router(**SLOW_PROGRESS)
    router.prefill[0].delay_s = 0.6  # three probe timeouts

    response = await router.chat(conversation(1, 100))

    assert response.status_code == 200
    assert len(router.prefill[0].completions()) == 1
    assert "do_remote_prefill" in router.decode[0].completions()[0].kv_params
    assert router.state.prefill.engines[0].healthy is True
