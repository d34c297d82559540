"""Overload: a busy engine is not a dead one, and turns beyond what the engines serve wait by
priority or are refused as they arrive (docs/router.md, "Admission"; docs/faults.md, "Busy is
not dead")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import httpx
import openai

import agentkv
from agentkv import protocol
from agentkv_server.router.auth import tenant_id
from agentkv_server.testing import InProcessRouter, StubEngine, conversation, tool_result
from agentkv_server.testing.harness import serve_on_loopback

# The stub prefills one prompt at a time, 2 ms a token: a 500-word history takes about a second.
SLOW_S_PER_TOKEN = 2e-3
# Progress read often, stalls found fast: a test that mistakes busy for stuck fails quickly.
WATCHFUL = {"progress_every_s": 0.05, "stall_s": 0.3, "liveness_cache_s": 60.0}


def busy_prefill(router: InProcessRouter, s_per_token: float = SLOW_S_PER_TOKEN) -> None:
    router.cluster.prefill_s_per_token = s_per_token
    for engine in router.prefill:
        engine.one_prompt_at_a_time = True


async def marked_down(router: InProcessRouter) -> float:
    return await router.metric("agentkv_engines_marked_down_total")


async def test_a_prefill_longer_than_stall_s_is_progress_not_a_stall(make_router):
    """Reproduces a 64k-token turn on tiny-long: vLLM's token counters stay flat until a long
    prompt's prefill ends, and the router declared P stalled after 60 s, then D, and answered
    502. The engine's KV cache usage moves with every chunk it computes."""
    router = await make_router(faults=WATCHFUL)
    busy_prefill(router)  # ~1 s of prefill: three times stall_s

    response = await router.chat(conversation(1, 500))

    assert response.status_code == 200
    assert len(router.decode[0].completions()) == 1
    assert "do_remote_prefill" in router.decode[0].completions()[0].kv_params  # P's KV, read
    assert await router.metric("agentkv_engine_errors_total") == 0
    assert await marked_down(router) == 0


async def test_turns_queued_behind_a_burst_wait_their_turn_and_no_engine_is_marked_down(
    make_router,
):
    """The burst of issue 48: cold turns queued on P past a step deadline marked P down, the
    fallbacks then prefilled on D, which was marked down in turn; 8 of 51 turns failed. Here
    the burst takes eight times a turn's prefill, and every turn answers from P's KV."""
    router = await make_router(faults=WATCHFUL)
    busy_prefill(router, 1e-3)  # ~0.5 s per turn, one at a time

    responses = await asyncio.gather(
        *(router.chat(conversation(1, 500), session=f"s{i}") for i in range(8))
    )

    assert [response.status_code for response in responses] == [200] * 8
    assert all("do_remote_prefill" in step.kv_params for step in router.decode[0].completions())
    assert await marked_down(router) == 0
    assert await router.metric("agentkv_engine_errors_total") == 0


async def test_a_turn_out_of_time_gets_504_and_is_not_repeated_elsewhere(make_router):
    router = await make_router(n_decode=2, faults=WATCHFUL, timeouts={"first_token_s": 0.4})
    busy_prefill(router)  # ~1 s: past the deadline, P moving all along

    began = time.monotonic()
    response = await router.chat(conversation(1, 500))

    assert response.status_code == 504
    assert time.monotonic() - began < 1.0
    error = response.json()["error"]
    assert error["code"] == "turn_timeout" and "prefill" in error["message"]
    assert response.headers["x-should-retry"] == "false"
    assert [len(engine.completions()) for engine in router.decode] == [0, 0]  # no fallback
    assert await router.metric('agentkv_turns_timed_out_total{phase="prefill"}') == 1
    assert await router.metric("agentkv_engine_errors_total") == 0
    assert await marked_down(router) == 0
    assert all(engine.healthy for engine in router.state.prefill.engines)


async def test_follow_ups_go_before_new_sessions_first_turns(make_router):
    router = await make_router(faults=WATCHFUL, admission={"prefill_queue_s": 0.0})
    busy_prefill(router, 1e-3)
    await router.chat(history("running", 1, 50), session="running")  # P's rate learned

    new = [
        asyncio.create_task(router.chat(history(f"new{i}", 1, 300), session=f"new{i}"))
        for i in range(4)
    ]
    await asyncio.sleep(0.05)  # the first is on P, the other three held by the router
    follow_up = await router.chat(history("running", 2, 50), session="running")
    rest = await asyncio.gather(*new)

    assert follow_up.status_code == 200 and all(r.status_code == 200 for r in rest)
    order = sessions_on(router.prefill[0])
    assert order == ["running", "new0", "running", "new1", "new2", "new3"]
    timing = follow_up.headers["server-timing"]
    assert "queue;dur=" in timing and 'desc="follow_up"' in timing
    assert (
        await router.metric('agentkv_admission_queued_total{priority="new",tenant="anonymous"}')
        == 3
    )
    assert (
        await router.metric(
            'agentkv_admission_queued_total{priority="follow_up",tenant="anonymous"}'
        )
        == 1
    )


async def test_one_tenants_burst_does_not_stall_another_tenant(make_router):
    keys = ["a" * 16, "b" * 16]
    router = await make_router(faults=WATCHFUL, api_keys=keys, admission={"prefill_queue_s": 0})
    busy_prefill(router, 1e-3)
    bearer = [{"authorization": f"Bearer {key}"} for key in keys]

    burst = [
        asyncio.create_task(
            router.chat(history(f"a{i}", 1, 300), session=f"a{i}", headers=bearer[0])
        )
        for i in range(6)
    ]
    await asyncio.sleep(0.05)
    steady = await router.chat(history("b0", 1, 300), session="b0", headers=bearer[1])
    await asyncio.gather(*burst)

    assert steady.status_code == 200
    assert sessions_on(router.prefill[0]).index("b0") == 2  # after two of the burst's six
    held_a = f'agentkv_admission_queued_total{{priority="new",tenant="{tenant_id(keys[0])}"}}'
    assert await router.metric(held_a) == 5


async def test_turns_predicted_to_wait_too_long_are_refused_at_once(make_router):
    router = await make_router(faults=WATCHFUL, admission={"max_wait_s": 1.0})
    busy_prefill(router, 1e-3)
    await router.chat(history("warm", 1, 600))  # P's service rate, as the router learns it

    began = time.monotonic()
    burst = await asyncio.gather(
        *(timed(router.chat(history(f"new{i}", 1, 600), session=f"new{i}")) for i in range(5))
    )

    served = [seconds for response, seconds in burst if response.status_code == 200]
    refused = [(r, seconds) for r, seconds in burst if r.status_code == 503]
    assert len(served) == 2  # waits of about 0 and 0.6 s; the others 1.2 s and more
    assert len(refused) == 3 and all(seconds < 0.5 for _, seconds in refused)
    for response, _ in refused:
        assert response.json()["error"]["code"] == "overloaded"
        assert 1 <= int(response.headers["retry-after"]) <= 60
        assert response.headers["x-should-retry"] == "true"
    assert (
        await router.metric('agentkv_admission_refused_total{priority="new",tenant="anonymous"}')
        == 3
    )
    assert time.monotonic() - began < 3.0  # no refused turn was computed


async def test_a_refused_follow_up_keeps_its_holding_for_its_next_try(make_router):
    router = await make_router(faults=WATCHFUL, admission={"max_wait_s": 0.1})
    busy_prefill(router, 1e-3)
    for session in ("s1", "s2"):  # P's rate learned, both held
        await router.chat(history(session, 1, 500), session=session)
    long_tool_result = tool_result(history("s2", 1, 500), 600)  # 0.6 s of new tokens on P
    other = asyncio.create_task(router.chat(long_tool_result, session="s2"))
    await asyncio.sleep(0.05)

    refused = await router.chat(history("s1", 2, 500), session="s1")  # behind s2's follow-up
    await other
    retried = await router.chat(history("s1", 2, 500), session="s1")

    assert refused.status_code == 503
    assert retried.status_code == 200
    assert retried.headers[protocol.HEADER_KV_PATH] == "reuse"
    assert router.prefill[0].pulled and router.prefill[0].pulled[-1][2] > 500


async def test_a_follow_up_is_not_held_behind_new_sessions_prompts_in_flight(make_router):
    """Prefill engines compute a long prompt a slice at a time beside the others
    (admission.prefill_step_tokens): a follow-up sent at once waits one step, not the prompt."""
    router = await make_router(faults=WATCHFUL, admission={"prefill_queue_s": 0.0})
    busy_prefill(router, 1e-3)
    await router.chat(history("s1", 1, 300), session="s1")
    new = asyncio.create_task(router.chat(history("new", 1, 1000), session="new"))
    await asyncio.sleep(0.05)

    follow_up = await router.chat(history("s1", 2, 300), session="s1")
    await new

    assert follow_up.status_code == 200
    assert "queue;dur=" not in follow_up.headers["server-timing"]  # sent at once
    assert (
        await router.metric(
            'agentkv_admission_queued_total{priority="follow_up",tenant="anonymous"}'
        )
        == 0
    )


async def test_a_pull_held_in_the_queue_keeps_its_holding_past_its_retention(make_router):
    """The decode engine would free a holding when its retention runs out, whatever waits for
    it: the router renews it while the turn that pulls it is held."""
    router = await make_router(
        faults=WATCHFUL,
        admission={"prefill_queue_s": 0.0},
        retention={"default_s": 2.0, "safety_margin_s": 0.2, "slack_s": 2.0},
    )
    busy_prefill(router, 1e-3)
    for session in ("s1", "s2"):  # held 2 s on D
        await router.chat(history(session, 1, 500), session=session)
    long_tool_result = tool_result(history("s2", 1, 500), 3000)  # ~3 s of new tokens on P
    other = asyncio.create_task(router.chat(long_tool_result, session="s2"))
    await asyncio.sleep(0.05)

    follow_up = await router.chat(history("s1", 2, 500), session="s1")  # held ~3 s behind it
    await other

    assert follow_up.status_code == 200
    assert follow_up.headers[protocol.HEADER_KV_PATH] == "reuse"
    assert "queue;dur=" in follow_up.headers["server-timing"]
    assert router.decode[0].renewed  # on the engine that holds it
    assert router.prefill[0].pulled[-1][2] > 500


async def test_the_openai_client_retries_a_refused_turn_after_retry_after(make_router):
    """What an agent on the openai client sees (2 retries by default, honouring Retry-After up
    to two minutes): its turn is served once the queue has room, over real HTTP."""
    router = await make_router(faults=WATCHFUL, admission={"max_wait_s": 0.9})
    busy_prefill(router, 1e-3)
    await router.chat(history("warm", 1, 600))
    async with serve_on_loopback(router.app) as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="-")
        burst = [  # 0.6 s each: the second waits for the first, a third would wait 1.15 s
            asyncio.create_task(router.chat(history(f"new{i}", 1, 600), session=f"new{i}"))
            for i in range(2)
        ]
        await asyncio.sleep(0.05)
        began = time.monotonic()
        answer = await client.chat.completions.with_raw_response.create(
            model=router.cluster.model, messages=history("late", 1, 300), max_tokens=4
        )
        waited = time.monotonic() - began
        await client.close()
        await asyncio.gather(*burst)

    assert answer.retries_taken >= 1  # one when the burst ends on time; two on a loaded machine
    assert answer.parse().choices[0].message.content
    assert waited >= 1.0  # it slept Retry-After (at least 1 s) before the try that was served
    assert await router.metric("agentkv_admission_refused_total") >= 1


async def test_the_sdk_retries_a_refused_turn_as_the_same_turn(make_router):
    """agentkv's clients are openai's: a refusal is retried after Retry-After, and the retry
    carries the turn it repeats (its session's count does not move twice)."""
    router = await make_router(faults=WATCHFUL, admission={"max_wait_s": 0.9})
    busy_prefill(router, 1e-3)
    await router.chat(history("warm", 1, 600))
    async with serve_on_loopback(router.app) as url:
        client = agentkv.AsyncOpenAI(base_url=f"{url}/v1", api_key="-")
        burst = [  # 0.6 s each: a new session's first turn would wait 1.15 s
            asyncio.create_task(router.chat(history(f"new{i}", 1, 600), session=f"n{i}"))
            for i in range(2)
        ]
        await asyncio.sleep(0.05)
        with agentkv.session("sdk") as session:
            first = await client.chat.completions.with_raw_response.create(
                model=router.cluster.model, messages=history("sdk", 1, 300), max_tokens=4
            )
            second = await client.chat.completions.create(
                model=router.cluster.model, messages=history("sdk", 2, 300), max_tokens=4
            )
        await asyncio.gather(*burst)
        await client.close()

    assert first.retries_taken == 1
    assert second.choices[0].message.content
    assert session.turn == 2
    assert [turn.kv_path for turn in session.turns] == ["recompute", "reuse"]


def history(name: str, turns: int, n_words: int) -> list[dict[str, Any]]:
    """``conversation`` whose system prompt starts with ``name``: each session's own."""
    messages = conversation(turns, n_words)
    messages[0] = {**messages[0], "content": f"{name} {messages[0]['content']}"}
    return messages


def sessions_on(engine: StubEngine) -> list[str]:
    """The session name of each turn the engine was sent, in the order it was sent."""
    return [step.body["messages"][0]["content"].split(" ", 1)[0] for step in engine.completions()]


async def timed(call: Awaitable[httpx.Response]) -> tuple[httpx.Response, float]:
    began = time.monotonic()
    response = await call
    return response, time.monotonic() - began
