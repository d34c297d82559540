"""agentkv_llamaindex: agent workflow runs through OpenAI / OpenAILike carry one session."""

from __future__ import annotations

import importlib
import sys

import httpx
import pytest
from llama_index.core.agent.workflow import FunctionAgent, ToolCall
from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.tools import FunctionTool
from workflows import Context, Workflow, step
from workflows.events import StartEvent, StopEvent

import agentkv
import agentkv_llamaindex
from agentkv_llamaindex import OpenAI, OpenAILike, context_session, run


def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


def weather(city: str) -> str:
    """Today's weather in a city."""
    return f"sunny in {city}"


TOOLS = [FunctionTool.from_defaults(add), FunctionTool.from_defaults(weather)]


@pytest.fixture
def llm(http_client: httpx.Client, async_http_client: httpx.AsyncClient) -> OpenAILike:
    return OpenAILike(
        model="agentkv-fake",
        api_base="http://fake/v1",
        api_key="-",
        is_chat_model=True,
        is_function_calling_model=True,
        http_client=http_client,
        async_http_client=async_http_client,
    )


async def test_an_agent_run_is_one_session(llm: OpenAILike, server) -> None:
    session = agentkv.session()
    handler = run(FunctionAgent(tools=TOOLS, llm=llm), user_msg="add 2 and 2", session=session)
    await handler

    server.check_tool_loop(server.requests, session_id=session.id)
    assert all(request.body["stream"] for request in server.requests)
    assert [turn.finish_reason for turn in session.turns] == ["tool_calls", "tool_calls", "stop"]
    assert [turn.kv_path for turn in session.turns] == ["recompute", "reuse", "reuse"]


async def test_runs_that_share_a_context_share_a_session(llm: OpenAILike, server) -> None:
    agent = FunctionAgent(tools=TOOLS, llm=llm)
    ctx = Context(agent)

    await run(agent, user_msg="add 2 and 2", ctx=ctx)
    first = list(server.requests)
    server.requests.clear()
    await run(agent, user_msg="and the weather?", ctx=ctx)

    session_id = server.check_tool_loop(first)
    server.check_tool_loop(server.requests, session_id=session_id, first_turn=len(first) + 1)
    assert context_session(ctx).id == session_id


async def test_separate_runs_get_separate_sessions(llm: OpenAILike, server) -> None:
    agent = FunctionAgent(tools=TOOLS, llm=llm)

    await run(agent, user_msg="add 2 and 2")
    first = list(server.requests)
    server.requests.clear()
    await run(agent, user_msg="add 3 and 3")

    assert server.check_tool_loop(first) != server.check_tool_loop(server.requests)


def test_openai_llm_sync_tool_loop_in_a_session(
    http_client: httpx.Client, async_http_client: httpx.AsyncClient, server
) -> None:
    llm = OpenAI(
        model="gpt-4o-mini",
        api_base="http://fake/v1",
        api_key="-",
        http_client=http_client,
        async_http_client=async_http_client,
    )
    history = [ChatMessage(role="user", content="add 2 and 2")]
    with agentkv.session("sync-loop") as session:
        for _ in range(3):
            response = llm.chat_with_tools(TOOLS, chat_history=history)
            history.append(response.message)
            for call in llm.get_tool_calls_from_response(response, error_on_no_tool_call=False):
                output = add(**call.tool_kwargs) if call.tool_name == "add" else "?"
                history.append(
                    ChatMessage(
                        role="tool",
                        content=str(output),
                        additional_kwargs={"tool_call_id": call.tool_id},
                    )
                )

    server.check_tool_loop(server.requests, session_id="sync-loop")
    assert session.turn == 3 and not server.requests[-1].body["stream"]


def test_calls_outside_a_session_are_sent_untagged(llm: OpenAILike, server) -> None:
    llm.chat([ChatMessage(role="user", content="hello")])

    (request,) = server.requests
    assert request.session_id is None and "agentkv" not in request.body


def test_importing_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_index.llms.openai_like", None)
    for name in [m for m in sys.modules if m.startswith("agentkv_llamaindex")]:
        monkeypatch.delitem(sys.modules, name)

    with pytest.raises(ImportError, match=r"pip install 'agentkv\[llamaindex\]'"):
        importlib.import_module("agentkv_llamaindex")
    assert agentkv_llamaindex.OpenAILike is OpenAILike


async def test_the_workflows_own_run_carries_the_context_session(llm: OpenAILike, server) -> None:
    """No wrapper: ``agent.run`` started inside the context's session is that session."""
    agent = FunctionAgent(tools=TOOLS, llm=llm)
    ctx = Context(agent)

    with context_session(ctx):
        handler = agent.run(user_msg="add 2 and 2", ctx=ctx)
    await handler  # awaited outside the block: the run's tasks copied the session at start
    first = list(server.requests)
    server.requests.clear()
    with context_session(ctx):
        await agent.run(user_msg="and the weather?", ctx=ctx)

    session_id = server.check_tool_loop(first, session_id=context_session(ctx).id)
    server.check_tool_loop(server.requests, session_id=session_id, first_turn=len(first) + 1)


async def test_tool_calls_are_timed_through_instrumentation(
    llm: OpenAILike, server, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed: list[tuple[str, float]] = []
    monkeypatch.setattr(
        agentkv.Session, "record_tool_time", lambda self, s: timed.append((self.id, s))
    )

    async with agentkv.session("timed-run"):
        await FunctionAgent(tools=TOOLS, llm=llm).run(user_msg="add 2 and 2")

    server.check_tool_loop(server.requests, session_id="timed-run")
    assert [session_id for session_id, _ in timed] == ["timed-run"] * 2  # one per tool call
    assert all(seconds >= 0 for _, seconds in timed)


async def test_a_step_given_a_tool_call_is_timed_whatever_its_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The timer knows tool steps by their public ``ToolCall`` event, not by a step's name."""
    timed: list[str] = []
    monkeypatch.setattr(agentkv.Session, "record_tool_time", lambda self, s: timed.append(self.id))

    class OwnToolLoop(Workflow):
        @step
        async def plan(self, ev: StartEvent) -> ToolCall:
            return ToolCall(tool_name="add", tool_kwargs={"a": 1, "b": 2}, tool_id="call_1")

        @step
        async def use_the_tool(self, ev: ToolCall) -> StopEvent:
            return StopEvent(result=ev.tool_id)

    async with agentkv.session("own-steps"):
        assert await OwnToolLoop().run() == "call_1"

    assert timed == ["own-steps"]  # the ToolCall step only, not plan
