"""What a model call inside a session carries on the wire (docs/protocol.md section 2).

Everything here is pure: it turns a turn's facts and a request's JSON body and header names into
what the request should carry. Whatever the caller set wins over what agentkv would add.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agentkv import protocol
from agentkv._version import __version__

__all__ = ["TurnTags", "headers_to_add", "is_tool_continuation", "tag_body"]


@dataclass(frozen=True, slots=True)
class TurnTags:
    """The facts one model call tells the router about its session."""

    session_id: str
    turn: int
    tool_continuation: bool
    session_end: bool
    next_turn_seconds: float | None

    def headers(self) -> dict[str, str]:
        headers = {
            protocol.HEADER_SESSION_ID: self.session_id,
            protocol.HEADER_TURN: str(self.turn),
            protocol.HEADER_TOOL_CONTINUATION: _flag(self.tool_continuation),
            protocol.HEADER_SESSION_END: _flag(self.session_end),
            protocol.HEADER_VERSION: __version__,
        }
        if self.next_turn_seconds is not None:
            headers[protocol.HEADER_NEXT_TURN_SECONDS] = f"{self.next_turn_seconds:.3f}"
        return headers

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            protocol.BODY_KEY_SESSION_ID: self.session_id,
            protocol.BODY_KEY_TURN: self.turn,
            protocol.BODY_KEY_TOOL_CONTINUATION: self.tool_continuation,
            protocol.BODY_KEY_SESSION_END: self.session_end,
            protocol.BODY_KEY_VERSION: __version__,
        }
        if self.next_turn_seconds is not None:
            body[protocol.BODY_KEY_NEXT_TURN_SECONDS] = round(self.next_turn_seconds, 3)
        return body


def headers_to_add(tags: TurnTags, present: Iterable[str]) -> dict[str, str]:
    """The turn's headers whose names (compared case-insensitively) are not ``present`` yet."""
    taken = {name.lower() for name in present}
    return {name: value for name, value in tags.headers().items() if name not in taken}


def tag_body(body: Mapping[str, Any], tags: TurnTags) -> dict[str, Any]:
    """``body`` plus the turn's body object and the session id as ``prompt_cache_key``.

    A field the caller set already (to anything but null) is left alone.
    """
    tagged = dict(body)
    if body.get(protocol.BODY_FIELD) is None:
        tagged[protocol.BODY_FIELD] = tags.body()
    # null counts as unset: frameworks forward None for options nobody configured.
    if body.get(protocol.BODY_SESSION_ID) is None:
        tagged[protocol.BODY_SESSION_ID] = tags.session_id
    return tagged


def is_tool_continuation(body: Mapping[str, Any]) -> bool:
    """True when the request's last input item is a tool result (chat or Responses API)."""
    items = body.get("messages", body.get("input"))
    if not isinstance(items, list) or not items:
        return False
    last = items[-1]
    if not isinstance(last, Mapping):
        return False
    return last.get("role") == "tool" or last.get("type") == "function_call_output"


def _flag(value: bool) -> str:
    return "1" if value else "0"
