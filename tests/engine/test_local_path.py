"""The three paths on real engines: a short follow-up continues on the decode holder (``local``),
a long tool result is pulled to the prefill engine (``reuse``), and each turn's first token
equals a full recompute (the oracle of docs/engines.md). A router of its own, policy ``agentkv``,
runs in process in front of the shared stack's engines."""

from __future__ import annotations

import random
import time
from typing import Any

import httpx
import pytest

from agentkv import protocol
from agentkv_server.bundle.stack import Stack
from agentkv_server.settings import Settings
from agentkv_server.testing import serve_in_process
from agentkv_server.testing.probe import LOGPROB_TOLERANCE, KVProbe, logprob_gap

pytestmark = pytest.mark.engine

HISTORY = 600
OUTPUT = 24
SHORT = 40  # a short tool result: computed on the holder
LONG = 400  # over max_new_tokens: pulled to the prefill engine
MAX_NEW_TOKENS = 200
BLOCK = 128  # vLLM's KV block on the CPU backend: prefix hits come in whole blocks
LOCAL_HITS = "vllm:prefix_cache_hits_total"
PULLED = "vllm:external_prefix_cache_hits_total"


def tokens(seed: int, n: int) -> list[int]:
    """Token ids no other test module produces (the engines' prefix caches are shared)."""
    rng = random.Random(f"{__name__}:{seed}")
    return [rng.randrange(10, 4000) for _ in range(n)]


async def turn(
    client: httpx.AsyncClient, probe: KVProbe, session: str, prompt: list[int]
) -> tuple[httpx.Response, dict[str, Any]]:
    body = probe.judged_body(prompt, OUTPUT)
    response = await client.post(
        "/v1/completions", json=body, headers={protocol.HEADER_SESSION_ID: session}
    )
    assert response.status_code == 200, response.text
    # The breakdown, for docs/router.md (plan includes the holder's /tokenize).
    print(response.headers[protocol.HEADER_KV_PATH], response.headers["server-timing"])
    return response, response.json()["choices"][0]


def assert_equals_recompute(probe: KVProbe, prompt: list[int], choice: dict[str, Any]) -> None:
    recomputed = probe.recomputed_logprobs(prompt)
    assert logprob_gap(choice["logprobs"]["top_logprobs"][0], recomputed) < LOGPROB_TOLERANCE


async def test_short_follow_up_goes_local_and_long_tool_result_is_pulled(
    stack: Stack, probe: KVProbe
) -> None:
    settings = Settings(
        prefill_urls=tuple(engine.url for engine in stack.prefill),
        decode_urls=(stack.decode[0].url,),
        policy="agentkv",
        health_interval_s=3600.0,
        local={"max_new_tokens": MAX_NEW_TOKENS},
        # The tiny model recomputes so fast that a learned model would rightly recompute its
        # short histories (conftest.py); these priors, never refined (no step reaches
        # min_sample_tokens), make the pull path the alternative to the local one.
        cost={"prefill_tokens_per_s": 100.0, "min_sample_tokens": 1_000_000},
    )
    session = f"local-path-{time.time_ns()}"
    prompt = tokens(1, HISTORY)
    async with serve_in_process(settings, timeout_s=120.0) as (_, client):
        response, choice = await turn(client, probe, session, prompt)
        assert response.headers[protocol.HEADER_KV_PATH] == "recompute"

        prompt = prompt + choice["token_ids"] + tokens(2, SHORT)
        local_hits, pulled = probe.d.metric(LOCAL_HITS), probe.p.metric(PULLED)
        response, choice = await turn(client, probe, session, prompt)
        assert response.headers[protocol.HEADER_KV_PATH] == "local"
        assert probe.p.metric(PULLED) == pulled  # no transfer at all
        # The holder's prefix cache served the history (its whole blocks), and the router
        # counts what the engine reported cached.
        hits = round(probe.d.metric(LOCAL_HITS) - local_hits)
        assert hits >= HISTORY // BLOCK * BLOCK
        assert int(response.headers[protocol.HEADER_REUSED_TOKENS]) == hits
        # The oracle's recompute on P caches this prompt there, and P would then find all but
        # a few held tokens in its own cache and pull none: judge this turn after the next.
        local_turn = (prompt, choice)

        prompt = prompt + choice["token_ids"] + tokens(3, LONG)
        pulled = probe.p.metric(PULLED)
        response, choice = await turn(client, probe, session, prompt)
        assert response.headers[protocol.HEADER_KV_PATH] == "reuse"
        assert probe.p.metric(PULLED) > pulled  # P pulled what the local turn left held
        assert_equals_recompute(probe, prompt, choice)
        assert_equals_recompute(probe, *local_turn)
    print_tokenize_cost(stack, probe)


def print_tokenize_cost(stack: Stack, probe: KVProbe) -> None:
    """What counting a chat turn's tokens on the holder costs (docs/router.md)."""
    text = " ".join(f"word{i}" for i in range(700))
    body = {"model": probe.d.model, "messages": [{"role": "user", "content": text}]}
    seconds = []
    with httpx.Client(timeout=30) as client:
        for _ in range(5):
            began = time.perf_counter()
            answer = client.post(stack.decode[0].url + "/tokenize", json=body).json()
            seconds.append(time.perf_counter() - began)
    print(f"/tokenize of {answer['count']} chat tokens: {sorted(seconds)[2] * 1000:.1f} ms median")
