"""agentkv_langchain: LangGraph tool loops through ChatOpenAI carry one session per thread."""

from __future__ import annotations

import importlib
import sys
import uuid

import httpx
import pytest
from langchain_core.messages import AnyMessage, HumanMessage
from langchain_core.runnables import RunnableLambda
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition

import agentkv
import agentkv_langchain
from agentkv_langchain import AgentKVCallbackHandler, ChatOpenAI, thread_session


@tool
def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


@tool
def weather(city: str) -> str:
    """Today's weather in a city."""
    return f"sunny in {city}"


def react_graph(model: ChatOpenAI) -> CompiledStateGraph:
    """The canonical LangGraph tool loop: the model, then tools for as long as it asks."""
    bound = model.bind_tools([add, weather])

    def agent(state: MessagesState) -> dict[str, list[AnyMessage]]:
        return {"messages": [bound.invoke(state["messages"])]}

    async def aagent(state: MessagesState) -> dict[str, list[AnyMessage]]:
        return {"messages": [await bound.ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", RunnableLambda(agent, afunc=aagent))
    graph.add_node("tools", ToolNode([add, weather]))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


@pytest.fixture
def model(http_client: httpx.Client, async_http_client: httpx.AsyncClient) -> ChatOpenAI:
    return ChatOpenAI(
        model="agentkv-fake",
        base_url="http://fake/v1",
        api_key="-",
        http_client=http_client,
        http_async_client=async_http_client,
    )


def thread_config(thread_id: str) -> dict:
    return {"configurable": {"thread_id": thread_id}, "callbacks": [AgentKVCallbackHandler()]}


def test_a_langgraph_thread_is_one_session_across_invocations(model: ChatOpenAI, server) -> None:
    thread_id = f"thread-{uuid.uuid4().hex}"
    graph = react_graph(model)

    graph.invoke({"messages": [HumanMessage("add 2 and 2")]}, thread_config(thread_id))
    first = list(server.requests)
    server.requests.clear()
    graph.invoke({"messages": [HumanMessage("and the weather?")]}, thread_config(thread_id))

    assert server.check_tool_loop(first, session_id=thread_id) == thread_id
    server.check_tool_loop(server.requests, session_id=thread_id, first_turn=len(first) + 1)
    session = thread_session(thread_id)
    assert session.turn == len(first) + len(server.requests) == 6
    assert session.last_turn is not None and session.last_turn.kv_path == "reuse"


async def test_async_streaming_loop_uses_the_active_session_over_the_thread(
    http_client: httpx.Client, async_http_client: httpx.AsyncClient, server
) -> None:
    model = ChatOpenAI(
        model="agentkv-fake",
        base_url="http://fake/v1",
        api_key="-",
        http_client=http_client,
        http_async_client=async_http_client,
        streaming=True,
    )
    async with agentkv.session("explicit-run") as session:
        await react_graph(model).ainvoke(
            {"messages": [HumanMessage("add 2 and 2")]}, thread_config("ignored-thread")
        )

    server.check_tool_loop(server.requests, session_id="explicit-run")
    assert all(request.body["stream"] for request in server.requests)
    assert [turn.finish_reason for turn in session.turns] == ["tool_calls", "tool_calls", "stop"]


def test_calls_outside_sessions_and_threads_are_sent_untagged(model: ChatOpenAI, server) -> None:
    model.invoke("hello")

    (request,) = server.requests
    assert request.session_id is None
    assert "agentkv" not in request.body


def test_agentkv_body_false_sends_headers_only(
    http_client: httpx.Client, async_http_client: httpx.AsyncClient, server
) -> None:
    model = ChatOpenAI(
        model="agentkv-fake",
        api_key="-",
        base_url="http://fake/v1",
        http_client=http_client,
        http_async_client=async_http_client,
        agentkv_body=False,
    )
    with agentkv.session("headers-only"):
        model.invoke("hello")

    (request,) = server.requests
    assert request.session_id == "headers-only" and request.turn == 1
    assert "agentkv" not in request.body and "prompt_cache_key" not in request.body


def test_a_thread_id_that_is_no_valid_session_id_is_digested() -> None:
    session = thread_session("user 42 / chat #7")

    assert agentkv.protocol.is_valid_session_id(session.id)
    assert session is thread_session("user 42 / chat #7")
    assert thread_session(42).id == "42"


def test_the_callback_handler_feeds_tool_time_to_the_thread_session() -> None:
    thread_id = f"timed-{uuid.uuid4().hex}"
    handler = AgentKVCallbackHandler()
    run_id = uuid.uuid4()

    handler.on_tool_start({}, "{}", run_id=run_id, metadata={"thread_id": thread_id})
    assert thread_session(thread_id).predicted_next_turn_seconds is None
    handler.on_tool_end("4", run_id=run_id)

    assert thread_session(thread_id).predicted_next_turn_seconds is not None


def test_importing_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "langchain_openai", None)
    for name in [m for m in sys.modules if m.startswith("agentkv_langchain")]:
        monkeypatch.delitem(sys.modules, name)

    with pytest.raises(ImportError, match=r"pip install 'agentkv\[langchain\]'"):
        importlib.import_module("agentkv_langchain")
    assert agentkv_langchain.ChatOpenAI is ChatOpenAI
