"""agentkv for LlamaIndex.

:class:`OpenAI` and :class:`OpenAILike` replace LlamaIndex's own classes of those names and tag
their model calls made in a session; a workflow (an agent) run started inside a session
(``with context_session(ctx):`` or ``with agentkv.session():``, or :func:`run`) is that session.
Importing this package registers a span handler that times agents' tool calls.
"""

try:
    from agentkv_llamaindex._llms import OpenAI, OpenAILike
    from agentkv_llamaindex._runs import context_session, run
    from agentkv_llamaindex._tools import ToolSpanTimer, register
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.partition(".")[0] not in {"llama_index", "workflows"}:
        raise
    raise ImportError(
        f"agentkv_llamaindex needs LlamaIndex ({exc.name} is missing): "
        "pip install 'agentkv[llamaindex]'"
    ) from exc

register()

__all__ = ["OpenAI", "OpenAILike", "ToolSpanTimer", "context_session", "run"]
