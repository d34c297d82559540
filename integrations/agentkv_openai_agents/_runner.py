"""``Runner`` whose runs are agentkv sessions."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Final

import agents
from agents import Agent, RunHooks, RunResult, RunResultStreaming
from agents.memory import Session as MemorySession

import agentkv
from agentkv_openai_agents._hooks import AgentKVHooks

__all__ = ["Runner", "conversation_session"]

# Sessions are remembered per conversation so that turn counts and predictions survive between
# runs; the least recently used are forgotten beyond this many conversations.
MAX_CONVERSATIONS: Final = 4096

_lock = threading.Lock()
_sessions: OrderedDict[str, agentkv.Session] = OrderedDict()


class Runner(agents.Runner):
    """``agents.Runner`` that runs each agent run as an agentkv session.

    The session is the active one if there is one; else, for a run given a memory ``session``
    (``SQLiteSession("user-42")``...), the agentkv session of that conversation (same id), so that
    a conversation's runs share one; else a new one. Tool calls are timed by
    :class:`AgentKVHooks`, which wraps the run's own ``hooks``. Model calls are tagged when the
    model's client is an ``agentkv.AsyncOpenAI`` (or ``agentkv.wrap``-ped).
    """

    @classmethod
    async def run(  # type: ignore[override]
        cls, starting_agent: Agent[Any], input: Any, **kwargs: Any
    ) -> RunResult:
        with _run_session(kwargs):
            return await super().run(starting_agent, input, **_with_hooks(kwargs))

    @classmethod
    def run_sync(  # type: ignore[override]
        cls, starting_agent: Agent[Any], input: Any, **kwargs: Any
    ) -> RunResult:
        with _run_session(kwargs):
            return super().run_sync(starting_agent, input, **_with_hooks(kwargs))

    @classmethod
    def run_streamed(  # type: ignore[override]
        cls, starting_agent: Agent[Any], input: Any, **kwargs: Any
    ) -> RunResultStreaming:
        # The run's background task copies this context when it is created, inside the session.
        with _run_session(kwargs):
            return super().run_streamed(starting_agent, input, **_with_hooks(kwargs))


def conversation_session(memory: MemorySession) -> agentkv.Session:
    """The agentkv session of an Agents SDK memory session (its id is ``memory.session_id``)."""
    with _lock:
        session = _sessions.get(memory.session_id)
        if session is None:
            session = _sessions[memory.session_id] = agentkv.session(memory.session_id)
            if len(_sessions) > MAX_CONVERSATIONS:
                _sessions.popitem(last=False)
        else:
            _sessions.move_to_end(memory.session_id)
        return session


def _run_session(kwargs: dict[str, Any]) -> agentkv.Session:
    if (active := agentkv.current_session()) is not None:
        return active
    memory = kwargs.get("session")
    return conversation_session(memory) if memory is not None else agentkv.session()


def _with_hooks(kwargs: dict[str, Any]) -> dict[str, Any]:
    hooks: RunHooks[Any] | None = kwargs.get("hooks")
    return kwargs if isinstance(hooks, AgentKVHooks) else {**kwargs, "hooks": AgentKVHooks(hooks)}
