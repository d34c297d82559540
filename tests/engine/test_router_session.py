"""A session through the whole stack (router -> P -> D): turns 2 and later reuse the KV that the
decode engine holds, and the router says so. Token-id prompts make each turn's prompt extend
the previous turn's held tokens exactly."""

from __future__ import annotations

import json
import random
import time
import urllib.request
from typing import Any

import pytest

from agentkv_server.bundle.model import tool_call_logit_bias
from agentkv_server.bundle.stack import Stack
from agentkv_server.testing.probe import KVProbe

pytestmark = pytest.mark.engine

PULLED = "vllm:external_prefix_cache_hits_total"
# Long enough that every turn holds more than P's kv_recompute_threshold (64 tokens) beyond
# the blocks P cached itself on the turn before: below it, P recomputes instead of pulling.
OUTPUT = 100


def tokens(seed: int, n: int) -> list[int]:
    """Token ids no other test module produces: P's and D's prefix caches are shared by the
    whole run, and a prefix another test left there would be a local hit instead of a pull."""
    rng = random.Random(f"{__name__}:{seed}")
    return [rng.randrange(10, 4000) for _ in range(n)]


def complete(stack: Stack, session: str, prompt: list[int]) -> tuple[dict[str, Any], Any]:
    body = {
        "model": stack.served_name,
        "prompt": prompt,
        "max_tokens": OUTPUT,
        "ignore_eos": True,
        "temperature": 0,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        stack.endpoint + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-session-id": session},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response), response.headers


def test_turns_after_the_first_reuse_the_held_kv(stack: Stack, probe: KVProbe) -> None:
    session = f"engine-tier-{time.time_ns()}"
    prompt = tokens(50, 700)
    paths = []
    for turn in range(3):
        pulled_before = probe.p.metric(PULLED)
        answer, headers = complete(stack, session, prompt)
        pulled = probe.p.metric(PULLED) - pulled_before
        paths.append(headers["x-agentkv-kv-path"])
        assert headers["x-agentkv-session-id"] == session
        if turn > 0:
            assert pulled > 0
            assert int(headers["x-agentkv-reused-tokens"]) > 0
        prompt = prompt + answer["choices"][0]["token_ids"] + tokens(51 + turn, 60)
    assert paths == ["recompute", "reuse", "reuse"]


def test_a_required_tool_call_comes_back_parsed(stack: Stack) -> None:
    """The chat template and the hermes parser, end to end. Random weights never close a JSON
    string on their own; tool_call_logit_bias makes them."""
    assert stack.model_dir is not None
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            "strict": True,  # arguments decoded under their schema, not just as any JSON
        },
    }
    body = {
        "model": stack.served_name,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [weather],
        "tool_choice": "required",
        "max_tokens": 100,
        "logit_bias": tool_call_logit_bias(stack.model_dir),
    }
    request = urllib.request.Request(
        stack.endpoint + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-session-id": f"tools-{time.time_ns()}"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        choice = json.load(response)["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"]), dict)
