"""A LlamaIndex agent workflow through agentkv: one workflow run is one agentkv session.

    .venv/bin/agentkv serve --run "python examples/llamaindex_agent.py"
    AGENTKV_BASE_URL=https://host/v1 python examples/llamaindex_agent.py

Does the task of _common.py (a file, a lookup table, an addition) with LlamaIndex function tools
whose typed signatures give the same bounded schemas, prints each tool call, the turns' TTFT and
KV path, and the answer (the last turn asks for the answer's JSON schema, ``tool_choice="none"``).

What agentkv changes in a LlamaIndex program: ``OpenAILike`` comes from ``agentkv_llamaindex``,
and the run starts with ``agentkv_llamaindex.run(workflow, ...)`` instead of ``workflow.run(...)``.
(``FunctionAgent`` works the same way; this workflow spells its loop out so that it can force a
tool on each step, which a 135M model needs: docs/integrations.md.)
"""

import asyncio
from typing import Literal

from _common import (
    ANSWER_FORMAT,
    API_KEY,
    BASE_URL,
    CAPITALS,
    FILE_NAMES,
    LOGIT_BIAS,
    MAX_TOKENS,
    PROMPT,
    SYSTEM,
    TURNS,
    format_call,
    model_name,
    report,
    run_tool,
    tool_for_turn,
)
from llama_index.core.llms import ChatMessage
from llama_index.core.tools import FunctionTool, ToolSelection
from pydantic import BaseModel, Field
from workflows import Workflow, step
from workflows.events import Event, StartEvent, StopEvent

import agentkv
from agentkv_llamaindex import OpenAILike, run

# Evaluated annotations (no `from __future__ import annotations`): LlamaIndex builds each tool's
# schema from them, so a Literal becomes an enum.
FileName = Literal[FILE_NAMES]  # type: ignore[valid-type]
Country = Literal[tuple(sorted(CAPITALS))]  # type: ignore[valid-type]


class Numbers(BaseModel):
    """add's arguments with their range (a signature's Field bounds are not carried over)."""

    a: int = Field(ge=0, le=999)
    b: int = Field(ge=0, le=999)


def read_file(name: FileName) -> str:
    """Reads a text file of the work folder."""
    return run_tool("read_file", {"name": name})


def add(a: int, b: int) -> str:
    """Adds two whole numbers."""
    return run_tool("add", {"a": a, "b": b})


def capital(country: Country) -> str:
    """Looks up the capital city of a country."""
    return run_tool("capital", {"country": country})


TOOLS = [
    FunctionTool.from_defaults(read_file),
    FunctionTool.from_defaults(capital),
    FunctionTool.from_defaults(add, fn_schema=Numbers),
]


class ToolCalls(Event):
    calls: list[ToolSelection]


class ToolResults(Event):
    pass


class TaskAgent(Workflow):
    """Calls the model, runs the tools it asks for, and loops until the last turn."""

    def __init__(self, llm: OpenAILike) -> None:
        super().__init__(timeout=600)
        self.llm = llm
        self.history: list[ChatMessage] = []

    @step
    async def start(self, ev: StartEvent) -> ToolResults:
        self.history = [
            ChatMessage(role="system", content=SYSTEM),
            ChatMessage(role="user", content=ev.prompt),
        ]
        return ToolResults()

    @step
    async def think(self, ev: ToolResults) -> ToolCalls | StopEvent:
        turn = 1 + sum(message.role == "assistant" for message in self.history)
        last = turn >= TURNS
        if last:
            agentkv.current_session().end_next_turn()
        if last:
            options = {"tool_choice": "none", "response_format": ANSWER_FORMAT}
        else:
            options = {
                "tool_choice": {"type": "function", "function": {"name": tool_for_turn(turn)}}
            }
        response = await self.llm.achat_with_tools(
            TOOLS, chat_history=self.history, strict=True, **options
        )
        self.history.append(response.message)
        calls = self.llm.get_tool_calls_from_response(response, error_on_no_tool_call=False)
        if last or not calls:
            return StopEvent(result=response.message.content)
        return ToolCalls(calls=calls)

    @step
    async def act(self, ev: ToolCalls) -> ToolResults:
        for call in ev.calls:
            result = run_tool(call.tool_name, call.tool_kwargs)
            print(format_call(call.tool_name, call.tool_kwargs, result), flush=True)
            self.history.append(
                ChatMessage(
                    role="tool", content=result, additional_kwargs={"tool_call_id": call.tool_id}
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
    print(f"task: {PROMPT}", flush=True)
    session = agentkv.session()
    answer = await run(TaskAgent(llm), prompt=PROMPT, session=session)
    report(session, str(answer or ""))


if __name__ == "__main__":
    asyncio.run(main())
