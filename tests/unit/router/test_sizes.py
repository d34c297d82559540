"""Agent-sized requests under the default limits: a 128k-token history with tool results passes
whole through the router; past ``max_body_bytes`` a request gets a 413 naming the limit.

Agent sessions reach 20k-150k tokens (docs/router.md, "Limits"); the default limits must let
the largest of them through, as chat messages and as a completion's token ids.
"""

from __future__ import annotations

import json
import random

from agentkv import protocol
from agentkv_server.settings import Settings
from agentkv_server.testing import StubCluster, in_process_router

HISTORY_TOKENS = 131_072
WORDS_PER_MESSAGE = 2_000


def agent_history(tokens: int) -> list[dict[str, object]]:
    """User, assistant (with a tool call) and tool messages of random words, ``tokens`` long as
    the stub engines count tokens (words, plus two per message)."""
    rng = random.Random(7)
    messages: list[dict[str, object]] = [{"role": "system", "content": "You are an agent."}]
    count, turn = 6, 0
    while count < tokens:
        words = min(WORDS_PER_MESSAGE, tokens - count - 2)
        text = " ".join(f"w{rng.randrange(50_000)}" for _ in range(max(words, 1)))
        role = ("user", "assistant", "tool")[turn % 3]
        message: dict[str, object] = {"role": role, "content": text}
        if role == "tool":
            message["tool_call_id"] = f"call-{turn}"
        messages.append(message)
        count += 2 + max(words, 1)
        turn += 1
    return messages


async def test_a_128k_token_agent_history_passes_whole_under_the_default_limits() -> None:
    messages = agent_history(HISTORY_TOKENS)
    body = {"model": "stub-model", "messages": messages, "max_tokens": 4}
    assert len(json.dumps(body)) < Settings.model_fields["max_body_bytes"].default
    async with in_process_router(StubCluster(), n_prefill=1, n_decode=1) as router:
        response = await router.client.post(
            "/v1/chat/completions", json=body, headers={protocol.HEADER_SESSION_ID: "long"}
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] >= HISTORY_TOKENS
        steps = [r for e in router.cluster.engines for r in e.requests if "messages" in r.body]
        assert steps and all(r.body["messages"] == messages for r in steps)


async def test_a_128k_token_completion_prompt_of_token_ids_passes() -> None:
    prompt = [random.Random(8).randrange(100_000) for _ in range(HISTORY_TOKENS)]
    body = {"model": "stub-model", "prompt": prompt, "max_tokens": 4}
    async with in_process_router(StubCluster(), n_prefill=1, n_decode=1) as router:
        response = await router.client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == HISTORY_TOKENS


async def test_a_body_past_the_limit_gets_a_413_naming_it() -> None:
    async with in_process_router(StubCluster(), max_body_bytes=1 << 20) as router:
        body = {"model": "stub-model", "messages": agent_history(300_000)}
        response = await router.client.post("/v1/chat/completions", json=body)
        assert response.status_code == 413
        error = response.json()["error"]
        assert error["code"] == "request_too_large" and "1048576" in error["message"]
        assert router.engine_requests() == 0
