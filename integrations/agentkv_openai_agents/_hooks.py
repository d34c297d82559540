"""Run hooks that time tool calls for the session's next-turn prediction."""

from __future__ import annotations

import threading
import time
from typing import Any

from agents import Agent, AgentHookContext, ModelResponse, RunContextWrapper, RunHooks, Tool
from agents.items import TResponseInputItem

import agentkv

__all__ = ["AgentKVHooks"]


class AgentKVHooks(RunHooks[Any]):
    """Reports each tool call's duration with :meth:`agentkv.Session.record_tool_time`.

    A tool's own duration is a better sample for how long the router should keep the session's
    KV cache than the gap between model calls, which also holds the framework's overhead. Every
    other event is passed on to ``inner``, the run's own hooks if it has any.
    """

    def __init__(self, inner: RunHooks[Any] | None = None) -> None:
        self._inner = inner or RunHooks()
        self._lock = threading.Lock()
        self._running: dict[object, tuple[agentkv.Session, float]] = {}

    async def on_tool_start(
        self, context: RunContextWrapper[Any], agent: Agent[Any], tool: Tool
    ) -> None:
        session = agentkv.current_session()
        if session is not None:
            with self._lock:
                self._running[_call_key(context, tool)] = (session, time.monotonic())
        await self._inner.on_tool_start(context, agent, tool)

    async def on_tool_end(
        self, context: RunContextWrapper[Any], agent: Agent[Any], tool: Tool, result: object
    ) -> None:
        with self._lock:
            started = self._running.pop(_call_key(context, tool), None)
        if started is not None:
            session, at = started
            session.record_tool_time(time.monotonic() - at)
        await self._inner.on_tool_end(context, agent, tool, result)

    async def on_llm_start(
        self,
        context: RunContextWrapper[Any],
        agent: Agent[Any],
        system_prompt: str | None,
        input_items: list[TResponseInputItem],
    ) -> None:
        await self._inner.on_llm_start(context, agent, system_prompt, input_items)

    async def on_llm_end(
        self, context: RunContextWrapper[Any], agent: Agent[Any], response: ModelResponse
    ) -> None:
        await self._inner.on_llm_end(context, agent, response)

    async def on_agent_start(self, context: AgentHookContext[Any], agent: Agent[Any]) -> None:
        await self._inner.on_agent_start(context, agent)

    async def on_agent_end(
        self, context: AgentHookContext[Any], agent: Agent[Any], output: Any
    ) -> None:
        await self._inner.on_agent_end(context, agent, output)

    async def on_handoff(
        self, context: RunContextWrapper[Any], from_agent: Agent[Any], to_agent: Agent[Any]
    ) -> None:
        await self._inner.on_handoff(context, from_agent, to_agent)


def _call_key(context: RunContextWrapper[Any], tool: Tool) -> object:
    # Function tools get a ToolContext that names the call; other tool kinds run one at a time.
    return getattr(context, "tool_call_id", None) or id(tool)
