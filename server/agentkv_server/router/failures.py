"""Why an engine step failed, and whether that blames the engine.

Only what the engine did on the wire blames it (docs/router.md, "Which failures blame an
engine"): a refused new connection means it is lost (its KV with it), a dropped connection or no
answer in time means it is suspect. A bad answer, and anything the router failed at itself,
leave it as it was.
"""

from __future__ import annotations

import asyncio
from typing import Final, Literal

from agentkv_server.router.http_client import HTTPConnectError, HTTPConnectionError, HTTPLocalError

__all__ = ["LOST", "STUCK", "SUSPECT", "UNREACHABLE", "ErrorKind", "wire_kind"]

ErrorKind = Literal[
    "connect",
    "disconnect",
    "timeout",
    "status",
    "protocol",
    "stream",
    "stall",
    "hang",
    "router",
    "deadline",
]
"""Why an engine step failed. ``connect``: a new connection refused or unreachable;
``disconnect``: the engine closed or reset a connection before its answer ended; ``stall``: a
step whose engine answered but made no progress (docs/faults.md), or a prefill step that pulled
KV ran past ``timeouts.pull_s`` (then P is not blamed); ``hang``: a step whose engine stopped
answering progress probes; ``router``: the router's own failure (no free connection in time, no
socket); ``deadline``: the turn ran out of ``timeouts.first_token_s`` while its step waited
(never the engine's fault: it was busy, not dead)."""
LOST: Final[frozenset[ErrorKind]] = frozenset({"connect"})
"""The engine's process is gone: down, and every holding issued before is void."""
STUCK: Final[frozenset[ErrorKind]] = frozenset({"timeout", "hang", "stall"})
"""The engine answered nothing in time, or made no progress."""
SUSPECT: Final[frozenset[ErrorKind]] = STUCK | {"disconnect"}
"""The engine is down until a health probe passes; its KV may still be there."""
UNREACHABLE: Final[frozenset[ErrorKind]] = frozenset(
    {"connect", "disconnect", "timeout", "hang", "router"}
)
"""No answer at all: another try on the same engine would fail or wait again."""


def wire_kind(exc: BaseException) -> ErrorKind:
    """The kind of an engine call that failed with ``exc`` (an HTTP client failure)."""
    if isinstance(exc, HTTPLocalError):
        return "router"
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, HTTPConnectError):
        return "connect"
    if isinstance(exc, HTTPConnectionError):
        return "disconnect"
    return "protocol"
