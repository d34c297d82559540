"""What a model call inside a session carries on the wire (docs/protocol.md section 2).

Everything here is pure: it turns a turn's facts and the caller's keyword arguments into new
keyword arguments for openai's ``create``, using only openai's public seams ``extra_headers`` and
``extra_body``. Whatever the caller set wins over what agentkv would add.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from openai import NotGiven, Omit

from agentkv import protocol
from agentkv._version import __version__

__all__ = ["TurnTags", "is_tool_continuation", "tag_request"]


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


def tag_request(
    kwargs: Mapping[str, Any],
    tags: TurnTags,
    *,
    send_body: bool,
    preset_headers: Mapping[str, str],
) -> dict[str, Any]:
    """Returns ``kwargs`` plus the turn's headers and, with ``send_body``, its body fields.

    ``preset_headers`` are the client's default headers: a name the caller already sets there or
    in ``extra_headers`` (compared case-insensitively) is left alone.
    """
    caller_headers = _mapping(kwargs.get("extra_headers"), "extra_headers")
    taken = {name.lower() for name in (*preset_headers, *caller_headers)}
    ours = {name: value for name, value in tags.headers().items() if name not in taken}
    tagged = {**kwargs, "extra_headers": {**ours, **caller_headers}}
    if send_body:
        tagged["extra_body"] = {
            **_body_fields(kwargs, tags),
            **_mapping(kwargs.get("extra_body"), "extra_body"),
        }
    return tagged


def is_tool_continuation(kwargs: Mapping[str, Any]) -> bool:
    """True when the request's last input item is a tool result (chat or Responses API)."""
    items = kwargs.get("messages", kwargs.get("input"))
    if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)) or not items:
        return False
    last = items[-1]
    return _field(last, "role") == "tool" or _field(last, "type") == "function_call_output"


def _body_fields(kwargs: Mapping[str, Any], tags: TurnTags) -> dict[str, Any]:
    fields: dict[str, Any] = {protocol.BODY_FIELD: tags.body()}
    if not _is_set(kwargs.get(protocol.BODY_SESSION_ID)):
        fields[protocol.BODY_SESSION_ID] = tags.session_id
    return fields


def _is_set(value: object) -> bool:
    # None counts as unset: frameworks forward None for options nobody configured.
    return value is not None and not isinstance(value, (NotGiven, Omit))


def _mapping(value: object, name: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"agentkv can only merge into a mapping {name}, got {type(value).__name__}")
    return value


def _field(item: object, name: str) -> object:
    # Messages are usually TypedDicts, but callers also pass back openai's pydantic objects.
    if isinstance(item, Mapping):
        return item.get(name)
    return getattr(item, name, None)


def _flag(value: bool) -> str:
    return "1" if value else "0"
