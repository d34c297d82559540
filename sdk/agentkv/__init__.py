"""agentkv: session-aware OpenAI clients for multi-turn agents on disaggregated vLLM.

Build clients with ``agentkv.OpenAI`` / ``agentkv.AsyncOpenAI`` (or ``agentkv.wrap(client)``, or
hand ``agentkv.http_client()`` to anything that takes an httpx client) and make model calls inside
``with agentkv.session():``. docs/sdk.md is the guide, docs/protocol.md the wire contract.
"""

from agentkv import adapters, protocol
from agentkv._client import AsyncOpenAI, OpenAI, wrap
from agentkv._exceptions import AgentKVError, SessionError
from agentkv._http import async_http_client, http_client
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
    "adapters",
    "async_http_client",
    "current_session",
    "http_client",
    "protocol",
    "session",
    "wrap",
]
