"""Reads what a response says about its turn: the router's headers and the finish reason.

Responses are read as the JSON the server sent (a whole body, or one server-sent event at a
time), so every client and call path that reaches the server is read the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from agentkv import protocol

__all__ = ["finish_reason", "kv_path", "kv_reason", "reused_tokens", "server_timing"]

_TERMINAL_RESPONSE_STATUSES: Final = frozenset({"completed", "incomplete", "failed", "cancelled"})


def kv_path(headers: Mapping[str, str]) -> str | None:
    return headers.get(protocol.HEADER_KV_PATH)


def reused_tokens(headers: Mapping[str, str]) -> int | None:
    value = headers.get(protocol.HEADER_REUSED_TOKENS)
    return int(value) if value is not None and value.strip().isdigit() else None


def server_timing(headers: Mapping[str, str]) -> dict[str, float]:
    """Seconds per named step from a ``Server-Timing`` header (``name;dur=ms, ...``)."""
    return protocol.server_timing_seconds(headers.get(protocol.HEADER_SERVER_TIMING) or "")


def kv_reason(headers: Mapping[str, str]) -> str | None:
    """Why the router chose the turn's KV path: the ``desc`` of its ``plan`` step."""
    value = headers.get(protocol.HEADER_SERVER_TIMING) or ""
    for name, params in protocol.server_timing_entries(value):
        if name == "plan" and params.get("desc"):
            return params["desc"]
    return None


def finish_reason(result: Mapping[str, Any]) -> str | None:
    """The finish reason of a completion, a chunk, a Responses API response or stream event.

    ``tool_calls`` wins over other choices' reasons: a response that asks for a tool is followed by
    a tool step whatever its other choices did. A Responses API result that contains a function
    call counts as ``tool_calls`` too, so that both APIs feed the same prediction.
    """
    choices = result.get("choices")
    if isinstance(choices, list):
        reasons = [
            reason
            for choice in choices
            if isinstance(choice, Mapping) and (reason := choice.get("finish_reason"))
        ]
        return "tool_calls" if "tool_calls" in reasons else next(iter(reasons), None)
    if result.get("object") == "response":
        return _response_finish_reason(result)
    response = result.get("response")
    if isinstance(response, Mapping) and response.get("object") == "response":
        return _response_finish_reason(response)
    return None


def _response_finish_reason(response: Mapping[str, Any]) -> str | None:
    output = response.get("output") or ()
    if any(isinstance(item, Mapping) and item.get("type") == "function_call" for item in output):
        return "tool_calls"
    status = response.get("status")
    return status if status in _TERMINAL_RESPONSE_STATUSES else None
