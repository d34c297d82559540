"""LangGraph threads as agentkv sessions.

A LangGraph thread (``config["configurable"]["thread_id"]``) is one conversation that spans many
graph invocations, which is exactly what agentkv calls a session. LangGraph copies ``thread_id``
into every run's callback metadata, so the chat model and the callback handler can find the thread
of the call they are part of without the user passing anything.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, Final

import agentkv
from agentkv.protocol import is_valid_session_id

__all__ = ["active", "session_for_run", "thread_session"]

THREAD_ID_KEY: Final = "thread_id"
# Sessions are remembered per thread so that turn counts and predictions survive between
# invocations; the least recently used are forgotten beyond this many threads.
MAX_THREADS: Final = 4096

_lock = threading.Lock()
_sessions: OrderedDict[str, agentkv.Session] = OrderedDict()


def thread_session(thread_id: str | int) -> agentkv.Session:
    """The agentkv session of a LangGraph thread (created on first use).

    Its id is the thread id when that is a valid session id, else a digest of it.
    """
    key = str(thread_id)
    with _lock:
        session = _sessions.get(key)
        if session is None:
            session = _sessions[key] = agentkv.Session(_session_id(key))
            if len(_sessions) > MAX_THREADS:
                _sessions.popitem(last=False)
        else:
            _sessions.move_to_end(key)
        return session


def session_for_run(metadata: Mapping[str, Any] | None) -> agentkv.Session | None:
    """The session a run belongs to: the active one, else its LangGraph thread's, else None."""
    active = agentkv.current_session()
    if active is not None:
        return active
    thread_id = (metadata or {}).get(THREAD_ID_KEY)
    return None if thread_id is None else thread_session(thread_id)


@contextlib.contextmanager
def active(session: agentkv.Session | None) -> Iterator[None]:
    """Makes ``session`` the current one, unless it already is (or there is none)."""
    if session is None or session is agentkv.current_session():
        yield
        return
    with session:
        yield


def _session_id(thread_id: str) -> str:
    if is_valid_session_id(thread_id):
        return thread_id
    return "thread-" + hashlib.sha256(thread_id.encode()).hexdigest()[:32]
