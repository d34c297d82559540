"""A LangChain callback handler that puts each chat model call in its session and times tools.

Importing ``agentkv_langchain`` registers it as a LangChain configure hook, so it takes part in
every run without being passed in each ``invoke``'s config (passing one yourself still works: the
hook then adds none).
"""

from __future__ import annotations

import logging
import threading
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.tracers.context import register_configure_hook

import agentkv
from agentkv.adapters import ToolTimer
from agentkv_langchain._threads import session_for_run

__all__ = ["AgentKVCallbackHandler"]

logger = logging.getLogger("agentkv")


class AgentKVCallbackHandler(BaseCallbackHandler):
    """Runs each chat model call in its LangGraph thread's session and times each tool run.

    - A chat model call made outside an active session but inside a LangGraph thread
      (``configurable.thread_id``) runs in the thread's session
      (:func:`agentkv_langchain.thread_session`), from its start to its end, so any chat model
      whose HTTP client tags (``agentkv_langchain.ChatOpenAI``, or ``http_clients()`` given to
      ``init_chat_model``) carries the thread on the wire.
    - Each tool run's duration goes to :meth:`agentkv.Session.record_tool_time`, the next-turn
      prediction the router uses to decide how long to keep the session's KV cache.
    """

    # Run in the caller's context (not an executor's copy): the session entered at a chat model's
    # start must be the one its request is sent in. Cheap and thread-safe.
    run_inline = True

    def __init__(self) -> None:
        self._tools: ToolTimer[UUID] = ToolTimer()
        self._lock = threading.Lock()
        self._entered: dict[UUID, agentkv.Session] = {}

    def on_chat_model_start(
        self,
        serialized: dict[str, Any],
        messages: list[list[Any]],
        *,
        run_id: UUID,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if agentkv.current_session() is not None:
            return
        session = session_for_run(metadata)
        if session is not None:
            session.__enter__()
            with self._lock:
                self._entered[run_id] = session

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._leave(run_id)

    def on_llm_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._leave(run_id)

    def on_tool_start(
        self,
        serialized: dict[str, Any] | None,
        input_str: str,
        *,
        run_id: UUID,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        # Never creates a thread session: a thread whose model calls went untagged has none.
        self._tools.start(run_id, session_for_run(metadata, create=False))

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._tools.stop(run_id)

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._tools.stop(run_id)

    def _leave(self, run_id: UUID) -> None:
        with self._lock:
            session = self._entered.pop(run_id, None)
        if session is None:
            return
        try:
            session.__exit__(None, None, None)
        except agentkv.SessionError:
            # The call ended in another context than it started in (a stream closed elsewhere):
            # the context it was entered in is the call's own and ends with it.
            logger.debug("agentkv: %r ended outside the context it started in", session)


# One handler for every context and thread (its state is keyed by run id and locked), so the
# default is the shared instance rather than a per-context value.
_default_handler: ContextVar[AgentKVCallbackHandler | None] = ContextVar(
    "agentkv_langchain_handler",
    default=AgentKVCallbackHandler(),  # noqa: B039
)
register_configure_hook(_default_handler, True, AgentKVCallbackHandler)
