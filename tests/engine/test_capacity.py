"""The router learns the decode engine's KV size from its holdings and keeps account of what
each session holds there, and a live turn does not wait for blocks that holdings fill
(docs/router.md, "Capacity"), on real vLLM engines: the connector reads the size from vLLM's KV
cache config, and only a real engine makes a request wait for blocks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import httpx
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


class Filled:
    """A router in front of the stack's P and D whose sessions' holdings fill D: each holds one
    long prompt, retained for minutes, and the prompt of one more does not fit beside them."""

    def __init__(self, stack: Stack, client: httpx.AsyncClient, sessions: list[str]) -> None:
        self.stack = stack
        self.client = client
        self.sessions = sessions

    async def turn(self, session: str | None, seed: int) -> httpx.Response:
        body = {"model": self.stack.served_name, "prompt": prompt_of(seed), "max_tokens": 1}
        headers = {"x-agentkv-next-turn-seconds": "300"}  # retained for minutes
        if session is not None:
            headers["x-session-id"] = session
        return await self.client.post("/v1/completions", json=body, headers=headers)

    async def live_turn(self) -> httpx.Response:
        """A turn of no session: its prompt needs as many blocks as a session holds."""
        return await self.turn(None, len(self.sessions))

    async def metric(self, name: str, **labels: str) -> float:
        return sample((await self.client.get("/metrics")).text, name, **labels) or 0.0


@contextlib.asynccontextmanager
async def filled_decode(stack: Stack, **settings: Any) -> AsyncIterator[Filled]:
    """:class:`Filled` through a router of ``settings``; afterwards every session is ended and
    D's memory is back to where it was (the stack's later tests need it)."""
    decode = stack.decode[0].url
    blocks, block_size = engine_blocks(decode)
    per_session = -(-(PROMPT + 1) // block_size)  # prompt and one output token, whole blocks
    sessions = [f"fill-{time.time_ns()}-{i}" for i in range(blocks // per_session)]
    router = Settings(
        prefill_urls=(stack.prefill[0].url,),
        decode_urls=(decode,),
        local={"enabled": False},
        health_interval_s=3600.0,
        **settings,
    )
    engine = EngineClient(decode, stack.served_name, timeout=30)
    usage_before = engine.kv_usage()
    async with serve_in_process(router, timeout_s=120.0) as (_app, client):
        filled = Filled(stack, client, sessions)
        try:
            for seed, session in enumerate(sessions):
                assert (await filled.turn(session, seed)).status_code == 200
            usage = engine_sample(decode, "vllm:kv_cache_usage_perc")
            # The live turn's prompt does not fit beside the holdings: vLLM alone would keep it
            # waiting until one of them expires, minutes from now.
            assert round((1 - usage) * blocks) < per_session
            yield filled
        finally:
            for session in sessions:
                await client.delete(f"/v1/sessions/{session}")
    # D frees released blocks on its next steps.
    one_block = 1 / blocks
    await asyncio.to_thread(
        wait_until,
        lambda: engine.kv_usage() <= usage_before + one_block,
        "D's KV usage back to where it was before the test",
        timeout_s=60.0,
    )


async def test_a_live_turn_does_not_wait_when_holdings_fill_the_decode_engine(
    stack: Stack,
) -> None:
    decode = stack.decode[0].url
    # Holdings may fill D: only live turns press.
    async with filled_decode(stack, capacity={"retained_fraction": 1.0}) as filled:
        preempted = engine_sample(decode, "vllm:num_preemptions_total")

        began = time.monotonic()
        live = await filled.live_turn()
        seconds = time.monotonic() - began

        assert live.status_code == 200
        assert seconds < 60
        assert await filled.metric("agentkv_kv_releases_total", reason="live_turn") >= 1
        assert engine_sample(decode, "vllm:num_preemptions_total") == preempted
        # D itself says so: no request of this router waited for blocks beside a holding.
        assert await filled.metric(BLOCKS_WAIT, role="decode", beside="retained") == 0
        waited = await filled.metric(BLOCKS_WAIT, role="decode", beside="running")
        print(f"\ndecode requests that waited for blocks, none beside holdings: {waited:.0f}")


BLOCKS_WAIT = "agentkv_engine_blocks_wait_seconds_count"
WAITED_S = 2.0


async def test_a_turn_kept_waiting_by_holdings_is_reported_as_theirs(stack: Stack) -> None:
    """The reproduction of what the capacity ledger prevents: with it off, holdings fill D and
    a live turn waits for blocks until one is released. D's connector measures the wait and
    blames the holdings; the router counts it."""
    decode = EngineClient(stack.decode[0].url, stack.served_name, timeout=30)
    async with filled_decode(stack, capacity={"enabled": False}) as filled:
        waiting_before = decode.metric("vllm:num_requests_waiting")
        live = asyncio.create_task(filled.live_turn())
        await asyncio.to_thread(
            wait_until,
            lambda: decode.metric("vllm:num_requests_waiting") > waiting_before,
            "the live turn waiting on D",
            timeout_s=60.0,
        )
        await asyncio.sleep(WAITED_S)
        assert not live.done()
        await filled.client.delete(f"/v1/sessions/{filled.sessions[0]}")  # room for it
        assert (await live).status_code == 200

        count = await filled.metric(BLOCKS_WAIT, role="decode", beside="retained")
        seconds = await filled.metric(
            "agentkv_engine_blocks_wait_seconds_sum", role="decode", beside="retained"
        )
        print(f"\nD measured the live turn's wait beside holdings: {seconds:.2f} s")
        assert count == 1
        assert seconds >= WAITED_S


def prompt_of(seed: int) -> list[int]:
    rng = random.Random(f"{__name__}:live:{seed}")
    return [rng.randrange(10, 4000) for _ in range(PROMPT)]
