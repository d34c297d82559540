"""agentkv's router: session-aware prefill/decode orchestration with KV reuse.

Start one with ``agentkv router --prefill-url URL --decode-url URL`` or, in code,
``uvicorn.run(create_app(Settings(...)))``. docs/router.md explains the design.
"""

from agentkv_server.router.app import RouterState, create_app
from agentkv_server.router.auth import AccessPolicy, tenant_id
from agentkv_server.router.errors import RouterError
from agentkv_server.router.metrics import RouterMetrics
from agentkv_server.router.policy import (
    AlwaysPolicy,
    CostModelPolicy,
    Decision,
    LocalEstimate,
    NeverPolicy,
    PrefillSample,
    ReusePolicy,
    TurnLoad,
    UpstreamPolicy,
    make_policy,
)
from agentkv_server.router.redis_store import RedisStore
from agentkv_server.router.resilient_store import ResilientStore
from agentkv_server.router.sessions import Holding, InMemoryStore, SessionStore, Ticket
from agentkv_server.router.turn import KVPath, TurnHints

__all__ = [
    "AccessPolicy",
    "AlwaysPolicy",
    "CostModelPolicy",
    "Decision",
    "Holding",
    "InMemoryStore",
    "KVPath",
    "LocalEstimate",
    "NeverPolicy",
    "PrefillSample",
    "RedisStore",
    "ResilientStore",
    "ReusePolicy",
    "RouterError",
    "RouterMetrics",
    "RouterState",
    "SessionStore",
    "Ticket",
    "TurnHints",
    "TurnLoad",
    "UpstreamPolicy",
    "create_app",
    "make_policy",
    "tenant_id",
]
