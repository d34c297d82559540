"""Turns through the router: cold, reuse, streamed, sessionless, ended; what engines receive."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from agentkv_server.testing.harness import conversation
from agentkv_server.wire import cold_prefill_params


async def test_cold_turn_runs_prefill_then_decode_and_records_a_holding(make_router):
    router = await make_router()
    response = await router.chat(conversation(1, 200), session="s1")

    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "w0 w1 w2 w3 "
    assert "kv_transfer_params" not in response.json()
    assert response.headers["x-agentkv-session-id"] == "s1"
    assert response.headers["x-agentkv-kv-path"] == "recompute"
    assert response.headers["x-agentkv-reused-tokens"] == "0"

    (prefill,) = router.prefill[0].completions()
    assert prefill.body["max_tokens"] == 1 and prefill.body["stream"] is False
    assert prefill.kv_params == cold_prefill_params()
    (decode,) = router.decode[0].completions()
    assert decode.kv_params["remote_engine_id"] == router.prefill[0].engine_id
    assert decode.kv_params["agentkv_retention_seconds"] == 120.0  # no hint: the default
    assert decode.kv_params["agentkv_ticket"]
    assert decode.body["max_tokens"] == 4

    holding = await router.state.store.take("s1")
    assert holding is not None and holding.decode_url == router.decode[0].url
    assert holding.num_tokens == 200 + 4 + 4 + 2  # system + user (2 words) + 2 per message + output


async def test_second_turn_pulls_the_holders_kv(make_router):
    router = await make_router()
    await router.chat(conversation(1, 500), session="s1")
    (held_id,) = router.decode[0].retained

    response = await router.chat(conversation(2, 500), session="s1")

    assert response.headers["x-agentkv-kv-path"] == "reuse"
    pull = router.prefill[0].completions()[-1].kv_params
    assert pull["remote_request_id"] == held_id
    assert pull["remote_engine_id"] == router.decode[0].engine_id
    assert pull["do_remote_decode"] is True
    held = 500 + 2 + 2 + 2 + 4  # system, user message (2 per message for the template), output
    assert response.headers["x-agentkv-reused-tokens"] == str(held)
    assert router.prefill[0].pulled == [(router.decode[0].engine_id, held_id, held)]


async def test_reused_tokens_fall_back_to_held_tokens_when_prefill_reports_no_cache(
    make_router,
):
    router = await make_router()
    router.prefill[0].report_cached_tokens = False
    await router.chat(conversation(1, 500), session="s1")
    response = await router.chat(conversation(2, 500), session="s1")

    assert response.headers["x-agentkv-kv-path"] == "reuse"
    assert response.headers["x-agentkv-reused-tokens"] == "510"


async def test_streamed_turn_records_its_holding_from_the_engines_report(make_router):
    router = await make_router()
    response = await router.chat(conversation(1, 300), session="s1", stream=True)

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["choices"][0]["delta"]["content"] == "w0 "

    response = await router.chat(conversation(2, 300), session="s1", stream=True)
    assert response.headers["x-agentkv-kv-path"] == "reuse"


async def stream_without_waiting_for_reports(router, turn: int) -> httpx.Response:
    """A streamed turn sent the moment the previous stream ended, as an agent loop sends it."""
    body = {
        "model": router.cluster.model,
        "messages": conversation(turn, 300),
        "max_tokens": 4,
        "stream": True,
    }
    return await router.client.post(
        "/v1/chat/completions", json=body, headers={"x-session-id": "eager"}
    )


async def test_a_streamed_turn_ends_only_once_its_holding_is_reported(make_router):
    router = await make_router()
    router.cluster.engines[-1].report_delay_s = 0.2  # D reports well after its last byte

    await stream_without_waiting_for_reports(router, 1)
    second = await stream_without_waiting_for_reports(router, 2)

    assert second.headers["x-agentkv-kv-path"] == "reuse"
    assert second.text.rstrip().endswith("data: [DONE]")


async def test_the_wait_for_a_report_is_bounded(make_router):
    router = await make_router(timeouts={"report_s": 0.05})
    router.cluster.engines[-1].report_delay_s = 2.0  # far later than the router waits

    began = time.monotonic()
    first = await stream_without_waiting_for_reports(router, 1)
    assert time.monotonic() - began < 1.5  # margin for a loaded machine
    assert first.text.rstrip().endswith("data: [DONE]")
    second = await stream_without_waiting_for_reports(router, 2)
    assert second.headers["x-agentkv-kv-path"] == "recompute"


async def test_upstream_streams_end_without_waiting_for_a_report_that_never_comes(make_router):
    """The `upstream` policy sends engines no ticket, so no report can come: its streams must not
    be held back for `report_s` (the bench's upstream mode paid it on every streamed turn)."""
    router = await make_router(policy="upstream", timeouts={"report_s": 5.0})

    began = time.monotonic()
    first = await stream_without_waiting_for_reports(router, 1)
    assert first.text.rstrip().endswith("data: [DONE]")
    assert time.monotonic() - began < 2.5


async def test_completions_endpoint_reuses_too(make_router):
    router = await make_router()
    prompt = "word " * 400
    first = await router.client.post(
        "/v1/completions",
        json={"model": router.cluster.model, "prompt": prompt, "max_tokens": 2},
        headers={"x-session-id": "c1"},
    )
    second = await router.client.post(
        "/v1/completions",
        json={"model": router.cluster.model, "prompt": prompt + "more", "max_tokens": 2},
        headers={"x-session-id": "c1"},
    )
    assert first.json()["choices"][0]["text"] == "w0 w1 "
    assert second.headers["x-agentkv-kv-path"] == "reuse"


async def test_request_without_session_is_plain_disaggregated_serving(make_router):
    router = await make_router()
    response = await router.chat(conversation(1, 300))

    assert response.status_code == 200
    assert "x-agentkv-session-id" not in response.headers
    assert response.headers["x-agentkv-kv-path"] == "recompute"
    (decode,) = router.decode[0].completions()
    assert decode.kv_params["agentkv_retention_seconds"] == 0.0
    assert "agentkv_ticket" not in decode.kv_params
    assert router.decode[0].retained == {}
    assert await router.state.store.count() == 0


async def test_agentkv_fields_never_reach_engines(make_router):
    router = await make_router()
    body = {
        "prompt_cache_key": "s1",
        "conversation_id": "s1",
        "kv_transfer_params": {"remote_engine_id": "injected"},
        "agentkv": {"session_id": "s1", "turn": 1, "next_turn_seconds": 3.0},
    }
    headers = {"x-agentkv-turn": "1", "x-dynamo-session-id": "s1", "authorization": "Bearer k"}
    response = await router.chat(conversation(1, 50), headers=headers, **body)

    assert response.headers["x-agentkv-session-id"] == "s1"
    for engine in router.cluster.engines:
        for request in engine.completions():
            assert not {"agentkv", "prompt_cache_key", "conversation_id"} & request.body.keys()
            assert request.kv_params.get("remote_engine_id") != "injected"
            lowered = {name.lower() for name in request.headers}
            assert not any(name.startswith("x-agentkv-") or "session" in name for name in lowered)
            assert request.headers["Authorization"] == "Bearer k"


async def test_session_id_conventions_in_priority_order(make_router):
    router = await make_router()
    cases = [
        ({"X-Session-ID": "a", "x-litellm-session-id": "b"}, {"prompt_cache_key": "c"}, "a"),
        ({"x-dynamo-session-id": "d", "x-litellm-session-id": "b"}, {}, "d"),
        ({"x-litellm-session-id": "b"}, {"prompt_cache_key": "c"}, "b"),
        ({}, {"prompt_cache_key": "c", "conversation_id": "e"}, "c"),
        ({}, {"conversation_id": "e"}, "e"),
        ({}, {"agentkv": {"session_id": "f"}}, "f"),
    ]
    for headers, body, expected in cases:
        response = await router.chat(conversation(1, 10), headers=headers, **body)
        assert response.headers["x-agentkv-session-id"] == expected


async def test_retention_follows_the_next_turn_hint_and_header_beats_body(make_router):
    router = await make_router()
    await router.chat(
        conversation(1, 50),
        session="s1",
        headers={"x-agentkv-next-turn-seconds": "20"},
        agentkv={"next_turn_seconds": 1000.0},
    )
    (decode,) = router.decode[0].completions()
    assert decode.kv_params["agentkv_retention_seconds"] == 20 * 2.0 + 60.0


async def test_session_end_asks_the_engine_to_keep_nothing(make_router):
    router = await make_router()
    await router.chat(conversation(1, 500), session="s1")
    response = await router.chat(conversation(2, 500), session="s1", agentkv={"session_end": True})

    assert response.headers["x-agentkv-kv-path"] == "reuse"
    last = router.decode[0].completions()[-1]
    assert last.kv_params["agentkv_retention_seconds"] == 0.0
    assert "agentkv_ticket" not in last.kv_params
    assert router.decode[0].retained == {}
    assert await router.state.store.count() == 0


async def test_concurrent_turns_of_one_session_never_both_reuse(make_router):
    router = await make_router()
    await router.chat(conversation(1, 500), session="s1")
    router.prefill[0].delay_s = 0.05  # both turns are in flight together

    first, second = await asyncio.gather(
        router.chat(conversation(2, 500), session="s1"),
        router.chat(conversation(2, 500), session="s1"),
    )

    paths = sorted(r.headers["x-agentkv-kv-path"] for r in (first, second))
    assert paths == ["recompute", "reuse"]
    assert len(router.prefill[0].pulled) == 1


async def test_tiny_history_is_recomputed_and_its_holding_released(make_router):
    router = await make_router()
    await router.chat([{"role": "user", "content": "hi"}], session="s1")
    (held_id,) = router.decode[0].retained

    response = await router.chat(
        [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}], session="s1"
    )
    await router.state.keeper.drain()

    assert response.headers["x-agentkv-kv-path"] == "recompute"
    assert router.prefill[0].completions()[-1].kv_params == cold_prefill_params()
    assert held_id in router.decode[0].released


async def test_a_holding_no_one_will_read_is_released_before_the_prefill_step(make_router):
    """Released after P's step, a recomputed turn's holding stayed on D, uncounted, for as long
    as the turn queued on a busy P."""
    router = await make_router()
    await router.chat([{"role": "user", "content": "hi"}], session="s1")
    (held_id,) = router.decode[0].retained
    router.prefill[0].delay_s = 0.5

    turn = asyncio.create_task(
        router.chat(
            [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}],
            session="s1",
        )
    )
    await asyncio.sleep(0.25)
    released_during_prefill = held_id in router.decode[0].released
    response = await turn

    assert response.headers["x-agentkv-kv-path"] == "recompute"
    assert released_during_prefill


async def test_releases_close_together_go_to_their_engine_as_one_request(make_router):
    router = await make_router()
    for session in ("s1", "s2"):
        await router.chat(conversation(1, 50), session=session)
    holdings = [await router.state.store.take(session) for session in ("s1", "s2")]
    ids = sorted(holding.params["remote_request_id"] for holding in holdings if holding)
    decode = router.decode[0]
    sent = len(decode.requests)

    router.state.keeper.release_soon(holdings[:1])
    router.state.keeper.release_soon(holdings[1:])
    await router.state.keeper.drain()

    assert [sorted(r.kv_params["agentkv_release"]) for r in decode.requests[sent:]] == [ids]
    assert sorted(decode.released) == ids
    assert not decode.retained


async def test_decode_prefers_the_holder(make_router):
    router = await make_router(n_decode=3)
    await router.chat(conversation(1, 500), session="s1")
    holder = next(engine for engine in router.decode if engine.retained)

    for turn in range(2, 5):
        await router.chat(conversation(turn, 500), session="s1")
        assert len(holder.completions()) == turn


async def test_router_recomputes_when_it_measured_that_prefill_is_cheap(make_router):
    router = await make_router(cost={"pull_overhead_s": 0.5})
    policy = router.state.policy
    held = 2000 + 2 + 4 + 4
    assert policy.predicted_pull_s(held) < policy.predicted_recompute_s(held)  # the prior
    router.cluster.prefill_s_per_token = 0.0  # a model that prefills 2,000 tokens in no time
    await router.chat(conversation(1, 2000), session="s1")
    assert policy.predicted_pull_s(held) > policy.predicted_recompute_s(held)  # measured

    response = await router.chat(conversation(2, 2000), session="s1")

    assert response.headers["x-agentkv-kv-path"] == "recompute"
    assert router.prefill[0].pulled == []


async def test_session_end_refuses_the_holding_of_a_turn_still_in_flight(make_router):
    router = await make_router()
    in_flight = await router.state.keeper.issue(
        "s1", router.decode[0].url, "stub-model", 60.0, streamed=True
    )
    await router.chat(conversation(1, 50), session="s1", agentkv={"session_end": True})

    late = {"remote_request_id": "late", "remote_num_tokens": 60, "agentkv_expires_in_seconds": 60}
    await router.report({"ticket": in_flight.ticket, "kv_transfer_params": late})
    await router.state.keeper.drain()

    assert await router.state.store.count() == 0
    assert router.decode[0].requests[-1].kv_params == {"agentkv_release": ["late"]}
