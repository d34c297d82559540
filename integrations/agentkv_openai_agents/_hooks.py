"""Run hooks that time tool calls for the session's next-turn prediction."""

from __future__ import annotations

from typing import Any, Final, Generic

from agents import Agent, RunContextWrapper, RunHooks, TContext, Tool

import agentkv
from agentkv.adapters import ToolTimer

__all__ = ["AgentKVHooks"]

# The events AgentKVHooks handles itself (then passes on); every other ``on_*`` callback,
# including any the SDK adds later, goes straight to the inner hooks.
_OWN_EVENTS: Final = frozenset({"on_tool_start", "on_tool_end"})


class AgentKVHooks(RunHooks[TContext], Generic[TContext]):
    """Reports each tool call's duration with :meth:`agentkv.Session.record_tool_time`.

    A tool's own duration is a better sample for how long the router should keep the session's
    KV cache than the gap between model calls, which also holds the framework's overhead. Every
    event, this one's two included, reaches ``inner``, the run's own hooks if it has any.
    """

    def __init__(self, inner: RunHooks[TContext] | None = None) -> None:
        self._inner: RunHooks[TContext] = inner if inner is not None else RunHooks()
        self._tools: ToolTimer[object] = ToolTimer()

    @property
    def inner(self) -> RunHooks[TContext]:
        return self._inner

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_") and name not in _OWN_EVENTS:
            return getattr(object.__getattribute__(self, "_inner"), name)
        return object.__getattribute__(self, name)

    async def on_tool_start(
        self, context: RunContextWrapper[TContext], agent: Agent[TContext], tool: Tool
    ) -> None:
        self._tools.start(_call_key(context, tool), agentkv.current_session())
        await self._inner.on_tool_start(context, agent, tool)

    async def on_tool_end(
        self,
        context: RunContextWrapper[TContext],
        agent: Agent[TContext],
        tool: Tool,
        result: object,
    ) -> None:
        self._tools.stop(_call_key(context, tool))
        await self._inner.on_tool_end(context, agent, tool, result)


def _call_key(context: RunContextWrapper[Any], tool: Tool) -> object:
    # Function tools get a ToolContext that names the call; other tool kinds run one at a time.
    return getattr(context, "tool_call_id", None) or id(tool)
