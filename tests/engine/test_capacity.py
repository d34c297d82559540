"""The router learns the decode engine's KV size from its holdings and keeps account of what
each session holds there, and a live turn does not wait for blocks that holdings fill
(docs/router.md, "Capacity"), on real vLLM engines: the connector reads the size from vLLM's KV
cache config, and only a real engine makes a request wait for blocks."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import urllib.request
from typing import Any

import pytest

from agentkv_server.bundle.stack import Stack
from agentkv_server.settings import CapacitySettings, Settings
from agentkv_server.testing.conditions import wait_until
from agentkv_server.testing.harness import serve_in_process
from agentkv_server.testing.probe import EngineClient

pytestmark = pytest.mark.engine


def prompt(n: int) -> list[int]:
    rng = random.Random(f"{__name__}:{n}")
    return [rng.randrange(10, 4000) for _ in range(n)]


def router_call(stack: Stack, method: str, path: str, body: dict | None = None, **headers: str):
    request = urllib.request.Request(
        stack.endpoint + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"content-type": "application/json", **headers},
        method=method,
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read().decode()


def sample(text: str, name: str, **labels: str) -> float | None:
    """One sample of ``name`` whose labels include ``labels``; None when there is none."""
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if labels.items() <= found.items():
            return float(line.rsplit(" ", 1)[1])
    return None


def engine_metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        return response.read().decode()


def engine_blocks(url: str) -> tuple[int, int]:
    """Usable blocks (all but vLLM's null block) and block size, from vLLM's own
    ``vllm:cache_config_info``."""
    text = engine_metrics(url)
    line = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    return int(labels["num_gpu_blocks"]) - 1, int(labels["block_size"])


def engine_cache_tokens(url: str) -> int:
    blocks, block_size = engine_blocks(url)
    return blocks * block_size


def engine_sample(url: str, name: str) -> float:
    """A vLLM metric, summed over its label sets."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in engine_metrics(url).splitlines()
        if line.startswith((name + " ", name + "{"))
    )


def test_the_router_learns_the_decode_engines_kv_size_and_what_a_session_holds(
    stack: Stack,
) -> None:
    decode = stack.decode[0].url
    session = f"capacity-{time.time_ns()}"
    tokens = prompt(300)
    body = {"model": stack.served_name, "prompt": tokens, "max_tokens": 8, "temperature": 0}
    router_call(stack, "POST", "/v1/completions", body, **{"x-session-id": session})

    metrics = router_call(stack, "GET", "/metrics")
    capacity = sample(metrics, "agentkv_kv_capacity_tokens", engine=decode)
    held = sample(metrics, "agentkv_kv_held_tokens", engine=decode)
    held_bytes = sample(metrics, "agentkv_kv_held_bytes", engine=decode)

    assert capacity == engine_cache_tokens(decode)
    fraction = CapacitySettings().retained_fraction  # the shared stack's router: the defaults
    assert sample(metrics, "agentkv_kv_budget_tokens", engine=decode) == int(capacity * fraction)
    assert held is not None and held >= len(tokens)
    assert held_bytes is not None and held_bytes > held  # every token takes bytes in each layer

    ended_before = sample(metrics, "agentkv_kv_releases_total", reason="session_end") or 0.0
    router_call(stack, "DELETE", f"/v1/sessions/{session}")
    metrics = router_call(stack, "GET", "/metrics")

    assert sample(metrics, "agentkv_kv_releases_total", reason="session_end") == ended_before + 1
    after = sample(metrics, "agentkv_kv_held_tokens", engine=decode)
    assert after is not None and after <= held - len(tokens)


# The tiny model's context is 4096 tokens: each session holds one long prompt.
PROMPT = 4000


async def test_a_live_turn_does_not_wait_when_holdings_fill_the_decode_engine(
    stack: Stack,
) -> None:
    decode = stack.decode[0].url
    blocks, block_size = engine_blocks(decode)
    per_session = -(-(PROMPT + 1) // block_size)  # prompt and one output token, whole blocks
    sessions = [f"fill-{time.time_ns()}-{i}" for i in range(blocks // per_session)]
    settings = Settings(
        prefill_urls=(stack.prefill[0].url,),
        decode_urls=(decode,),
        local={"enabled": False},
        capacity={"retained_fraction": 1.0},  # holdings may fill D: only live turns press
        health_interval_s=3600.0,
    )
    engine = EngineClient(decode, stack.served_name, timeout=30)
    usage_before = engine.kv_usage()
    async with serve_in_process(settings, timeout_s=120.0) as (_app, client):

        async def turn(session: str | None, seed: int) -> Any:
            body = {"model": stack.served_name, "prompt": prompt_of(seed), "max_tokens": 1}
            headers = {"x-agentkv-next-turn-seconds": "300"}  # retained for minutes
            if session is not None:
                headers["x-session-id"] = session
            return await client.post("/v1/completions", json=body, headers=headers)

        try:
            for seed, session in enumerate(sessions):
                assert (await turn(session, seed)).status_code == 200
            usage = engine_sample(decode, "vllm:kv_cache_usage_perc")
            free_blocks = round((1 - usage) * blocks)
            # The live turn's prompt does not fit beside the holdings: vLLM alone would keep it
            # waiting until one of them expires, minutes from now.
            assert free_blocks < per_session
            preempted = engine_sample(decode, "vllm:num_preemptions_total")

            began = time.monotonic()
            live = await turn(None, len(sessions))
            seconds = time.monotonic() - began

            assert live.status_code == 200
            assert seconds < 60
            text = (await client.get("/metrics")).text
            assert (sample(text, "agentkv_kv_releases_total", reason="live_turn") or 0) >= 1
            assert engine_sample(decode, "vllm:num_preemptions_total") == preempted
        finally:
            for session in sessions:  # the stack's later tests need D's memory
                await client.delete(f"/v1/sessions/{session}")
    # D frees released blocks on its next steps: the stack's later tests need its memory back.
    one_block = 1 / blocks
    await asyncio.to_thread(
        wait_until,
        lambda: engine.kv_usage() <= usage_before + one_block,
        "D's KV usage back to where it was before the test",
        timeout_s=60.0,
    )


def prompt_of(seed: int) -> list[int]:
    rng = random.Random(f"{__name__}:live:{seed}")
    return [rng.randrange(10, 4000) for _ in range(PROMPT)]
