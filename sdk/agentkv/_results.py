"""Reads what a response says about its turn: the router's headers and the finish reason."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from agentkv import protocol

__all__ = ["finish_reason", "kv_path", "reused_tokens", "server_timing"]

_TERMINAL_RESPONSE_STATUSES: Final = frozenset({"completed", "incomplete", "failed", "cancelled"})


def kv_path(headers: Mapping[str, str]) -> str | None:
    return headers.get(protocol.HEADER_KV_PATH)


def reused_tokens(headers: Mapping[str, str]) -> int | None:
    value = headers.get(protocol.HEADER_REUSED_TOKENS)
    return int(value) if value is not None and value.strip().isdigit() else None


def server_timing(headers: Mapping[str, str]) -> dict[str, float]:
    """Seconds per named step from a ``Server-Timing`` header (``name;dur=ms, ...``)."""
    steps: dict[str, float] = {}
    for entry in (headers.get(protocol.HEADER_SERVER_TIMING) or "").split(","):
        name, _, params = entry.strip().partition(";")
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if name and key == "dur":
                try:
                    steps[name] = float(value) / 1000
                except ValueError:
                    pass
    return steps


def finish_reason(result: object) -> str | None:
    """The finish reason of a completion, a chunk, a Responses API response or stream event.

    ``tool_calls`` wins over other choices' reasons: a response that asks for a tool is followed by
    a tool step whatever its other choices did. A Responses API result that contains a function
    call counts as ``tool_calls`` too, so that both APIs feed the same prediction.
    """
    choices = getattr(result, "choices", None)
    if isinstance(choices, list):
        reasons = [
            reason for choice in choices if (reason := getattr(choice, "finish_reason", None))
        ]
        return "tool_calls" if "tool_calls" in reasons else next(iter(reasons), None)
    if getattr(result, "object", None) == "response":
        return _response_finish_reason(result)
    if (response := getattr(result, "response", None)) is not None:
        return finish_reason(response) if getattr(response, "object", None) == "response" else None
    return None


def _response_finish_reason(response: object) -> str | None:
    output = getattr(response, "output", None) or ()
    if any(getattr(item, "type", None) == "function_call" for item in output):
        return "tool_calls"
    status = getattr(response, "status", None)
    return status if status in _TERMINAL_RESPONSE_STATUSES else None
