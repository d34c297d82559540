"""What the examples share: where the server is, the local tools, and the per-turn report.

Environment: AGENTKV_BASE_URL (default http://127.0.0.1:8000/v1, what ``agentkv serve`` listens
on), AGENTKV_MODEL (default: the server's first model), OPENAI_API_KEY (default "-"),
AGENTKV_TURNS (model calls per run, default 6, at least 2), AGENTKV_TOOL_LOGIT_BIAS (a JSON
``logit_bias`` sent with every request; ``agentkv serve`` sets it for its random-weight model).

The examples force a tool call on every turn but the last (``tool_choice`` names a function or
says ``required``). A random-weight model still never closes the call's JSON on its own; the
logit bias above favours the tokens that close it. Its arguments remain nonsense, so the tools
accept arguments that do not parse.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import openai

import agentkv

BASE_URL = os.environ.get("AGENTKV_BASE_URL", "http://127.0.0.1:8000/v1")
API_KEY = os.environ.get("OPENAI_API_KEY", "-")
TURNS = max(2, int(os.environ.get("AGENTKV_TURNS", "6")))
LOGIT_BIAS: dict[str, int] | None = json.loads(os.environ.get("AGENTKV_TOOL_LOGIT_BIAS") or "null")
MAX_TOKENS = 64
PROMPT = (
    "Plan a trip to Paris: check the weather, add up the costs, and count the words of the plan."
)


def model_name() -> str:
    """AGENTKV_MODEL, else the first model the server lists."""
    configured = os.environ.get("AGENTKV_MODEL")
    if configured:
        return configured
    return openai.OpenAI(base_url=BASE_URL, api_key=API_KEY).models.list().data[0].id


def weather(city: str = "Paris") -> str:
    """Today's weather in a city."""
    return f"{city}: sunny, 21 C"


def add(a: float = 0, b: float = 0) -> str:
    """Adds two numbers."""
    try:
        return str(float(a) + float(b))
    except (TypeError, ValueError):
        return "error: a and b must be numbers"


def word_count(text: str = "") -> str:
    """Counts the words of a text."""
    return str(len(str(text).split()))


TOOLS: dict[str, Callable[..., str]] = {"weather": weather, "add": add, "word_count": word_count}


def _object(**properties: str) -> dict[str, Any]:
    """A strict JSON schema of an object whose named properties all have the given types."""
    return {
        "type": "object",
        "properties": {name: {"type": kind} for name, kind in properties.items()},
        "required": list(properties),
        "additionalProperties": False,
    }


# Strict schemas: the server decodes arguments under them (OpenAI's ``strict`` function tools).
SCHEMAS: dict[str, dict[str, Any]] = {
    "weather": _object(city="string"),
    "add": _object(a="number", b="number"),
    "word_count": _object(text="string"),
}


def tool_for_turn(turn: int) -> str:
    """The tool forced on a turn (1-based): each in turn."""
    names = list(TOOLS)
    return names[(turn - 1) % len(names)]


def run_tool(name: str, arguments: str | dict[str, Any] | None) -> str:
    """Runs a local tool; unparsable or unexpected arguments become the tool's defaults."""
    tool = TOOLS.get(name)
    if tool is None:
        return f"error: no tool named {name!r}"
    kwargs = _parse(arguments)
    expected = SCHEMAS[name]["properties"]
    return tool(**{key: value for key, value in kwargs.items() if key in expected})


def _parse(arguments: str | dict[str, Any] | None) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def format_turn(info: agentkv.TurnInfo) -> str:
    """One line per model call: turn, TTFT, and whether the KV cache was reused."""
    ttft = "   n/a" if info.ttft_seconds is None else f"{info.ttft_seconds:6.3f}"
    kv = info.kv_path or "no router"
    if info.reused_tokens:
        kv += f" ({info.reused_tokens} tokens reused)"
    after = "after tool results" if info.tool_continuation else "after user input"
    return f"turn {info.turn:2d}  ttft {ttft} s  kv {kv:<28}  {after}"


def summary(session: agentkv.Session) -> str:
    """Turns, how many reused KV, and mean TTFT of the first turn against the later ones."""
    turns = session.turns
    reused = [t for t in turns if t.kv_path == "reuse"]
    later = [t.ttft_seconds for t in turns[1:] if t.ttft_seconds is not None]
    first = turns[0].ttft_seconds if turns and turns[0].ttft_seconds is not None else None
    parts = [
        f"session {session.id}: {len(turns)} turns",
        f"KV reused on {len(reused)} ({sum(t.reused_tokens or 0 for t in reused)} tokens)",
    ]
    if first is not None:
        parts.append(f"TTFT first turn {first:.3f} s")
    if later:
        parts.append(f"later turns mean {sum(later) / len(later):.3f} s")
    return ", ".join(parts)


def report(session: agentkv.Session) -> None:
    """Prints every turn of ``session``, then its summary."""
    for info in session.turns:
        print(format_turn(info), flush=True)
    print(summary(session), flush=True)
