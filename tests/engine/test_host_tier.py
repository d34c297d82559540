"""A holding released to make room leaves its KV in the decode engine's host tier, and the
session's next turn continues there and loads it back instead of recomputing its history
(connector/hosttier.py, router/capacity.py; docs/router.md, "Capacity"), on a real decode engine
that runs agentkv's connector beside vLLM's offloading connector (bundle/launcher.py
``with_host_tier``), behind a real router, with the shared stack's prefill engine."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentkv_server.bench.engines import decode_kv_args
from agentkv_server.bundle.launcher import EngineProcess
from agentkv_server.bundle.ports import free_ports
from agentkv_server.bundle.stack import Stack
from agentkv_server.settings import Settings
from agentkv_server.testing.harness import serve_in_process
from agentkv_server.testing.probe import EngineClient

pytestmark = pytest.mark.engine

# Each session holds one prompt of PROMPT tokens (32 blocks of 128); D's KV cache holds three.
PROMPT = 4000
SESSIONS = 3
BLOCK = 128
HELD_BLOCKS = PROMPT // BLOCK  # the full blocks a holding leaves in the host tier


def prompt(seed: int, n: int = PROMPT) -> list[int]:
    rng = random.Random(f"{__name__}:{seed}")
    return [rng.randrange(10, 4000) for _ in range(n)]


@pytest.fixture(scope="module")
def tiered_decode(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A decode engine like the stack's, with room for three sessions' KV and a host tier
    below it (a quarter GiB: 32k tokens of the tiny model)."""
    port, side_channel_port = free_ports(2, stack.config.host)
    kv_tokens = SESSIONS * (HELD_BLOCKS + 1) * BLOCK
    spec = dataclasses.replace(
        stack.decode[0].spec,
        port=port,
        side_channel_port=side_channel_port,
        log_path=Path(tmp_path_factory.mktemp("host-tier")) / "decode.log",
        host_tier_gib=0.25,
        engine_args=(
            *stack.decode[0].spec.engine_args,
            *decode_kv_args(kv_tokens),
            "--max-model-len",
            str(kv_tokens),
        ),
        env={},
    )
    engine = EngineProcess(spec)
    engine.start()
    try:
        engine.wait_healthy(300.0)
        yield engine.url
    finally:
        engine.stop()


async def test_a_turn_whose_holding_went_for_room_loads_its_history_from_the_host_tier(
    stack: Stack, tiered_decode: str
) -> None:
    router = Settings(
        prefill_urls=(stack.prefill[0].url,),
        decode_urls=(tiered_decode,),
        capacity={"retained_fraction": 1.0},  # holdings may fill D: only live turns press
        health_interval_s=3600.0,
    )
    engine = EngineClient(tiered_decode, stack.served_name, timeout=30)
    sessions = [f"tier-{time.time_ns()}-{i}" for i in range(SESSIONS)]

    def body(tokens: list[int]) -> dict[str, object]:
        return {
            "model": stack.served_name, "prompt": tokens, "max_tokens": 1, "temperature": 0,
            "logprobs": 1,
        }  # fmt: skip

    async with serve_in_process(router, timeout_s=120.0) as (_app, client):

        async def turn(session: str | None, tokens: list[int], next_s: int) -> httpx.Response:
            headers = {"x-agentkv-next-turn-seconds": str(next_s)}
            if session is not None:
                headers["x-session-id"] = session
            return await client.post("/v1/completions", json=body(tokens), headers=headers)

        try:
            # The first session's next turn is predicted furthest off: it goes first.
            for seed, session in enumerate(sessions):
                next_s = 600 if seed == 0 else 60
                assert (await turn(session, prompt(seed), next_s)).status_code == 200
            loaded_before = engine.metric("vllm:kv_offload_total_bytes_total")
            # A turn of no session as long as a holding: one holding goes to make room, and its
            # blocks are reused for this prompt.
            assert (await turn(None, prompt(SESSIONS), 60)).status_code == 200

            history = [*prompt(0), *prompt(100, 50)]
            resumed = await turn(sessions[0], history, 60)
            assert resumed.status_code == 200, resumed.text
            assert 'desc="host_tier"' in resumed.headers["server-timing"]
            cached = resumed.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= HELD_BLOCKS * BLOCK
            loaded = engine.metric("vllm:kv_offload_total_bytes_total") - loaded_before
            print(f"\nresumed from the host tier: {cached} tokens cached, {loaded:.0f} bytes moved")

            # The loaded KV is the history's: the first token and its log-probability match a
            # cold computation of the same prompt on the prefill engine.
            async with httpx.AsyncClient(base_url=stack.prefill[0].url, timeout=120) as prefill:
                answer = await prefill.post("/v1/completions", json=body(history))
            cold = answer.json()["choices"][0]["logprobs"]
            warm = resumed.json()["choices"][0]["logprobs"]
            assert warm["tokens"] == cold["tokens"]
            assert warm["token_logprobs"][0] == pytest.approx(cold["token_logprobs"][0], abs=1e-3)

            metrics = (await client.get("/metrics")).text
            assert "agentkv_reuse_lost_to_pressure_total 0.0" in metrics
        finally:
            for session in sessions:
                await client.delete(f"/v1/sessions/{session}")
