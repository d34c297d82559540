"""The Responses API through the whole stack (router -> P -> D): an agentkv client's
``responses.create`` turns, streamed and not, and an OpenAI Agents SDK agent on its default
Responses model, reuse the KV the decode engine holds for their session."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, SQLiteSession

import agentkv
from agentkv_openai_agents import Runner, conversation_session
from agentkv_server.bundle.stack import Stack
from agentkv_server.testing.probe import KVProbe

pytestmark = pytest.mark.engine

PULLED = "vllm:external_prefix_cache_hits_total"
# More than P's kv_recompute_threshold (64 tokens) beyond the prompt P cached itself on the
# turn before: below it, P recomputes instead of pulling (test_router_session.py).
OUTPUT = 100
# Common words, about one token each: random sequences of them are texts no other test sends.
VOCABULARY = [
    "apple",
    "river",
    "stone",
    "cloud",
    "light",
    "table",
    "green",
    "music",
    "paper",
    "water",
    "north",
    "house",
]


def words(seed: str, n: int) -> str:
    """Text no other test sends: a prefix another test left in P's cache would be a local hit."""
    rng = random.Random(f"{__name__}:{seed}")
    return " ".join(rng.choice(VOCABULARY) for _ in range(n))


def test_responses_turns_in_a_session_reuse_the_held_kv(stack: Stack, probe: KVProbe) -> None:
    client = agentkv.OpenAI(base_url=f"{stack.endpoint}/v1", api_key="unused")
    items: list[Any] = [{"role": "user", "content": words("first", 20)}]
    options: dict[str, Any] = {
        "model": stack.served_name,
        "instructions": words("instructions", 600),
        "max_output_tokens": OUTPUT,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    pulled_before = probe.p.metric(PULLED)
    with agentkv.session(f"responses-{time.time_ns()}") as session:
        answer = client.responses.create(input=items, **options)
        assert answer.usage is not None and answer.usage.output_tokens == OUTPUT
        assert getattr(answer, "kv_transfer_params", None) is None
        items += [item.model_dump(exclude_none=True) for item in answer.output]
        items.append({"role": "user", "content": words("second", 20)})

        events = list(client.responses.create(input=items, stream=True, **options))
        assert events[-1].type == "response.completed"
        streamed = events[-1].response
        assert getattr(streamed, "kv_transfer_params", None) is None
        items += [item.model_dump(exclude_none=True) for item in streamed.output]
        items.append({"role": "user", "content": words("third", 20)})

        client.responses.create(input=items, **options)  # after the streamed turn's holding

    turns = session.turns
    assert [turn.kv_path for turn in turns] == ["recompute", "reuse", "reuse"]
    assert all((turn.reused_tokens or 0) > 600 for turn in turns[1:])
    assert probe.p.metric(PULLED) - pulled_before > 0


def test_an_agents_sdk_agent_on_its_default_model_reuses_kv(stack: Stack) -> None:
    client = agentkv.AsyncOpenAI(base_url=f"{stack.endpoint}/v1", api_key="unused")
    agent = Agent(
        name="assistant",
        instructions=words("agent", 600),
        model=OpenAIResponsesModel(model=stack.served_name, openai_client=client),
        model_settings=ModelSettings(max_tokens=16, temperature=0),
    )
    memory = SQLiteSession(f"responses-agent-{time.time_ns()}")

    async def converse() -> None:
        config = RunConfig(tracing_disabled=True)
        for question in ("first", "second"):
            await Runner.run(agent, words(question, 20), session=memory, run_config=config)

    asyncio.run(converse())

    turns = conversation_session(memory).turns
    assert [turn.kv_path for turn in turns] == ["recompute", "reuse"]
