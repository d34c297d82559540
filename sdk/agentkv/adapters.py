"""Building blocks for framework adapters (agentkv_langchain, agentkv_llamaindex, ...).

Every adapter maps a framework's own notion of a conversation (a LangGraph thread, an Agents SDK
memory session, a LlamaIndex ``Context``) to one agentkv session, and times the framework's tool
runs for the next-turn prediction. Both live here once, so the adapters agree on ids and limits.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from typing import Final, Generic, TypeVar

from agentkv._session import Session
from agentkv.protocol import is_valid_session_id

__all__ = ["DEFAULT_MAX_SESSIONS", "SessionCache", "ToolTimer", "session_id_for"]

DEFAULT_MAX_SESSIONS: Final = 4096
"""Conversations remembered per cache; the least recently used are forgotten beyond this."""

_K = TypeVar("_K", bound=Hashable)


def session_id_for(key: str | int) -> str:
    """The session id of a framework's conversation key: the key itself when it is a valid
    session id, else ``k-`` and a digest of it (so any key works and equal keys agree)."""
    text = str(key)
    if is_valid_session_id(text):
        return text
    return "k-" + hashlib.sha256(text.encode()).hexdigest()[:32]


class SessionCache:
    """Sessions by conversation key, created on first use and kept across runs.

    Turn counts and next-turn predictions live in the session, so a conversation's runs must find
    the same one; the least recently used beyond ``max_sessions`` are forgotten. Thread-safe.
    """

    def __init__(self, *, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self._max_sessions = max_sessions
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def get(self, key: str | int) -> Session:
        """The session of ``key`` (its id: :func:`session_id_for`), created on first use."""
        session_id = session_id_for(key)
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                session = self._sessions[session_id] = Session(session_id)
                if len(self._sessions) > self._max_sessions:
                    self._sessions.popitem(last=False)
            else:
                self._sessions.move_to_end(session_id)
            return session

    def find(self, key: str | int) -> Session | None:
        """The session of ``key`` if it has one already; never creates one."""
        with self._lock:
            return self._sessions.get(session_id_for(key))


class ToolTimer(Generic[_K]):
    """Times tool runs and feeds each to its session (:meth:`Session.record_tool_time`).

    A tool's own duration is a better sample for how long the router should keep the session's KV
    than the gap between model calls, which also holds the framework's overhead. Runs are keyed by
    whatever the framework names them with (a run id, a tool call id). Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[_K, tuple[Session, float]] = {}

    def start(self, key: _K, session: Session | None) -> None:
        """A tool run starts; without a session it is not timed."""
        if session is not None:
            with self._lock:
                self._running[key] = (session, time.monotonic())

    def stop(self, key: _K) -> None:
        """The run ended (returned or failed): its duration goes to its session."""
        with self._lock:
            started = self._running.pop(key, None)
        if started is not None:
            session, at = started
            session.record_tool_time(time.monotonic() - at)
