"""A LangGraph tool-calling agent through agentkv: one thread is one agentkv session.

    .venv/bin/agentkv serve --run "python examples/langchain_agent.py"
    AGENTKV_BASE_URL=https://host/v1 python examples/langchain_agent.py

Does the task of _common.py (a file, a lookup table, an addition) with LangChain tools over the
same functions, prints each tool call, the turns' TTFT and KV path, and the answer (the last turn
binds ``tool_choice="none"`` and the answer's JSON schema).

What agentkv changes in a LangGraph program: ``ChatOpenAI`` comes from ``agentkv_langchain``
and the run's callbacks hold an ``AgentKVCallbackHandler``; the thread id is the session id.
"""

from __future__ import annotations

import uuid

from _common import (
    ANSWER_FORMAT,
    API_KEY,
    BASE_URL,
    LOGIT_BIAS,
    MAX_TOKENS,
    PROMPT,
    SCHEMAS,
    SYSTEM,
    TOOLS,
    TURNS,
    format_call,
    model_name,
    report,
    run_tool,
    tool_for_turn,
)
from langchain_core.messages import AIMessage, AnyMessage, HumanMessage, SystemMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import StructuredTool
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from agentkv_langchain import AgentKVCallbackHandler, ChatOpenAI, thread_session


def lang_tool(name: str) -> StructuredTool:
    """A LangChain tool over one of _common's functions, with its bounded schema."""

    def invoke(**arguments: object) -> str:
        result = run_tool(name, dict(arguments))
        print(format_call(name, dict(arguments), result), flush=True)
        return result

    return StructuredTool.from_function(
        invoke, name=name, description=TOOLS[name].__doc__, args_schema=SCHEMAS[name]
    )


LANG_TOOLS = [lang_tool(name) for name in TOOLS]


def build_graph(model: ChatOpenAI) -> CompiledStateGraph:
    """Model, then tools, until the last turn answers in text."""

    def agent(state: MessagesState, config: RunnableConfig) -> dict[str, list[AnyMessage]]:
        turn = 1 + sum(isinstance(message, AIMessage) for message in state["messages"])
        if turn >= TURNS:
            thread_session(config["configurable"]["thread_id"]).end_next_turn()
        if turn >= TURNS:
            bound = model.bind_tools(
                LANG_TOOLS, tool_choice="none", strict=True,
                response_format=ANSWER_FORMAT["json_schema"],
            )  # fmt: skip
        else:
            bound = model.bind_tools(LANG_TOOLS, tool_choice=tool_for_turn(turn), strict=True)
        return {"messages": [bound.invoke(state["messages"], config)]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(LANG_TOOLS))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile()


def main() -> None:
    model = ChatOpenAI(
        model=model_name(),
        base_url=BASE_URL,
        api_key=API_KEY,
        max_tokens=MAX_TOKENS,
        temperature=0,
        logit_bias=LOGIT_BIAS,
    )
    thread_id = f"langgraph-{uuid.uuid4().hex[:12]}"
    config: RunnableConfig = {
        "configurable": {"thread_id": thread_id},
        "callbacks": [AgentKVCallbackHandler()],
        "recursion_limit": 4 * TURNS,
    }
    print(f"LangGraph agent: {TURNS} turns of {model.model_name} at {BASE_URL}", flush=True)
    print(f"task: {PROMPT}", flush=True)
    final = build_graph(model).invoke(
        {"messages": [SystemMessage(SYSTEM), HumanMessage(PROMPT)]}, config
    )
    report(thread_session(thread_id), str(final["messages"][-1].content))


if __name__ == "__main__":
    main()
