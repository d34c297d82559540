"""agentkv for LlamaIndex.

:class:`OpenAI` and :class:`OpenAILike` replace LlamaIndex's own classes of those names and tag
their model calls; :func:`run` starts a workflow (an agent) run as one agentkv session.
"""

try:
    from agentkv_llamaindex._llms import OpenAI, OpenAILike
    from agentkv_llamaindex._runs import context_session, run
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.partition(".")[0] not in {"llama_index", "workflows"}:
        raise
    raise ImportError(
        f"agentkv_llamaindex needs LlamaIndex ({exc.name} is missing): "
        "pip install 'agentkv[llamaindex]'"
    ) from exc

__all__ = ["OpenAI", "OpenAILike", "context_session", "run"]
