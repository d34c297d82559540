"""agentkv_openai_agents: Agents SDK runs through agentkv clients are sessions."""

from __future__ import annotations

import importlib
import sys
from typing import Any

import httpx
import pytest
from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    RunContextWrapper,
    RunHooks,
    SQLiteSession,
    Tool,
    function_tool,
)
from agents.lifecycle import RunHooksBase

import agentkv
import agentkv_openai_agents
from agentkv.testing import FakeRouter, Reply, serve
from agentkv_openai_agents import AgentKVHooks, Runner, conversation_session, run_session

NO_TRACING = RunConfig(tracing_disabled=True)


@function_tool
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


@function_tool
def weather(city: str) -> str:
    """Today's weather in a city."""
    return f"sunny in {city}"


class RecordingHooks(RunHooks[Any]):
    def __init__(self) -> None:
        self.events: list[str] = []

    async def on_llm_start(self, context: Any, agent: Any, system_prompt: Any, items: Any) -> None:
        self.events.append("llm")

    async def on_tool_end(self, context: Any, agent: Any, tool: Tool, result: object) -> None:
        self.events.append(f"tool:{tool.name}")


def make_agent(http_client: httpx.AsyncClient) -> Agent[Any]:
    client = agentkv.AsyncOpenAI(base_url="http://fake/v1", api_key="-", http_client=http_client)
    model = OpenAIChatCompletionsModel(model="agentkv-fake", openai_client=client)
    return Agent(
        name="calculator", instructions="Use the tools.", model=model, tools=[add, weather]
    )


async def test_a_run_is_one_session(async_http_client: httpx.AsyncClient, server) -> None:
    hooks = RecordingHooks()

    result = await Runner.run(
        make_agent(async_http_client), "add 2 and 2", hooks=hooks, run_config=NO_TRACING
    )

    assert result.final_output == "done after 2 tool results"
    server.check_tool_loop(server.requests)
    assert hooks.events == ["llm", "tool:add", "llm", "tool:add", "llm"]


async def test_a_memory_session_is_one_agentkv_session_across_runs(
    async_http_client: httpx.AsyncClient, server
) -> None:
    agent = make_agent(async_http_client)
    memory = SQLiteSession("conversation-7")

    await Runner.run(agent, "add 2 and 2", session=memory, run_config=NO_TRACING)
    first = list(server.requests)
    server.requests.clear()
    await Runner.run(agent, "and the weather?", session=memory, run_config=NO_TRACING)

    server.check_tool_loop(first, session_id="conversation-7")
    # The second run re-sends the first run's history, which ends in an assistant text.
    server.check_tool_loop(server.requests, session_id="conversation-7", first_turn=4)
    assert conversation_session(memory).last_turn.kv_path == "reuse"


async def test_streamed_runs_stream_in_the_active_session(
    async_http_client: httpx.AsyncClient, server
) -> None:
    async with agentkv.session("outer") as session:
        result = Runner.run_streamed(make_agent(async_http_client), "add", run_config=NO_TRACING)
    async for _ in result.stream_events():
        pass

    server.check_tool_loop(server.requests, session_id="outer")
    assert all(request.body["stream"] for request in server.requests)
    assert [turn.finish_reason for turn in session.turns] == ["tool_calls", "tool_calls", "stop"]


def test_run_sync_is_one_session(async_http_client: httpx.AsyncClient, server) -> None:
    Runner.run_sync(make_agent(async_http_client), "add 2 and 2", run_config=NO_TRACING)

    server.check_tool_loop(server.requests)


async def test_hooks_feed_tool_time_to_the_session() -> None:
    hooks = AgentKVHooks()
    context = RunContextWrapper(context=None)
    tool: Tool = add
    agent = Agent(name="a")

    with agentkv.session() as session:
        await hooks.on_tool_start(context, agent, tool)
        assert session.predicted_next_turn_seconds is None
        await hooks.on_tool_end(context, agent, tool, "4")

    assert session.predicted_next_turn_seconds is not None


def test_importing_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "agents", None)
    for name in [m for m in sys.modules if m.startswith("agentkv_openai_agents")]:
        monkeypatch.delitem(sys.modules, name)

    with pytest.raises(ImportError, match=r"pip install 'agentkv\[agents\]'"):
        importlib.import_module("agentkv_openai_agents")
    assert agentkv_openai_agents.Runner is Runner


def responses_agent(base_url: str) -> Agent[Any]:
    """An agent on the SDK's default model class, the Responses API one."""
    client = agentkv.AsyncOpenAI(base_url=base_url, api_key="-", max_retries=0)
    model = OpenAIResponsesModel(model="agentkv-fake", openai_client=client)
    return Agent(name="calc", instructions="Use the tools.", model=model, tools=[add])


@pytest.mark.parametrize("streamed", [False, True])
async def test_the_default_responses_model_carries_the_session_over_loopback(
    streamed: bool,
) -> None:
    router = FakeRouter([Reply.tool_call("add", {"a": 2, "b": 2}), Reply("4")])
    with serve(router) as base_url:
        group_id = f"conversation-{'streamed' if streamed else 'run'}"
        config = RunConfig(tracing_disabled=True, group_id=group_id)
        if streamed:
            result = Runner.run_streamed(responses_agent(base_url), "add", run_config=config)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(responses_agent(base_url), "add", run_config=config)

    assert result.final_output == "4"
    wire = router.requests
    assert [r.path for r in wire] == ["/v1/responses"] * 2
    assert [r.headers["x-session-id"] for r in wire] == [group_id] * 2
    assert [r.headers["x-agentkv-turn"] for r in wire] == ["1", "2"]
    assert [r.headers["x-agentkv-tool-continuation"] for r in wire] == ["0", "1"]
    assert all(r.body["prompt_cache_key"] == group_id for r in wire)
    turns = run_session({"run_config": config}).turns
    assert [t.finish_reason for t in turns] == ["tool_calls", "completed"]
    assert turns[-1].kv_path == "reuse"


async def test_group_id_is_one_session_across_runs(
    async_http_client: httpx.AsyncClient, server
) -> None:
    agent = make_agent(async_http_client)
    config = RunConfig(tracing_disabled=True, group_id="thread 9")  # no valid session id

    await Runner.run(agent, "add 2 and 2", run_config=config)
    first = list(server.requests)
    server.requests.clear()
    await Runner.run(agent, "add 3 and 3", run_config={"group_id": "thread 9"})

    session_id = server.check_tool_loop(first)
    assert session_id == run_session({"run_config": config}).id
    server.check_tool_loop(server.requests, session_id=session_id, first_turn=len(first) + 1)


async def test_callbacks_agentkv_does_not_handle_reach_the_inner_hooks_as_they_are() -> None:
    class FutureHooks(RunHooks[Any]):
        async def on_something_new(self, value: int) -> int:  # an event a later SDK might add
            return value + 1

    inner = FutureHooks()
    hooks = AgentKVHooks(inner)

    assert isinstance(hooks, RunHooksBase)
    assert await hooks.on_something_new(1) == 2
    assert hooks.on_llm_start == inner.on_llm_start
    assert hooks.on_agent_end == inner.on_agent_end


def test_the_run_options_the_runner_reads_are_the_sdks() -> None:
    """``Runner`` reads ``session``, ``run_config`` and ``hooks`` from a run's keyword arguments
    by name. The ``agents`` package exports no type of them; their TypedDict, which the adapter
    imports for type checkers only, is held here to still name all three: a rename in a later
    SDK would otherwise leave runs silently in new sessions, without their hooks."""
    from agents.run_config import RunOptions

    assert {"session", "run_config", "hooks"} <= set(RunOptions.__annotations__)
