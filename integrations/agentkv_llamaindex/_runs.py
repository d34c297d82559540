"""LlamaIndex workflow runs as agentkv sessions.

A run's steps execute in tasks that copy the context of ``Workflow.run``'s caller, so a run
started inside a session makes every LLM call of that run, in any step, part of the session.
A ``Context`` reused across runs holds one conversation; its runs share one session.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from workflows import Context, Workflow
from workflows.handler import WorkflowHandler

import agentkv

__all__ = ["context_session", "run"]

_lock = threading.Lock()
_by_context: weakref.WeakKeyDictionary[Context, agentkv.Session] = weakref.WeakKeyDictionary()


def run(
    workflow: Workflow,
    *args: Any,
    session: agentkv.Session | None = None,
    **kwargs: Any,
) -> WorkflowHandler:
    """Starts ``workflow.run(*args, **kwargs)`` as one agentkv session and returns its handler.

    The session is ``session`` if given, else the one of the ``ctx`` argument (see
    :func:`context_session`), else a new one. Works for agents (``FunctionAgent``,
    ``AgentWorkflow``...) and any other workflow.
    """
    ctx = kwargs.get("ctx")
    chosen = session or (context_session(ctx) if ctx is not None else agentkv.session())
    with chosen:
        return workflow.run(*args, **kwargs)


def context_session(ctx: Context) -> agentkv.Session:
    """The session of a workflow ``Context``: runs that share the context share the session."""
    with _lock:
        session = _by_context.get(ctx)
        if session is None:
            session = _by_context[ctx] = agentkv.session()
        return session
