"""Tool timing from LangChain callbacks, fed to the session's next-turn prediction."""

from __future__ import annotations

import threading
import time
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler

import agentkv
from agentkv_langchain._threads import session_for_run

__all__ = ["AgentKVCallbackHandler"]


class AgentKVCallbackHandler(BaseCallbackHandler):
    """Times each tool run and reports it with :meth:`agentkv.Session.record_tool_time`.

    The router keeps a session's KV cache for about the predicted tool time; a tool's own
    duration is a better sample than the gap the SDK measures between model calls, which also
    holds the framework's overhead. Each tool run is one sample. Pass it in the run's config:
    ``graph.invoke(inputs, {"callbacks": [AgentKVCallbackHandler()], ...})``.
    """

    # Cheap and thread-safe: run it in the caller's context, where the session is visible.
    run_inline = True

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[UUID, tuple[agentkv.Session, float]] = {}

    def on_tool_start(
        self,
        serialized: dict[str, Any] | None,
        input_str: str,
        *,
        run_id: UUID,
        metadata: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        session = session_for_run(metadata)
        if session is not None:
            with self._lock:
                self._running[run_id] = (session, time.monotonic())

    def on_tool_end(self, output: Any, *, run_id: UUID, **kwargs: Any) -> None:
        self._finish(run_id)

    def on_tool_error(self, error: BaseException, *, run_id: UUID, **kwargs: Any) -> None:
        self._finish(run_id)

    def _finish(self, run_id: UUID) -> None:
        with self._lock:
            started = self._running.pop(run_id, None)
        if started is not None:
            session, at = started
            session.record_tool_time(time.monotonic() - at)
