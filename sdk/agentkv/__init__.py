"""agentkv: session-aware OpenAI clients for multi-turn agents on disaggregated vLLM.

Build clients with ``agentkv.OpenAI`` / ``agentkv.AsyncOpenAI`` (or ``agentkv.wrap(client)``) and
make model calls inside ``with agentkv.session():``. docs/sdk.md is the guide, docs/protocol.md the
wire contract.
"""

from agentkv import protocol
from agentkv._client import AsyncOpenAI, OpenAI, wrap
from agentkv._exceptions import AgentKVError, SessionError
from agentkv._session import Session, TurnInfo, current_session, session
from agentkv._version import __version__

__all__ = [
    "AgentKVError",
    "AsyncOpenAI",
    "OpenAI",
    "Session",
    "SessionError",
    "TurnInfo",
    "__version__",
    "current_session",
    "protocol",
    "session",
    "wrap",
]
