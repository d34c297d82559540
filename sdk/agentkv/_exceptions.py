"""One exception tree for all of agentkv.

AgentKVError                  root: catch this to catch anything agentkv raises
 ├── SessionError             misuse of agentkv.session (bad id, negative time, stray exit)
 └── agentkv_server.errors.*  the server side's errors derive from the same root
"""

from __future__ import annotations

__all__ = ["AgentKVError", "SessionError"]


class AgentKVError(Exception):
    """Root of every exception raised by agentkv."""


class SessionError(AgentKVError, ValueError):
    """An agentkv session was used in a way that cannot work."""
