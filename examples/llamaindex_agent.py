"""A LlamaIndex agent workflow through agentkv: one workflow run is one agentkv session.

    .venv/bin/agentkv serve --run "python examples/llamaindex_agent.py"
    AGENTKV_BASE_URL=https://host/v1 python examples/llamaindex_agent.py

What agentkv changes in a LlamaIndex program: ``OpenAILike`` comes from ``agentkv_llamaindex``,
and the run starts with ``agentkv_llamaindex.run(workflow, ...)`` instead of ``workflow.run(...)``.
(``FunctionAgent`` works the same way; this workflow spells its loop out so that it can force a
tool on each turn, which a random-weight model needs.)
"""

from __future__ import annotations

import asyncio

from _common import (
    API_KEY,
    BASE_URL,
    LOGIT_BIAS,
    MAX_TOKENS,
    PROMPT,
    TURNS,
    add,
    model_name,
    report,
    run_tool,
    tool_for_turn,
    weather,
    word_count,
)
from llama_index.core.llms import ChatMessage
from llama_index.core.tools import FunctionTool, ToolSelection
from workflows import Workflow, step
from workflows.events import Event, StartEvent, StopEvent

import agentkv
from agentkv_llamaindex import OpenAILike, run

TOOLS = [FunctionTool.from_defaults(fn) for fn in (weather, add, word_count)]


class ToolCalls(Event):
    calls: list[ToolSelection]


class ToolResults(Event):
    pass


class TravelAgent(Workflow):
    """Calls the model, runs the tools it asks for, and loops until the last turn."""

    def __init__(self, llm: OpenAILike) -> None:
        super().__init__(timeout=600)
        self.llm = llm
        self.history: list[ChatMessage] = []

    @step
    async def start(self, ev: StartEvent) -> ToolResults:
        self.history = [ChatMessage(role="user", content=ev.prompt)]
        return ToolResults()

    @step
    async def think(self, ev: ToolResults) -> ToolCalls | StopEvent:
        turn = 1 + sum(message.role == "assistant" for message in self.history)
        last = turn >= TURNS
        if last:
            agentkv.current_session().end_next_turn()
        choice = "none" if last else {"type": "function", "function": {"name": tool_for_turn(turn)}}
        response = await self.llm.achat_with_tools(
            TOOLS, chat_history=self.history, tool_choice=choice, strict=True
        )
        self.history.append(response.message)
        calls = self.llm.get_tool_calls_from_response(response, error_on_no_tool_call=False)
        if last or not calls:
            return StopEvent(result=response.message.content)
        return ToolCalls(calls=calls)

    @step
    async def act(self, ev: ToolCalls) -> ToolResults:
        for call in ev.calls:
            self.history.append(
                ChatMessage(
                    role="tool",
                    content=run_tool(call.tool_name, call.tool_kwargs),
                    additional_kwargs={"tool_call_id": call.tool_id},
                )
            )
        return ToolResults()


async def main() -> None:
    llm = OpenAILike(
        model=model_name(),
        api_base=BASE_URL,
        api_key=API_KEY,
        is_chat_model=True,
        is_function_calling_model=True,
        max_tokens=MAX_TOKENS,
        temperature=0,
        additional_kwargs={"logit_bias": LOGIT_BIAS} if LOGIT_BIAS else {},
    )
    print(f"LlamaIndex workflow: {TURNS} turns of {llm.model} at {BASE_URL}", flush=True)
    session = agentkv.session()
    await run(TravelAgent(llm), prompt=PROMPT, session=session)
    report(session)


if __name__ == "__main__":
    asyncio.run(main())
