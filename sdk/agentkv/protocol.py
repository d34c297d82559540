"""Names agentkv puts on the wire, shared by the SDK (writer) and the router (reader).

docs/protocol.md is the prose version of this module; keep the two in step.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Final

__all__ = [
    "BODY_FIELD",
    "BODY_KEY_NEXT_TURN_SECONDS",
    "BODY_KEY_SESSION_END",
    "BODY_KEY_SESSION_ID",
    "BODY_KEY_TOOL_CONTINUATION",
    "BODY_KEY_TURN",
    "BODY_KEY_VERSION",
    "BODY_SESSION_ID",
    "HEADER_KV_PATH",
    "HEADER_NEXT_TURN_SECONDS",
    "HEADER_PREFIX",
    "HEADER_RESPONSE_SESSION_ID",
    "HEADER_REUSED_TOKENS",
    "HEADER_SERVER_TIMING",
    "HEADER_SESSION_END",
    "HEADER_SESSION_ID",
    "HEADER_TOOL_CONTINUATION",
    "HEADER_TURN",
    "HEADER_VERSION",
    "SESSION_ID_BODY_FIELDS",
    "SESSION_ID_HEADERS",
    "SESSION_ID_MAX_LENGTH",
    "SESSION_ID_PATTERN",
    "is_valid_session_id",
    "server_timing_entries",
    "server_timing_seconds",
]

# Session id, emitted by the SDK (header + body copy, proxies drop unknown headers).
HEADER_SESSION_ID: Final = "x-session-id"
BODY_SESSION_ID: Final = "prompt_cache_key"

# Every convention the router accepts, in priority order (docs/protocol.md). Lower case:
# HTTP header names are case-insensitive.
SESSION_ID_HEADERS: Final = ("x-session-id", "x-dynamo-session-id", "x-litellm-session-id")
SESSION_ID_BODY_FIELDS: Final = ("prompt_cache_key", "conversation_id")

SESSION_ID_MAX_LENGTH: Final = 128
SESSION_ID_PATTERN: Final = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")

# Turn metadata: headers, and one body object with the same facts.
HEADER_TURN: Final = "x-agentkv-turn"
HEADER_TOOL_CONTINUATION: Final = "x-agentkv-tool-continuation"
HEADER_NEXT_TURN_SECONDS: Final = "x-agentkv-next-turn-seconds"
HEADER_SESSION_END: Final = "x-agentkv-session-end"
HEADER_VERSION: Final = "x-agentkv-version"
HEADER_PREFIX: Final = "x-agentkv-"
BODY_FIELD: Final = "agentkv"
# Keys of the body object (BODY_FIELD), one per header above, plus the session id.
BODY_KEY_SESSION_ID: Final = "session_id"
BODY_KEY_TURN: Final = "turn"
BODY_KEY_TOOL_CONTINUATION: Final = "tool_continuation"
BODY_KEY_NEXT_TURN_SECONDS: Final = "next_turn_seconds"
BODY_KEY_SESSION_END: Final = "session_end"
BODY_KEY_VERSION: Final = "version"

# Router -> client.
HEADER_RESPONSE_SESSION_ID: Final = "x-agentkv-session-id"
HEADER_KV_PATH: Final = "x-agentkv-kv-path"
HEADER_REUSED_TOKENS: Final = "x-agentkv-reused-tokens"
# Standard HTTP Server-Timing: the router's steps before the first byte (plan, prefill, decode).
HEADER_SERVER_TIMING: Final = "server-timing"


def is_valid_session_id(value: str) -> bool:
    """True when ``value`` can be used as a session id on the wire."""
    return bool(SESSION_ID_PATTERN.fullmatch(value))


def server_timing_entries(value: str) -> Iterator[tuple[str, dict[str, str]]]:
    """Each entry of a ``Server-Timing`` value (``name;dur=ms;desc="why", ...``): its name and
    parameters, a quoted value unquoted."""
    for entry in value.split(","):
        name, _, rest = entry.strip().partition(";")
        params = {}
        for param in rest.split(";"):
            key, _, param_value = param.strip().partition("=")
            params[key] = param_value.strip('"')
        yield name, params


def server_timing_seconds(value: str) -> dict[str, float]:
    """Seconds per named step of a ``Server-Timing`` value (its ``dur``, in ms on the wire)."""
    steps: dict[str, float] = {}
    for name, params in server_timing_entries(value):
        if name and "dur" in params:
            try:
                steps[name] = float(params["dur"]) / 1000
            except ValueError:
                pass
    return steps
