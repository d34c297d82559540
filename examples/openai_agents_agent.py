"""An OpenAI Agents SDK agent through agentkv: one run (one conversation) is one agentkv session.

    .venv/bin/agentkv serve --run "python examples/openai_agents_agent.py"
    AGENTKV_BASE_URL=https://host/v1 python examples/openai_agents_agent.py

Does the task of _common.py (a file, a lookup table, an addition) with Agents SDK function tools
over the same functions and schemas, prints each tool call, the turns' TTFT and KV path, and the
answer. A run hook names each step's tool in ``tool_choice`` and, after the last step, asks for
the answer's JSON schema with ``tool_choice: none``, as the other examples do (with ``required``
this model's first call is ``capital(France)``: docs/integrations.md).

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
from agents import (
    Agent,
    ModelResponse,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    RunContextWrapper,
    RunHooks,
    SQLiteSession,
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


class FollowThePlan(RunHooks[Any]):
    """Sets the next model call's options after each one: the step's tool in ``tool_choice``,
    then the answer turn. The runner reads ``run_config.model_settings`` anew for every call."""

    def __init__(self) -> None:
        self.turn = 1
        self.run_config = RunConfig(tracing_disabled=True, model_settings=self.settings(1))

    @staticmethod
    def settings(turn: int) -> ModelSettings:
        if turn >= TURNS:
            return ModelSettings(tool_choice="none", extra_args={"response_format": ANSWER_FORMAT})
        return ModelSettings(tool_choice=tool_for_turn(turn))

    async def on_llm_end(
        self, context: RunContextWrapper[Any], agent: Agent[Any], response: ModelResponse
    ) -> None:
        self.turn += 1
        self.run_config.model_settings = self.settings(self.turn)


async def main() -> None:
    client = agentkv.AsyncOpenAI(base_url=BASE_URL, api_key=API_KEY)
    agent = Agent(
        name="assistant",
        instructions=SYSTEM,
        model=OpenAIChatCompletionsModel(model=model_name(), openai_client=client),
        model_settings=ModelSettings(
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_args={"logit_bias": LOGIT_BIAS} if LOGIT_BIAS else None,
        ),
        tools=[local_tool(name, func) for name, func in TOOLS.items()],
        reset_tool_choice=False,
    )
    memory = SQLiteSession(f"agents-{uuid.uuid4().hex[:12]}")
    print(f"Agents SDK run: {TURNS} turns at {BASE_URL}", flush=True)
    print(f"task: {PROMPT}", flush=True)
    plan = FollowThePlan()
    result = await Runner.run(
        agent, PROMPT, session=memory, max_turns=TURNS, hooks=plan, run_config=plan.run_config
    )
    report(conversation_session(memory), str(result.final_output or ""))


if __name__ == "__main__":
    asyncio.run(main())
