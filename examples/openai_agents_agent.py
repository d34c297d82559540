"""An OpenAI Agents SDK agent through agentkv: one run (one conversation) is one agentkv session.

    .venv/bin/agentkv serve --run "python examples/openai_agents_agent.py"
    AGENTKV_BASE_URL=https://host/v1 python examples/openai_agents_agent.py

Does the task of _common.py (a file, an addition, a lookup table) with ``tool_choice:
required`` on every turn (the model picks the tool), prints each tool call, the turns' TTFT and
KV path, and the last tool result as the answer.

What agentkv changes in an Agents SDK program: ``Runner`` comes from ``agentkv_openai_agents``
and the model's client is an ``agentkv.AsyncOpenAI``. A run given a memory session
(``SQLiteSession``) uses that conversation's agentkv session, whose id is the memory session's.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

from _common import (
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
)
from agents import (
    Agent,
    FunctionToolResult,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    RunContextWrapper,
    SQLiteSession,
    ToolsToFinalOutputResult,
)
from agents.tool import FunctionTool

import agentkv
from agentkv_openai_agents import Runner, conversation_session


def local_tool(name: str, func: Callable[..., str]) -> FunctionTool:
    """A tool over one of _common's local functions and its strict schema."""

    async def invoke(context: Any, arguments: str) -> str:
        result = run_tool(name, arguments)
        print(format_call(name, arguments, result), flush=True)
        return result

    return FunctionTool(
        name=name,
        description=func.__doc__ or name,
        params_json_schema=SCHEMAS[name],
        on_invoke_tool=invoke,
        strict_json_schema=True,
    )


class StopAfterToolTurns:
    """Ends the run after ``turns`` tool turns: ``tool_choice`` forces a tool on every turn."""

    def __init__(self, turns: int) -> None:
        self.turns = turns
        self.done = 0

    def __call__(
        self, context: RunContextWrapper[Any], results: list[FunctionToolResult]
    ) -> ToolsToFinalOutputResult:
        self.done += 1
        final = str(results[-1].output) if results else None
        return ToolsToFinalOutputResult(is_final_output=self.done >= self.turns, final_output=final)


async def main() -> None:
    client = agentkv.AsyncOpenAI(base_url=BASE_URL, api_key=API_KEY)
    agent = Agent(
        name="assistant",
        instructions=SYSTEM,
        model=OpenAIChatCompletionsModel(model=model_name(), openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required",
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_args={"logit_bias": LOGIT_BIAS} if LOGIT_BIAS else None,
        ),
        tools=[local_tool(name, func) for name, func in TOOLS.items()],
        reset_tool_choice=False,
        tool_use_behavior=StopAfterToolTurns(TURNS - 1),
    )
    memory = SQLiteSession(f"agents-{uuid.uuid4().hex[:12]}")
    print(f"Agents SDK run: {TURNS - 1} turns at {BASE_URL}", flush=True)
    print(f"task: {PROMPT}", flush=True)
    result = await Runner.run(
        agent, PROMPT, session=memory, max_turns=TURNS, run_config=RunConfig(tracing_disabled=True)
    )
    report(conversation_session(memory), str(result.final_output or ""))


if __name__ == "__main__":
    asyncio.run(main())
