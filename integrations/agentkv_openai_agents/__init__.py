"""agentkv for the OpenAI Agents SDK.

Run agents with :class:`agentkv_openai_agents.Runner` instead of ``agents.Runner`` and give their
models an ``agentkv.AsyncOpenAI`` client (the default Responses model or the Chat Completions
one): each run is one agentkv session (a conversation's runs share one, by memory session or
``RunConfig.group_id``), and tool durations feed the next-turn prediction (:class:`AgentKVHooks`).
"""

try:
    from agentkv_openai_agents._hooks import AgentKVHooks
    from agentkv_openai_agents._runner import Runner, conversation_session, run_session
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.partition(".")[0] != "agents":
        raise
    raise ImportError(
        f"agentkv_openai_agents needs the OpenAI Agents SDK ({exc.name} is missing): "
        "pip install 'agentkv[agents]'"
    ) from exc

__all__ = ["AgentKVHooks", "Runner", "conversation_session", "run_session"]
