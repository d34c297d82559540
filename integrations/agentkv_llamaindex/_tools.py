"""Tool timing from LlamaIndex's instrumentation, fed to the session's next-turn prediction.

Agent workflows (``FunctionAgent``, ``ReActAgent``, ``AgentWorkflow``...) run each tool call in
a step that takes the call's ``ToolCall`` event, and every workflow step is an instrumentation
span whose bound arguments are the step's. A span handler on the root dispatcher times the spans
of steps given a ``ToolCall``, in the session they run in. Importing ``agentkv_llamaindex``
registers it.

Everything used is LlamaIndex's public API: the span handler interface and the ``ToolCall``
event of ``llama_index.core.agent.workflow``. (No instrumentation *event* marks a tool call's
start and end: ``AgentToolCallEvent`` is defined but not dispatched by the agent workflows.)
"""

from __future__ import annotations

import inspect
from typing import Any

from llama_index.core.agent.workflow import ToolCall
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.span import BaseSpan
from llama_index.core.instrumentation.span_handlers import BaseSpanHandler
from pydantic import PrivateAttr

import agentkv
from agentkv.adapters import ToolTimer

__all__ = ["ToolSpanTimer"]


def _runs_a_tool_call(bound_args: inspect.BoundArguments) -> bool:
    """Whether a span is a workflow step given a tool call's event (the step that runs it)."""
    return any(isinstance(value, ToolCall) for value in bound_args.arguments.values())


class ToolSpanTimer(BaseSpanHandler[BaseSpan]):
    """Times the tool-call steps of agent workflows for :meth:`agentkv.Session.record_tool_time`."""

    _timer: ToolTimer[str] = PrivateAttr(default_factory=ToolTimer)

    @classmethod
    def class_name(cls) -> str:
        return "AgentKVToolSpanTimer"

    def new_span(
        self,
        id_: str,
        bound_args: inspect.BoundArguments,
        instance: Any | None = None,
        parent_span_id: str | None = None,
        tags: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> BaseSpan | None:
        if not _runs_a_tool_call(bound_args):
            return None
        # The step runs in a task that copied the run's context: its session is the run's.
        self._timer.start(id_, agentkv.current_session())
        return BaseSpan(id_=id_, parent_id=parent_span_id)

    def prepare_to_exit_span(
        self,
        id_: str,
        bound_args: inspect.BoundArguments,
        instance: Any | None = None,
        result: Any | None = None,
        **kwargs: Any,
    ) -> BaseSpan | None:
        return self._stop(id_)

    def prepare_to_drop_span(
        self,
        id_: str,
        bound_args: inspect.BoundArguments,
        instance: Any | None = None,
        err: BaseException | None = None,
        **kwargs: Any,
    ) -> BaseSpan | None:
        return self._stop(id_)

    def _stop(self, id_: str) -> BaseSpan | None:
        self._timer.stop(id_)
        return self.open_spans.get(id_)


def register() -> None:
    """Adds the timer to LlamaIndex's root dispatcher once."""
    root = get_dispatcher()
    if not any(isinstance(handler, ToolSpanTimer) for handler in root.span_handlers):
        root.add_span_handler(ToolSpanTimer())
