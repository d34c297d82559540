"""``Runner`` whose runs are agentkv sessions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import agents
from agents import (
    Agent,
    RunConfig,
    RunResult,
    RunResultStreaming,
    RunState,
    TContext,
    TResponseInputItem,
)
from agents import Session as MemorySession
from typing_extensions import Unpack

if TYPE_CHECKING:
    # The one name used here that the SDK's package does not export: the TypedDict of
    # Runner.run's keyword arguments, defined in agents.run_config (and re-exported by
    # agents.run). Read by type checkers only, so a move in a later SDK version breaks no run.
    from agents.run_config import RunOptions

import agentkv
from agentkv.adapters import SessionCache
from agentkv_openai_agents._hooks import AgentKVHooks

__all__ = ["Runner", "conversation_session", "run_session"]

_conversations = SessionCache()

RunInput = str | list[TResponseInputItem] | RunState[TContext]


class Runner(agents.Runner):
    """``agents.Runner`` that runs each agent run as an agentkv session (see :func:`run_session`).

    Same methods and arguments as ``agents.Runner``. Tool calls are timed by
    :class:`AgentKVHooks`, which wraps the run's own ``hooks``. Model calls are tagged when the
    model's client tags: an ``agentkv.AsyncOpenAI`` (or ``agentkv.wrap``-ped) client, given to
    ``OpenAIResponsesModel`` (the SDK's default), ``OpenAIChatCompletionsModel``,
    ``OpenAIProvider`` or ``set_default_openai_client``.
    """

    @classmethod
    async def run(
        cls,
        starting_agent: Agent[TContext],
        input: RunInput[TContext],
        **kwargs: Unpack[RunOptions[TContext]],
    ) -> RunResult:
        with run_session(kwargs):
            return await super().run(starting_agent, input, **_with_hooks(kwargs))

    @classmethod
    def run_sync(
        cls,
        starting_agent: Agent[TContext],
        input: RunInput[TContext],
        **kwargs: Unpack[RunOptions[TContext]],
    ) -> RunResult:
        with run_session(kwargs):
            return super().run_sync(starting_agent, input, **_with_hooks(kwargs))

    @classmethod
    def run_streamed(
        cls,
        starting_agent: Agent[TContext],
        input: RunInput[TContext],
        **kwargs: Unpack[RunOptions[TContext]],
    ) -> RunResultStreaming:
        # The run's background task copies this context when it is created, inside the session.
        with run_session(kwargs):
            return super().run_streamed(starting_agent, input, **_with_hooks(kwargs))


def run_session(options: Mapping[str, Any]) -> agentkv.Session:
    """The agentkv session of a run with these ``Runner`` options.

    In order: the active session; the conversation of a memory ``session``
    (``SQLiteSession("user-42")``: :func:`conversation_session`); the conversation named by
    ``run_config.group_id`` (the SDK's id for one conversation's traces); else a new session.
    Runs of one conversation share its session, so its turn count and prediction carry over.
    """
    if (active := agentkv.current_session()) is not None:
        return active
    memory: MemorySession | None = options.get("session")
    if memory is not None:
        return conversation_session(memory)
    group_id = _group_id(options.get("run_config"))
    return _conversations.get(group_id) if group_id else agentkv.session()


def conversation_session(memory: MemorySession) -> agentkv.Session:
    """The agentkv session of an Agents SDK memory session (its id is ``memory.session_id``,
    or a digest of it when that is no valid session id)."""
    return _conversations.get(memory.session_id)


def _group_id(run_config: RunConfig | Mapping[str, Any] | None) -> str | None:
    if isinstance(run_config, Mapping):
        return run_config.get("group_id")
    return None if run_config is None else run_config.group_id


def _with_hooks(options: RunOptions[TContext]) -> RunOptions[TContext]:
    hooks = options.get("hooks")
    if isinstance(hooks, AgentKVHooks):
        return options
    return {**options, "hooks": AgentKVHooks(hooks)}
