"""agentkv for LangChain and LangGraph.

Swap ``langchain_openai.ChatOpenAI`` for :class:`agentkv_langchain.ChatOpenAI` (or give
``init_chat_model`` the :func:`http_clients`): its model calls carry agentkv's session and turn
hints, and a LangGraph thread (``configurable.thread_id``) is one agentkv session. Importing this
package registers :class:`AgentKVCallbackHandler` with LangChain, which maps threads to sessions
and feeds tool durations to the next-turn prediction.
"""

try:
    from agentkv_langchain._callbacks import AgentKVCallbackHandler
    from agentkv_langchain._chat_model import ChatOpenAI, http_clients
    from agentkv_langchain._threads import thread_session
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.partition(".")[0] not in {"langchain_core", "langchain_openai"}:
        raise
    raise ImportError(
        f"agentkv_langchain needs LangChain ({exc.name} is missing): "
        "pip install 'agentkv[langchain]'"
    ) from exc

__all__ = ["AgentKVCallbackHandler", "ChatOpenAI", "http_clients", "thread_session"]
