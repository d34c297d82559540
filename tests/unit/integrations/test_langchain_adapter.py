"""agentkv_langchain: LangGraph tool loops through ChatOpenAI carry one session per thread."""

from __future__ import annotations

import importlib
import sys
import uuid

import httpx
import langchain_openai
import pytest
from langchain_core.messages import AnyMessage, HumanMessage
from langchain_core.runnables import RunnableLambda
from langchain_core.tools import tool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from pydantic import BaseModel

import agentkv
import agentkv_langchain
from agentkv_langchain import AgentKVCallbackHandler, ChatOpenAI, http_clients, thread_session


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
    session = thread_session(thread_id)
    handler = AgentKVCallbackHandler()
    run_id = uuid.uuid4()

    handler.on_tool_start({}, "{}", run_id=run_id, metadata={"thread_id": thread_id})
    assert session.predicted_next_turn_seconds is None
    handler.on_tool_end("4", run_id=run_id)

    assert session.predicted_next_turn_seconds is not None


def test_tools_of_a_thread_without_a_session_create_none() -> None:
    handler = AgentKVCallbackHandler()
    run_id = uuid.uuid4()
    thread_id = f"untagged-{uuid.uuid4().hex}"

    handler.on_tool_start({}, "{}", run_id=run_id, metadata={"thread_id": thread_id})
    handler.on_tool_end("4", run_id=run_id)

    assert thread_session(thread_id).predicted_next_turn_seconds is None


def test_threads_and_tool_timing_need_no_callbacks_in_the_config(
    model: ChatOpenAI, server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Importing agentkv_langchain registers the handler with LangChain's configure hooks."""
    timed: list[float] = []
    monkeypatch.setattr(agentkv.Session, "record_tool_time", lambda self, s: timed.append(s))
    thread_id = f"hooked-{uuid.uuid4().hex}"

    react_graph(model).invoke(
        {"messages": [HumanMessage("add 2 and 2")]}, {"configurable": {"thread_id": thread_id}}
    )

    server.check_tool_loop(server.requests, session_id=thread_id)
    assert len(timed) == 2  # one per tool run


def test_init_chat_model_path_plain_chat_openai_with_http_clients(
    http_client: httpx.Client, async_http_client: httpx.AsyncClient, server
) -> None:
    """``init_chat_model("openai:...", **http_clients())`` builds exactly this model."""
    plain = langchain_openai.ChatOpenAI(
        model="agentkv-fake",
        base_url="http://fake/v1",
        api_key="-",
        **http_clients(http_client=http_client, http_async_client=async_http_client),
    )
    thread_id = f"init-{uuid.uuid4().hex}"

    react_graph(plain).invoke(
        {"messages": [HumanMessage("add 2 and 2")]}, {"configurable": {"thread_id": thread_id}}
    )

    server.check_tool_loop(server.requests, session_id=thread_id)


class Sum(BaseModel):
    """The sum of two numbers."""

    total: int
    explanation: str


def test_structured_output_in_a_session_over_loopback(loopback_url: str, server) -> None:
    """``with_structured_output`` sends through openai's ``parse``: tagged on a real socket."""
    model = ChatOpenAI(model="agentkv-fake", base_url=loopback_url, api_key="-")
    structured = model.with_structured_output(Sum)

    with agentkv.session("structured") as session:
        first = structured.invoke("add 2 and 2")
        second = structured.invoke("and 3 and 3?")

    assert first == second == Sum(total=2, explanation="paris")
    assert [r.session_id for r in server.requests] == ["structured"] * 2
    assert [r.turn for r in server.requests] == [1, 2]
    assert all(r.body["response_format"]["type"] == "json_schema" for r in server.requests)
    assert [t.kv_path for t in session.turns] == ["recompute", "reuse"]


def test_tracing_identity_and_public_client_seams(model: ChatOpenAI) -> None:
    assert model._llm_type == "agentkv-openai-chat"
    assert agentkv.http_client(model.http_client) is model.http_client
    assert agentkv.async_http_client(model.http_async_client) is model.http_async_client


def test_importing_without_the_extra_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "langchain_openai", None)
    for name in [m for m in sys.modules if m.startswith("agentkv_langchain")]:
        monkeypatch.delitem(sys.modules, name)

    with pytest.raises(ImportError, match=r"pip install 'agentkv\[langchain\]'"):
        importlib.import_module("agentkv_langchain")
    assert agentkv_langchain.ChatOpenAI is ChatOpenAI
