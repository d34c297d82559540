"""LlamaIndex workflow runs as agentkv sessions.

A run's steps execute in tasks that copy the context of ``Workflow.run``'s caller, so a run
started inside a session makes every LLM call of that run, in any step, part of the session:
``with agentkv.session(): handler = agent.run(...)`` needs no wrapper. A ``Context`` reused across
runs holds one conversation; :func:`context_session` gives its runs one session.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from typing import Any

from workflows import Context, Workflow
from workflows.handler import WorkflowHandler

import agentkv
from agentkv.adapters import SessionCache

__all__ = ["context_session", "run"]

_lock = threading.Lock()
# A Context is not hashable by content and must not be kept alive by agentkv: each gets a random
# key, forgotten with it; the session itself lives in the shared cache under that key.
_keys: weakref.WeakKeyDictionary[Context, str] = weakref.WeakKeyDictionary()
_sessions = SessionCache()


def context_session(ctx: Context) -> agentkv.Session:
    """The session of a workflow ``Context``: runs that share the context share the session.

    ``with context_session(ctx): handler = agent.run(..., ctx=ctx)``
    """
    with _lock:
        key = _keys.get(ctx)
        if key is None:
            key = _keys[ctx] = uuid.uuid4().hex
    return _sessions.get(key)


def run(
    workflow: Workflow,
    *args: Any,
    session: agentkv.Session | None = None,
    **kwargs: Any,
) -> WorkflowHandler:
    """``workflow.run(*args, **kwargs)`` started in one agentkv session; returns its handler.

    The session is ``session`` if given, else the one of the ``ctx`` argument (see
    :func:`context_session`), else a new one. Shorthand for starting ``workflow.run`` inside
    ``with`` that session.
    """
    ctx = kwargs.get("ctx")
    chosen = session or (context_session(ctx) if ctx is not None else agentkv.session())
    with chosen:
        return workflow.run(*args, **kwargs)
