"""LangGraph threads as agentkv sessions.

A LangGraph thread (``config["configurable"]["thread_id"]``) is one conversation that spans many
graph invocations, which is exactly what agentkv calls a session. LangGraph copies ``thread_id``
into every run's callback metadata, so the callback handler can find the thread of the call it
sees without the user passing anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import agentkv
from agentkv.adapters import SessionCache

__all__ = ["session_for_run", "thread_session"]

THREAD_ID_KEY: Final = "thread_id"

_threads = SessionCache()


def thread_session(thread_id: str | int) -> agentkv.Session:
    """The agentkv session of a LangGraph thread (created on first use, kept across invocations).

    Its id is the thread id when that is a valid session id, else a digest of it.
    """
    return _threads.get(thread_id)


def session_for_run(
    metadata: Mapping[str, Any] | None, *, create: bool = True
) -> agentkv.Session | None:
    """The session a run belongs to: the active one, else its LangGraph thread's, else None.

    Without ``create`` a thread that has no session yet gets none.
    """
    active = agentkv.current_session()
    if active is not None:
        return active
    thread_id = (metadata or {}).get(THREAD_ID_KEY)
    if thread_id is None:
        return None
    return _threads.get(thread_id) if create else _threads.find(thread_id)
